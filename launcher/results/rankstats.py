"""One rank's metrics records folded as they arrive, into what its summary row, the training,
checkpoint and restart summaries need: the launcher's memory stays flat however long the run."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Any

KEPT = 16384  # step times per rank and kind; below it the percentiles are exact


class Sample:
    """Values in arrival order, at most ``KEPT``: every ``stride``-th one once there were more."""

    def __init__(self) -> None:
        self.values = array("d")
        self.stride = 1
        self.seen = 0

    def add(self, value: float) -> None:
        if self.seen % self.stride == 0:
            if len(self.values) >= KEPT:
                self.values = self.values[::2]
                self.stride *= 2
            if self.seen % self.stride == 0:
                self.values.append(value)
        self.seen += 1


class RankStats:
    """Fed one rank's records in file order (``add``); read by ``results.summary``."""

    def __init__(self, records: Iterable[dict[str, Any]] = ()) -> None:
        self.meta: dict[str, Any] | None = None  # the first meta record
        self.final: dict[str, Any] | None = None  # the last final record
        self.start_steps: list[int] = []  # the meta records' start_step
        self.steps = 0  # step records
        self.max_step = 0  # the largest ``step or 0`` of any step record
        self.last_int_step: int | None = None  # the largest integer step
        self.peak_mem: float | None = None
        # measured intervals
        self.intervals = 0
        self.seconds = 0.0
        self.tokens = 0
        self.samples = 0
        self.step_ms = Sample()  # from step_times_ms
        self.span_ms = Sample()  # interval / its steps, where no record has step_times_ms
        self.wait_s: float | None = None
        self.wait_span_s = 0.0
        self.clock = (0.0, 0)  # (sum of sm_clock_mhz, records with it)
        self.limits = (0, 0)  # (records with clock_limits, of them limited)
        self.energy: float | None = 0  # None once an interval lacks energy_j
        # training
        self.last_step_rec: dict[str, Any] | None = None
        self.loss: Any = None
        self.eval: tuple[Any, Any] | None = None  # (eval_loss, step)
        self.skipped = 0
        # checkpoints: step → the longest blocking_s and that record's parts (``<part>_s``),
        # completed steps, a background save's time from start to complete, async flags seen
        self.held: dict[int, float] = {}
        self.parts: dict[int, dict[str, float]] = {}
        self.complete: set[int] = set()
        self.save_s: dict[int, float] = {}
        self.modes: set[bool] = set()
        self._prev: tuple[Any, Any] = (0, None)  # the previous step record's (step, time)
        for record in records:
            self.add(record)

    def add(self, rec: dict[str, Any]) -> None:
        kind = rec.get("type")
        if kind == "step":
            self._step(rec)
        elif kind == "meta":
            if self.meta is None:
                self.meta = rec
            if isinstance(rec.get("start_step"), int):
                self.start_steps.append(rec["start_step"])
        elif kind == "final":
            self.final = rec
        elif kind == "checkpoint" and rec.get("blocking_s") is not None:
            step = int(rec["step"])
            blocking = float(rec["blocking_s"])
            if step not in self.held or blocking >= self.held[step]:
                self.held[step] = max(blocking, 0.0)
                self.parts[step] = checkpoint_parts(rec)
            self.modes.add(bool(rec.get("async")))
            if not rec.get("async"):
                self.complete.add(step)
        elif kind == "checkpoint_complete":
            self.complete.add(int(rec["step"]))
            if isinstance(rec.get("save_s"), (int, float)):
                self.save_s[int(rec["step"])] = float(rec["save_s"])

    def _step(self, rec: dict[str, Any]) -> None:
        self.steps += 1
        self.max_step = max(self.max_step, rec.get("step") or 0)
        if isinstance(rec.get("step"), int):
            step = rec["step"]
            self.last_int_step = (
                step if self.last_int_step is None else max(self.last_int_step, step)
            )
        if rec.get("peak_mem_gib") is not None:
            peak = rec["peak_mem_gib"]
            self.peak_mem = peak if self.peak_mem is None else max(self.peak_mem, peak)
        self.last_step_rec = {k: rec.get(k) for k in ("step", "grad_norm")}
        if rec.get("loss") is not None:
            self.loss = rec["loss"]
        if rec.get("eval_loss") is not None:
            self.eval = (rec["eval_loss"], rec.get("step"))
        self.skipped += rec.get("skipped_steps") or 0

        prev_step, prev_time = self._prev
        span = rec.get("interval_s")
        if span is None and rec.get("time") is not None and prev_time is not None:
            span = float(rec["time"]) - float(prev_time)
        if span is not None and span > 0 and rec.get("measured", True):
            self._interval(rec, float(span), (rec.get("step") or 0) - (prev_step or 0))
        self._prev = (rec.get("step", 0), rec.get("time"))

    def _interval(self, rec: dict[str, Any], span: float, n: int) -> None:
        self.intervals += 1
        self.seconds += span
        self.tokens += rec.get("tokens") or 0
        self.samples += rec.get("samples") or 0
        for t in rec.get("step_times_ms") or ():
            self.step_ms.add(float(t))
        if n > 0:
            self.span_ms.add(span * 1000.0 / n)
        if rec.get("data_wait_s") is not None:
            self.wait_s = (self.wait_s or 0) + rec["data_wait_s"]
            self.wait_span_s += span
        if rec.get("sm_clock_mhz") is not None:
            self.clock = (self.clock[0] + rec["sm_clock_mhz"], self.clock[1] + 1)
        if rec.get("clock_limits") is not None:
            self.limits = (self.limits[0] + 1, self.limits[1] + (1 if rec["clock_limits"] else 0))
        energy = rec.get("energy_j")
        self.energy = None if energy is None or self.energy is None else self.energy + energy

    def gpu(self) -> dict[str, float | None]:
        """The summary's GPU columns (``metrics.gpu_summary``'s keys) of the measured intervals."""
        energy = self.energy if self.intervals else None
        return {
            "sm_clock_mhz": self.clock[0] / self.clock[1] if self.clock[1] else None,
            "clock_limited_pct": 100 * self.limits[1] / self.limits[0] if self.limits[0] else None,
            "power_w": energy / self.seconds if energy is not None and self.seconds > 0 else None,
            "energy_mj_per_token": 1e3 * energy / self.tokens
            if energy is not None and self.tokens
            else None,
        }


def checkpoint_parts(rec: dict[str, Any]) -> dict[str, float]:
    """A ``checkpoint`` record's parts of its ``blocking_s``: each ``<part>_s`` number."""
    return {
        key[:-2]: float(value)
        for key, value in rec.items()
        if key.endswith("_s")
        and key != "blocking_s"
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
    }
