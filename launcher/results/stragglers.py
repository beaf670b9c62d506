"""Stragglers while a run goes: each rank's recent time per step against the other ranks'
(docs/diagnosis.md, "Stragglers while the run goes")."""

from __future__ import annotations

import collections
import contextlib
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WINDOW = 20  # steps
THRESHOLD = 0.2  # slower than the others' median by more than this
CONFIRM = 3  # records in a row
MIN_STEPS = 5  # per rank, before any rank is judged
EXACT_RANKS = 16  # up to this many ranks the others' median is computed for every record
# Preflight facts that differ between healthy nodes too: not a reason for a slow node.
VOLATILE = ("host", "time", "clock", "free", "addr", "interface", "pid", "elapsed", "took", "path")


@dataclass
class Straggler:
    """A rank named slow: how much, against what, and what differs on its node."""

    rank: int
    node: str
    slower_pct: float
    step_ms: float
    others_ms: float
    compute: bool  # from the rank's own compute time, not wall time
    details: list[str] = field(default_factory=list)

    def line(self) -> str:
        what = "compute" if self.compute else "step time"
        text = (
            f"straggler: rank {self.rank} on node {self.node}, {self.slower_pct:.0f}% slower than "
            f"the median of the other ranks over the last {WINDOW} steps ({what} "
            f"{self.step_ms:.0f} vs {self.others_ms:.0f} ms per step)"
        )
        return text + "".join(f"; {d}" for d in self.details)

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "node": self.node,
            "slower_pct": round(self.slower_pct, 1),
            "step_ms": round(self.step_ms, 2),
            "others_ms": round(self.others_ms, 2),
            "from": "compute_s" if self.compute else "step time",
            "details": self.details,
        }


class StragglerWatch:
    """Fed every metrics record as it arrives; ``add`` returns a straggler when one is first named."""

    def __init__(self, nodes: dict[int, str], facts: dict[str, dict[str, Any]] | None = None):
        self.nodes = nodes  # rank → node
        self.facts = facts or {}  # node → its preflight facts
        self.found: dict[int, Straggler] = {}  # every rank named, with its latest figures
        self._times: dict[int, collections.deque[float]] = {}
        self._last: dict[int, tuple[int, float]] = {}  # rank → (step, time) of its last record
        self._compute: dict[int, bool] = {}
        self._slow_in_a_row: dict[int, int] = {}
        self._clock: dict[int, float] = {}
        self._median: float | None = None  # many ranks: all ranks' median, refreshed a round
        self._since = 0  # records judged since
        self._ready: set[int] = set()  # ranks with MIN_STEPS steps

    def add(self, rank: int, record: dict[str, Any]) -> Straggler | None:
        if record.get("type") != "step" or not isinstance(record.get("step"), int):
            return None
        step, at = record["step"], float(record.get("time") or 0.0)
        last = self._last.get(rank)
        self._last[rank] = (step, at)
        steps = step - last[0] if last else len(record.get("step_times_ms") or ()) or None
        if record.get("sm_clock_mhz") is not None:
            self._clock[rank] = float(record["sm_clock_mhz"])
        if not steps or steps <= 0 or record.get("measured") is False:
            return None
        if record.get("compute_s") is not None:
            seconds, self._compute[rank] = float(record["compute_s"]), True
        elif record.get("interval_s") is not None:
            seconds = float(record["interval_s"])
        elif last is not None:
            seconds = at - last[1]
        else:
            return None
        times = self._times.setdefault(rank, collections.deque(maxlen=WINDOW))
        times.extend([seconds / steps] * min(steps, WINDOW))
        return self._judge(rank)

    def _judge(self, rank: int) -> Straggler | None:
        if len(self._times[rank]) >= MIN_STEPS:
            self._ready.add(rank)
        ready = self._ready
        if rank not in ready or len(ready) < max(2, len(self.nodes)):
            return None
        mine = statistics.fmean(self._times[rank])
        median = self._others_median(rank, ready)
        slower = mine / median - 1 if median > 0 else 0.0
        if slower <= THRESHOLD:
            self._slow_in_a_row[rank] = 0
            return None
        self._slow_in_a_row[rank] = self._slow_in_a_row.get(rank, 0) + 1
        first = rank not in self.found
        if self._slow_in_a_row[rank] < CONFIRM and first:
            return None
        node = self.nodes.get(rank, "?")
        self.found[rank] = Straggler(
            rank=rank,
            node=node,
            slower_pct=100 * slower,
            step_ms=1e3 * mine,
            others_ms=1e3 * median,
            compute=self._compute.get(rank, False),
            details=self._details(rank, node),
        )
        return self.found[rank] if first else None

    def _others_median(self, rank: int, ready: set[int]) -> float:
        """The median of the other ranks' means: exact for a few ranks; for many, the median
        of all ranks', refreshed once a round of records (one rank moves it little), so that
        the cost per record stays flat as the job grows."""
        if len(ready) <= EXACT_RANKS:
            return statistics.median(statistics.fmean(self._times[r]) for r in ready if r != rank)
        self._since += 1
        if self._median is None or self._since >= len(ready):
            self._median = statistics.median(statistics.fmean(self._times[r]) for r in ready)
            self._since = 0
        return self._median

    def _details(self, rank: int, node: str) -> list[str]:
        out = []
        others = [c for r, c in self._clock.items() if r != rank]
        if rank in self._clock and others:
            out.append(f"SM clock {self._clock[rank]:.0f} vs {statistics.median(others):.0f} MHz")
        if diffs := node_differences(self.facts, node):
            out.append(f"node {node} differs in its preflight facts: " + ", ".join(diffs))
        return out


def preflight_facts(folder: Path) -> dict[str, dict[str, Any]]:
    """Each node's preflight facts (``<folder>/<node>.json``), where they were recorded."""
    out = {}
    for path in sorted(folder.glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            if isinstance(data := json.loads(path.read_text()), dict):
                out[path.stem] = data
    return out


def node_differences(facts: dict[str, dict[str, Any]], node: str, limit: int = 5) -> list[str]:
    """``key: value vs others' value`` for each preflight fact where ``node`` differs from what
    most other nodes have (volatile facts such as host names and clocks left out)."""
    if node not in facts or len(facts) < 2:
        return []
    flat = {name: _flatten(data) for name, data in facts.items()}
    mine = flat[node]
    out = []
    for key in sorted(mine):
        if any(v in key.lower() for v in VOLATILE):
            continue
        theirs = {repr(f.get(key)): f.get(key) for name, f in flat.items() if name != node}
        counts = collections.Counter(repr(f.get(key)) for name, f in flat.items() if name != node)
        common = counts.most_common(1)[0][0]
        if repr(mine[key]) != common:
            out.append(f"{key} {mine[key]} vs {theirs[common]}")
    return out[:limit]


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested facts as ``a.b.0.c`` keys; a list is flattened where it holds a few mappings."""
    if isinstance(data, list) and len(data) <= 16 and all(isinstance(x, dict) for x in data):
        data = dict(enumerate(data))
    if not isinstance(data, dict):
        return {prefix.rstrip("."): data}
    out: dict[str, Any] = {}
    for k, v in data.items():
        out.update(_flatten(v, f"{prefix}{k}."))
    return out
