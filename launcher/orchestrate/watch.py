"""One attempt's watch loop: poll the agents until every node's torchrun is done or one fails
(a failed rank, a lost node or a hang).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Protocol

from launcher import signals
from launcher.orchestrate.diagnose import TAIL_LINES, Tails, hung_rank, lost_node, rank_failure
from launcher.orchestrate.plan import LaunchPlan, NodePlan
from launcher.orchestrate.records import AgentUpdate, ExitStatus, Failure
from launcher.orchestrate.stacks import blame, describe, main_frames, user_frames

POLL_INTERVAL_S = 0.5
NODE_SILENCE_S = 30.0  # an agent that answers no poll for this long is a lost node
# the hang watchdog's least limit before a rank's first record (imports, rendezvous)
STARTUP_S = 120.0


class Agents(Tails, Protocol):
    """What the watch loop asks of the agents (``agents.AgentGroup``, or a fake in tests)."""

    def poll(self, wait_s: float) -> list[tuple[int, AgentUpdate | BaseException]]: ...

    def silent(self, limit_s: float) -> int | None: ...

    def unreachable(self, exclude: int) -> tuple[int, BaseException] | None: ...

    def stacks(self) -> dict[str, bytes]: ...


class Watcher:
    def __init__(
        self,
        agents: Agents,
        launch_plan: LaunchPlan,
        *,
        on_update: Callable[[NodePlan, AgentUpdate], None],
        hang_timeout_s: float | None,
        on_stacks: Callable[[dict[str, bytes]], None] = lambda files: None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.agents = agents
        self.plan = launch_plan
        self.on_update = on_update
        self.hang_timeout_s = hang_timeout_s
        self.on_stacks = on_stacks
        self.clock = clock
        self._started = clock()  # the hang watchdog counts from the workers' start
        self._last_seen: dict[int, float] = {}
        self._last_step: dict[int, tuple[int, float]] = {}
        self._exited: dict[int, ExitStatus] = {}

    def run(self) -> Failure | None:
        """Until the attempt ends: None when every node's torchrun exited 0, else the failure."""
        while True:
            signals.check()
            done, failure = self.step()
            if done:
                return failure

    def step(self) -> tuple[bool, Failure | None]:
        """One round: (whether the attempt is over, its failure)."""
        nodes = self.plan.nodes
        for i, answer in self.agents.poll(POLL_INTERVAL_S):
            if isinstance(answer, BaseException):
                return True, lost_node(nodes[i], answer)
            self._take(nodes[i], answer)
            if answer.exit is not None:
                self._exited[i] = answer.exit
        failed = [(i, status) for i, status in self._exited.items() if status.exit_code != 0]
        if failed:
            i, status = failed[0]
            lost = self.agents.unreachable(exclude=i)
            if lost is not None:
                return True, lost_node(nodes[lost[0]], lost[1])
            try:
                return True, rank_failure(self.agents, i, nodes[i], status)
            # its agent died after reporting the exit: no log to read there
            except Exception as err:
                return True, lost_node(nodes[i], err)
        if len(self._exited) == len(nodes):
            return True, None
        silent = self.agents.silent(NODE_SILENCE_S)
        if silent is not None:
            return True, lost_node(
                nodes[silent], TimeoutError(f"no answer for {NODE_SILENCE_S:.0f} s")
            )
        hung = self._hung()
        return hung is not None, hung

    def _take(self, node: NodePlan, update: AgentUpdate) -> None:
        self.on_update(node, update)
        now = self.clock()
        for rank, record in update.records:
            self._last_seen[rank] = now
            if record.get("type") == "step" and isinstance(record.get("step"), int):
                self._last_step[rank] = (record["step"], float(record.get("time") or 0.0))

    def _hung(self) -> Failure | None:
        limit = self.hang_timeout_s
        if not limit:
            return None
        now = self.clock()
        done = {self.plan.nodes[i].name for i in self._exited}  # exited 0: quiet, not hung
        silent = [
            e
            for e in self.plan.ranks()
            if e["node"] not in done
            and now - self._last_seen.get(e["rank"], self._started)
            > (limit if e["rank"] in self._last_seen else max(limit, STARTUP_S))
        ]
        if not silent:
            return None
        stacks = self._dump_stacks()
        # Several ranks go silent at once: blame the one outside the others' collective, else
        # the one that got least far.
        found = blame(stacks)
        if found is not None:
            entry = next(e for e in self.plan.ranks() if e["rank"] == found[0])
            where = (
                f"is not in the {found[1]} the other ranks wait in: it is at {describe(found[2])}"
            )
        else:
            entry = min(silent, key=lambda e: self._last_step.get(e["rank"], (-1, 0.0)))
            frames = user_frames(main_frames(stacks.get(entry["rank"], "")))
            where = f"it is at {describe(frames)}" if frames else ""
        i = next(i for i, n in enumerate(self.plan.nodes) if n.name == entry["node"])
        tail: list[str] = []
        with contextlib.suppress(Exception):  # a lost agent has no tail to give; the logs remain
            tail = self.agents.tail(i, entry["local_rank"], TAIL_LINES)
        quiet_s = now - self._last_seen.get(entry["rank"], self._started)
        return hung_rank(self.plan.nodes[i], entry["rank"], quiet_s, limit, tail, where=where)

    def _dump_stacks(self) -> dict[int, str]:
        """Every worker's stack files, handed to ``on_stacks``; the text of each rank's."""
        files: dict[str, bytes] = {}
        with contextlib.suppress(Exception):  # no stacks: the hang is still reported
            files = self.agents.stacks()
        if files:
            self.on_stacks(files)
        out = {}
        for name, data in files.items():
            rank = name.removeprefix("rank").removesuffix(".txt")
            if name.endswith(".txt") and rank.isdigit():
                out[int(rank)] = data.decode("utf-8", "replace")
        return out
