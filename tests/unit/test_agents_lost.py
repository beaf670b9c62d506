"""``AgentGroup`` after a node is lost: every agent is still told to stop, only the others are
waited for, and every actor is killed (pure logic: Ray's calls are recorded, not made)."""

from __future__ import annotations

import pytest
import ray

from launcher.orchestrate.agents import AgentGroup
from launcher.orchestrate.records import AgentUpdate

DEAD = 2


class Calls:
    """Records ``handle.<method>.remote()`` calls and what ``ray.get``/``ray.wait`` were given."""

    def __init__(self):
        self.sent: list[tuple[int, str]] = []
        self.awaited: list[tuple[int, str]] = []
        self.killed: list[int] = []

    def get(self, refs, timeout=None):
        if isinstance(refs, list):
            return [self.get(r) for r in refs]
        self.awaited.append(refs)
        agent, method = refs
        if agent == DEAD:
            raise RuntimeError("The actor is unavailable: RpcError: Socket closed")
        return AgentUpdate() if method == "poll" else None

    def wait(self, refs, num_returns=1, timeout=None):
        self.awaited.extend(refs)
        return list(refs), []


class Method:
    def __init__(self, calls: Calls, agent: int, name: str):
        self.calls, self.agent, self.name = calls, agent, name

    def remote(self, *args):
        self.calls.sent.append((self.agent, self.name))
        return (self.agent, self.name)


class Handle:
    def __init__(self, calls: Calls, agent: int):
        self.agent = agent
        for name in ("stop", "poll", "cleanup", "hostname", "collect"):
            setattr(self, name, Method(calls, agent, name))


@pytest.fixture
def calls(monkeypatch) -> Calls:
    calls = Calls()
    monkeypatch.setattr(ray, "get", calls.get)
    monkeypatch.setattr(ray, "wait", calls.wait)
    monkeypatch.setattr(ray, "kill", lambda handle: calls.killed.append(handle.agent))
    return calls


def test_a_lost_agent_is_told_to_stop_but_not_waited_for(calls: Calls):
    group = AgentGroup([Handle(calls, i) for i in range(3)])
    lost = group.unreachable(exclude=0)
    assert lost is not None and lost[0] == DEAD
    calls.sent.clear()
    calls.awaited.clear()

    group.stop(grace_s=2.0)
    # the lost one too: it may only be slow
    assert {(i, "stop") for i in range(3)} <= set(calls.sent)
    assert (DEAD, "stop") not in calls.awaited and (DEAD, "poll") not in calls.awaited
    assert {(0, "stop"), (1, "stop"), (0, "poll"), (1, "poll")} <= set(calls.awaited)

    assert group.collect("profile").keys() == {0, 1}
    group.close()
    assert {(i, "cleanup") for i in range(3)} <= set(calls.sent)
    assert (DEAD, "cleanup") not in calls.awaited and (0, "cleanup") in calls.awaited
    assert sorted(calls.killed) == [0, 1, 2]


def test_without_a_lost_agent_every_agent_is_waited_for(calls: Calls):
    group = AgentGroup([Handle(calls, i) for i in range(2)])
    group.stop(grace_s=2.0)
    group.close()
    assert {(i, m) for i in range(2) for m in ("stop", "poll", "cleanup")} <= set(calls.awaited)
