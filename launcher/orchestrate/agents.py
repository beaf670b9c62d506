"""The node agents as one group: one ``NodeAgent`` actor per node, placed by a placement group.

Bundle ``i`` is pinned to node ``i``; the watch loop and diagnosis see the actors only through
this group, which unit tests replace with a fake.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from typing import Any

from launcher.errors import JobFailed
from launcher.orchestrate.plan import LaunchPlan
from launcher.orchestrate.ray_cluster import RaySession
from launcher.orchestrate.records import AgentUpdate, RankError
from launcher.spec import NodeSpec
from launcher.util import first_line

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 60.0
REACH_TIMEOUT_S = 5.0  # a trivial call that takes longer: the node is unreachable


class AgentGroup:
    def __init__(self, handles: list[Any], placement: Any = None):
        self.handles = handles
        self._placement = placement
        self._pending: dict[int, tuple[Any, float]] = {}  # agent → (poll in flight, sent at)
        self._exited: set[int] = set()
        # Agents taken for lost: not waited for (their torchrun dies with them, PR_SET_PDEATHSIG).
        self._lost: set[int] = set()

    @classmethod
    def place(
        cls, session: RaySession, nodes: list[NodeSpec], gpus: dict[str, int], name: str
    ) -> AgentGroup:
        """One bundle and one agent per node; JobFailed (exit 4) when Ray cannot place them."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from launcher.orchestrate.agent import NodeAgent

        bundles = [
            {
                "CPU": 1,
                f"node:{session.node_ips[n.name]}": 0.001,
                **({"GPU": gpus[n.name]} if gpus[n.name] else {}),
            }
            for n in nodes
        ]
        pg = placement_group(
            bundles, strategy="STRICT_SPREAD" if len(bundles) > 1 else "PACK", name=name
        )
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except Exception as err:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
            raise JobFailed(
                f"Ray could not place one agent per node (bundles {bundles}) within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s: {first_line(err)}. Check `ray status`: every node needs "
                f"a free CPU and its GPUs"
            ) from err
        actor = ray.remote(NodeAgent)
        handles = [
            actor.options(
                num_cpus=1,
                num_gpus=gpus[node.name],
                scheduling_strategy=(
                    PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
                ),
            ).remote(node.name)
            for i, node in enumerate(nodes)
        ]
        return cls(handles, pg)

    # -- one attempt --------------------------------------------------------------------------

    def free_port(self) -> int:
        """A free port on the first node (the rendezvous port); JobFailed when its agent fails."""
        import ray

        try:
            return ray.get(self.handles[0].free_port.remote(), timeout=CALL_TIMEOUT_S)
        except Exception as err:
            raise JobFailed(
                f"the agent on the first node did not give a free port: {_reason(err)}"
            ) from err

    def routes(self, nodes: list[NodeSpec]) -> dict[str, dict[str, Any]]:
        """Each node's route to the head (``nodes[0]``) and its interfaces, as its agent finds
        them (``NodeAgent.route``); a node whose agent fails gets ``{"route": {"error": ...}}``."""
        head = nodes[0].net_address
        answers = _answers([h.route.remote(head) for h in self.handles], CALL_TIMEOUT_S)
        return {
            node.name: answer
            if not isinstance(answer, Exception)
            else {"route": {"to": head, "error": f"its agent did not answer: {_reason(answer)}"}}
            for node, answer in zip(nodes, answers, strict=True)
        }

    def check_reach(self, launch_plan: LaunchPlan, timeout_s: float) -> dict[str, str]:
        """Every node opens a TCP connection to the head's rendezvous port from its workers'
        interface while the head's agent listens there (``reach.py``); node → what failed."""
        import ray

        port, master = launch_plan.master_port, launch_plan.master_addr
        head = self.handles[0]
        try:
            ray.get(head.listen.remote(port), timeout=CALL_TIMEOUT_S)
        except Exception as err:
            return {launch_plan.nodes[0].name: f"cannot listen on port {port}: {_reason(err)}"}
        try:
            refs = [
                h.reach.remote(master, port, n.env.get("GLOO_SOCKET_IFNAME"), timeout_s)
                for h, n in zip(self.handles, launch_plan.nodes, strict=True)
            ]
            answers = _answers(refs, timeout_s + REACH_TIMEOUT_S)
            return {
                node.name: f"its agent did not answer the check: {_reason(problem)}"
                if isinstance(problem, Exception)
                else problem
                for node, problem in zip(launch_plan.nodes, answers, strict=True)
                if problem
            }
        finally:
            with contextlib.suppress(Exception):
                ray.get(head.unlisten.remote(), timeout=CALL_TIMEOUT_S)

    def start(self, launch_plan: LaunchPlan, files: dict[str, str]) -> None:
        """Start every node's torchrun as the plan says; JobFailed naming the first node whose
        agent could not (a missing interpreter or working directory, a lost node, no answer)."""
        import ray

        starts = [
            handle.start.remote(
                {"run_id": launch_plan.run_id, "cwd": n.cwd, "argv": n.argv, "env": n.env}, files
            )
            for handle, n in zip(self.handles, launch_plan.nodes, strict=True)
        ]
        self._pending.clear()
        self._exited.clear()
        deadline = time.monotonic() + 2 * CALL_TIMEOUT_S
        for ref, node in zip(starts, launch_plan.nodes, strict=True):
            try:
                ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            except Exception as err:
                raise JobFailed(
                    f"torchrun could not be started on node {node.name}: {_reason(err)} "
                    f"(command: {' '.join(node.argv[:3])} …, in {node.cwd or 'the copy of the workdir'})"
                ) from err

    def poll(self, wait_s: float) -> list[tuple[int, AgentUpdate | BaseException]]:
        """Long-poll every running agent: up to ``2 * wait_s`` for the first answer, then every
        answer there by then. An exception for an answer means the agent's node is gone."""
        import ray

        now = time.monotonic()
        for i, handle in enumerate(self.handles):
            if i not in self._pending and i not in self._exited:
                self._pending[i] = (handle.poll.remote(wait_s), now)
        refs = {ref: i for i, (ref, _) in self._pending.items()}
        ready, rest = ray.wait(list(refs), num_returns=1, timeout=2 * wait_s) if refs else ([], [])
        if ready and rest:  # the first answer came: take every other one that is there too
            ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        answers: list[tuple[int, AgentUpdate | BaseException]] = []
        for ref in ready:
            i = refs[ref]
            del self._pending[i]
            try:
                update = ray.get(ref)
            except Exception as err:
                self._lost.add(i)
                answers.append((i, err))
                continue
            if update.exit is not None:
                self._exited.add(i)
            answers.append((i, update))
        return sorted(answers, key=lambda a: a[0])

    def silent(self, limit_s: float) -> int | None:
        """An agent whose poll has gone unanswered for ``limit_s``, if any."""
        now = time.monotonic()
        silent = next(
            (i for i, (_, sent) in sorted(self._pending.items()) if now - sent > limit_s), None
        )
        if silent is not None:
            self._lost.add(silent)
        return silent

    def unreachable(self, exclude: int) -> tuple[int, BaseException] | None:
        """The first other agent that does not answer a trivial call within a few seconds."""
        others = [i for i in range(len(self.handles)) if i != exclude]
        answers = _answers([self.handles[i].hostname.remote() for i in others], REACH_TIMEOUT_S)
        for i, answer in zip(others, answers, strict=True):
            if isinstance(answer, Exception):
                self._lost.add(i)
                return i, answer
        return None

    def stacks(self, wait_s: float = 5.0) -> dict[str, bytes]:
        """Every reachable node's stack dumps and collective traces (``NodeAgent.stacks``), asked
        of all at once; a node that does not answer in time gives none."""
        live = [i for i in range(len(self.handles)) if i not in self._lost]
        refs = [self.handles[i].stacks.remote(wait_s) for i in live]
        out: dict[str, bytes] = {}
        for answer in _answers(refs, wait_s + REACH_TIMEOUT_S):
            if not isinstance(answer, Exception):
                out.update(answer)
        return out

    def tail(self, i: int, local_rank: int | None, n: int) -> list[str]:
        import ray

        return ray.get(self.handles[i].tail.remote(local_rank, n), timeout=10)

    def errors(self, i: int) -> list[RankError]:
        import ray

        return ray.get(self.handles[i].errors.remote(), timeout=10)

    def stop(self, grace_s: float, first: int = signal.SIGTERM) -> list[tuple[int, AgentUpdate]]:
        """Stop every node's workers (``NodeAgent.stop``); returns the updates still owed. A lost
        agent is asked too but not waited for: a dead node must not delay the summary."""
        import ray

        live = [i for i in range(len(self.handles)) if i not in self._lost]
        owed: list[tuple[int, AgentUpdate]] = []
        for i, (ref, _) in sorted(self._pending.items()):
            if i in self._lost:
                continue
            with contextlib.suppress(Exception):
                owed.append((i, ray.get(ref, timeout=REACH_TIMEOUT_S)))
        self._pending.clear()
        stops = [h.stop.remote(grace_s, first) for h in self.handles]
        wait_s = (2 if first == signal.SIGINT else 1) * grace_s + 15
        for i, answer in zip(live, _answers([stops[i] for i in live], wait_s), strict=True):
            if isinstance(answer, Exception):
                log.warning("could not confirm that agent %d stopped: %s", i, first_line(answer))
        for i in live:
            with contextlib.suppress(Exception):
                owed.append((i, ray.get(self.handles[i].poll.remote(), timeout=10)))
        return owed

    # -- the end ------------------------------------------------------------------------------

    def collect(self, subdir: str) -> dict[int, dict[str, bytes]]:
        """Each agent's ``<node dir>/<subdir>`` files (e.g. profiles), before ``close`` removes them."""
        import ray

        out = {}
        for i, handle in enumerate(self.handles):
            if i in self._lost:
                continue
            try:
                out[i] = ray.get(handle.collect.remote(subdir), timeout=CALL_TIMEOUT_S)
            except Exception as err:
                log.warning("could not fetch %s/ from agent %d: %s", subdir, i, first_line(err))
        return out

    def close(self) -> None:
        """Remove the node dirs, end the actors, remove the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        cleanups = [h.cleanup.remote() for h in self.handles]
        with contextlib.suppress(Exception):
            ray.get([ref for i, ref in enumerate(cleanups) if i not in self._lost], timeout=15)
        for handle in self.handles:
            with contextlib.suppress(Exception):
                ray.kill(handle)
        if self._placement is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self._placement)
        self.handles, self._placement = [], None


def _answers(refs: list[Any], timeout_s: float) -> list[Any]:
    """Each call's answer, or the exception it raised, after waiting ``timeout_s`` for all."""
    import ray

    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=0.1))
        except Exception as err:
            out.append(err)
    return out


def _reason(err: BaseException) -> str:
    """What went wrong in an actor call: the exception the actor raised (a RayTaskError's
    ``cause``, whose own message starts with Ray's header), else the error itself."""
    cause = getattr(err, "cause", None)
    return first_line(cause if isinstance(cause, BaseException) else err)
