"""Metrics records as scalar series, for TensorBoard and MLflow: one series per rank, one for
the job, one per GPU (docs/diagnosis.md, "What is logged")."""

from __future__ import annotations

import math
from collections import OrderedDict
from statistics import median
from typing import Any, NamedTuple

JOB = "job"
RESTART = ""  # the key of a point that marks where a restarted attempt's series go on
PENDING_STEPS = 256  # job steps waiting for their last ranks (a dead rank never completes one)
# Fields that count, name or place a record rather than measure the run.
BOOKKEEPING = frozenset(
    {"type", "rank", "local_rank", "time", "step", "tokens", "samples", "interval_s", "measured"}
)
# How the job's value at a step comes from its ranks' values: the rest is the mean.
SUMMED = frozenset({"tokens_per_s", "samples_per_s", "tflops", "power_w", "energy_j"})
HIGHEST = frozenset({"step_time_ms", "peak_mem_gib"})


class Point(NamedTuple):
    """One value of one series: ``series`` is ``job``, ``rank<R>`` or ``gpu/<node>/<index>``.

    A point whose key is ``RESTART`` carries no value: the series goes on from ``step`` after
    a restart, and what an earlier attempt recorded from there on is stale."""

    series: str
    key: str
    step: int
    value: float
    time: float  # Unix seconds


class Scalars:
    """Turns records, as they arrive, into points. ``attempt()`` before each attempt's records."""

    def __init__(self) -> None:
        self.world_size = 0
        self._meta: dict[int, dict[str, Any]] = {}
        self._last: dict[int, tuple[int, float]] = {}  # rank → (step, time) of its last record
        self._pending: OrderedDict[int, dict[int, tuple[float, dict[str, float]]]] = OrderedDict()
        self.step = 0  # the latest step any rank reported: the x of telemetry samples
        self._attempts = 0
        self._restarted: set[str] = set()  # the series marked in this attempt

    def attempt(self, world_size: int) -> None:
        """A new attempt on ``world_size`` ranks: rates start afresh, steps may go back."""
        self.world_size = world_size
        self._attempts += 1
        self._restarted.clear()
        self._meta.clear()
        self._last.clear()
        self._pending.clear()

    def record(self, rank: int, record: dict[str, Any]) -> list[Point]:
        """The points one rank's record gives: its own, and the job's when it completes a step."""
        kind = record.get("type")
        if kind == "meta":
            self._meta[rank] = record
            return self._restart(rank, record)
        step = record.get("step")
        if kind == "final" or not isinstance(step, int) or isinstance(step, bool):
            return []
        when = _number(record.get("time")) or 0.0
        values = self._values(rank, record, step, when)
        self._last[rank] = (step, when)
        self.step = step
        if not values:
            return []
        points = [Point(f"rank{rank}", k, step, v, when) for k, v in values.items()]
        return points + self._job(rank, step, when, values)

    def _restart(self, rank: int, meta: dict[str, Any]) -> list[Point]:
        """After a restart, the built-in trainer's ``meta`` says the step it resumed from: its
        rank's series and the job's go on from the next one."""
        start = meta.get("start_step")
        if self._attempts < 2 or not isinstance(start, int) or isinstance(start, bool):
            return []
        when = _number(meta.get("time")) or 0.0
        marks = [s for s in (f"rank{rank}", JOB) if s not in self._restarted]
        self._restarted.update(marks)
        return [Point(s, RESTART, start + 1, math.nan, when) for s in marks]

    def telemetry(self, node: str, sample: dict[str, Any]) -> list[Point]:
        """One GPU sample (``launcher.telemetry``) as points at the latest step."""
        series = f"gpu/{node}/{sample.get('gpu', 0)}"
        when = _number(sample.get("time")) or 0.0
        return [
            Point(series, k, self.step, v, when)
            for k, raw in sample.items()
            if k not in ("time", "gpu") and (v := _number(raw)) is not None
        ]

    def _values(
        self, rank: int, record: dict[str, Any], step: int, when: float
    ) -> dict[str, float]:
        out = {
            k: v
            for k, raw in record.items()
            if k not in BOOKKEEPING and (v := _number(raw)) is not None
        }
        last = self._last.get(rank)
        interval = _number(record.get("interval_s"))
        if interval is None and last is not None:
            interval = when - last[1]  # a script's report(): the gap since its previous one
        if interval is None or interval <= 0:
            return out
        for count, rate in (("tokens", "tokens_per_s"), ("samples", "samples_per_s")):
            if n := _number(record.get(count)):
                out[rate] = n / interval
        times = record.get("step_times_ms")
        steps = step - last[0] if last is not None else None
        if isinstance(times, list) and times and all(_number(t) is not None for t in times):
            out["step_time_ms"] = float(median(times))
        elif steps:
            out["step_time_ms"] = 1e3 * interval / steps
        if (wait := _number(record.get("data_wait_s"))) is not None:
            out["data_wait_pct"] = 100 * wait / interval
        meta = self._meta.get(rank, {})
        flops, peak = _number(meta.get("flops_per_token")), _number(meta.get("peak_tflops"))
        if flops and "tokens_per_s" in out:
            out["tflops"] = out["tokens_per_s"] * flops / 1e12
            if peak:
                out["mfu"] = out["tflops"] / peak
        return out

    def _job(self, rank: int, step: int, when: float, values: dict[str, float]) -> list[Point]:
        """The job's points at ``step`` once all ``world_size`` ranks have given it."""
        ranks = self._pending.setdefault(step, {})
        ranks[rank] = (when, values)
        if len(ranks) < self.world_size:
            while len(self._pending) > PENDING_STEPS:
                self._pending.popitem(last=False)
            return []
        del self._pending[step]
        latest = max(t for t, _ in ranks.values())
        keys = dict.fromkeys(k for _, vals in ranks.values() for k in vals)
        points = []
        for key in keys:
            got = [vals[key] for _, vals in ranks.values() if key in vals]
            value = (
                sum(got) if key in SUMMED else max(got) if key in HIGHEST else sum(got) / len(got)
            )
            points.append(Point(JOB, key, step, value, latest))
        return points


def _number(value: Any) -> float | None:
    """A record's value as a float; None for text, lists, booleans and nulls."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
