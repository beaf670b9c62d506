"""One job at a time on the same GPUs or CPU slots, in submission order.

``decide`` is the pure rule; a named actor (``JobBoard``) keeps which jobs have started.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from launcher import signals

POLL_S = 1.0


@dataclass(frozen=True)
class Ticket:
    """A job in the queue: who, and what it holds while it runs (node id → resource → count)."""

    job_id: str
    name: str
    demand: dict[str, dict[str, float]]
    node_names: dict[str, str] = field(default_factory=dict)  # node id → name in cluster.yaml


@dataclass(frozen=True)
class Alive:
    """A launcher job Ray reports PENDING or RUNNING, with its submission time (ms)."""

    job_id: str
    name: str
    submitted_ms: int


def decide(
    me: Ticket,
    alive: list[Alive],
    started: dict[str, Ticket],
    capacity: dict[str, dict[str, float]],
) -> str | None:
    """None when ``me`` may start now, else why it waits (one sentence)."""
    order = sorted(alive, key=lambda a: (a.submitted_ms, a.job_id))
    mine = next((i for i, a in enumerate(order) if a.job_id == me.job_id), len(order))
    for earlier in order[:mine]:
        if earlier.job_id not in started:
            return f"queued behind job {earlier.job_id} ({earlier.name}), submitted earlier and not started yet"
    living = {a.job_id for a in alive}
    holders = [t for job_id, t in started.items() if job_id in living and job_id != me.job_id]
    for node, wants in me.demand.items():
        for resource, amount in wants.items():
            total = capacity.get(node, {}).get(resource, 0.0)
            need = min(amount, total)
            held = [(t, t.demand.get(node, {}).get(resource, 0.0)) for t in holders]
            used = sum(n for _, n in held)
            if need > 0 and used + need > total:
                who = ", ".join(f"{t.job_id} ({t.name})" for t, n in held if n > 0)
                return (
                    f"waiting for {_amount(need, resource)} on {me.node_names.get(node, node)}, "
                    f"held by job {who}"
                )
    return None


class JobBoard:
    """The named actor that knows which launcher jobs have started (their tickets)."""

    def __init__(self) -> None:
        self._started: dict[str, Ticket] = {}

    def start(self, ticket: Ticket) -> None:
        self._started[ticket.job_id] = ticket

    def end(self, job_id: str) -> None:
        self._started.pop(job_id, None)

    def started(self, alive: list[str]) -> dict[str, Ticket]:
        """The started tickets, forgetting those of jobs that are no longer alive."""
        self._started = {j: t for j, t in self._started.items() if j in alive}
        return dict(self._started)


def board() -> Any:
    """The cluster's board (created by the first driver that asks; 0 CPUs, lives with Ray)."""
    import ray

    options = {"name": "launcher-job-board", "namespace": "launcher", "lifetime": "detached"}
    return ray.remote(JobBoard).options(**options, get_if_exists=True, num_cpus=0).remote()


def wait_turn(
    me: Ticket,
    *,
    alive: Callable[[], list[Alive]],
    capacity: dict[str, dict[str, float]],
    on_wait: Callable[[str], None],
) -> Any:
    """Block until ``me`` may start, calling ``on_wait(reason)`` when the reason changes; then
    record it as started and return the board (``board.end.remote(me.job_id)`` at the end)."""
    import ray

    handle = board()
    said = None
    while True:
        signals.check()
        now = alive()
        started = ray.get(handle.started.remote([a.job_id for a in now]))
        reason = decide(me, now, started, capacity)
        if reason is None:
            ray.get(handle.start.remote(me))
            return handle
        if reason != said:
            on_wait(reason)
            said = reason
        time.sleep(POLL_S)


def _amount(n: float, resource: str) -> str:
    count = int(n) if float(n).is_integer() else n
    unit = {"GPU": "GPU", "CPU": "CPU slot"}.get(resource, resource)
    return f"{count} {unit}{'s' if count != 1 else ''}"
