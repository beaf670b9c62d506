"""``train.profile``: torch.profiler over a window of optimizer steps on chosen ranks.

Each recording rank writes, to ``$LAUNCHER_PROFILE_DIR`` (the launcher points it at the node's
workdir and brings the files back into the run directory's ``profile/<node>/``; ``./profile``
under bare torchrun):

* ``rank<R>.trace.json.gz``: the Chrome/Perfetto trace (open it in https://ui.perfetto.dev);
* ``rank<R>.ops.txt``: the recorded steps' wall time; on GPUs the device timeline per step
  (``device_timeline``: compute, communication and how much of it no compute hides, idle);
  then the top operators by self device time (self CPU time on the CPU).

The profiler starts before step ``start_step`` and stops after ``start_step + steps - 1``,
with a device synchronisation at both ends so the trace holds every kernel of those steps.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from launcher.spec.job import ProfileSpec

log = logging.getLogger(__name__)


def profile_dir() -> Path:
    return Path(os.environ.get("LAUNCHER_PROFILE_DIR") or "profile")


class StepProfiler:
    """Call ``before_step(step)`` and ``after_step(step)`` around every optimizer step."""

    def __init__(self, spec: ProfileSpec, *, rank: int, device: torch.device, out_dir: Path | None = None):
        self.enabled = spec.start_step > 0 and (spec.ranks == "all" or rank in spec.ranks)
        self.first, self.last = spec.start_step, spec.start_step + spec.steps - 1
        self.rank = rank
        self.device = device
        self.out_dir = out_dir or profile_dir()
        self._prof: Any = None
        self._began = 0.0

    def before_step(self, step: int) -> None:
        if not self.enabled or step != self.first:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._sync()
        self._prof = profile(activities=activities)
        self._prof.start()
        self._began = time.perf_counter()

    def after_step(self, step: int) -> Path | None:
        """Stop and write the files after the last recorded step; returns the trace's path."""
        if self._prof is None or step != self.last:
            return None
        self._sync()
        wall_ms = (time.perf_counter() - self._began) * 1e3 / (self.last - self.first + 1)
        prof, self._prof = self._prof, None
        prof.stop()
        return self._write(prof, wall_ms)

    def close(self) -> None:
        """Stop a recording that an error cut short (nothing is written)."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            try:
                prof.stop()
            except Exception as err:  # noqa: BLE001 - already failing; do not mask the real error
                log.warning("could not stop the profiler: %s", err)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _write(self, prof: Any, wall_ms: float) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = self.out_dir / f"rank{self.rank}"
        raw = stem.with_suffix(".trace.json")
        prof.export_chrome_trace(str(raw))
        data = raw.read_bytes()  # read once: gzipped here, and parsed for the device timeline
        trace = stem.with_suffix(".trace.json.gz")
        with gzip.open(trace, "wb", compresslevel=6) as dst:
            dst.write(data)
        raw.unlink()
        timeline = None
        if self.device.type == "cuda":
            events = json.loads(data).get("traceEvents", [])
            timeline = device_timeline(events, steps=self.last - self.first + 1, device=self.device.index)
        sort_by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=30, max_name_column_width=70)
        header = (f"rank {self.rank}, steps {self.first}..{self.last}: {wall_ms:.1f} ms per step "
                  f"under the profiler, sorted by {sort_by}\n")
        if timeline is not None:
            header += timeline_line(timeline) + "\n"
        stem.with_suffix(".ops.txt").write_text(header + table + "\n", encoding="utf-8")
        log.warning("profile of steps %d..%d written to %s (%.1f ms per step while recording)",
                    self.first, self.last, trace, wall_ms)
        return trace


# -- the device timeline ----------------------------------------------------------------------

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


def device_timeline(events: Iterable[dict[str, Any]], *, steps: int, device: int | None = None) -> dict[str, float] | None:
    """Where a recorded step's device time goes, in ms per step, from Chrome-trace events.

    Kernels (and copies, memsets) on every stream of ``device`` (all devices when None) are
    merged into busy intervals. Communication is any kernel whose name contains "nccl", the
    rest is compute. ``comm_exposed`` is communication time that no compute overlaps: with
    DDP, the all-reduce the backward did not hide. ``comm`` also counts a collective's wait
    for a slower rank, which is why it can differ between ranks. ``idle`` is time with nothing
    running in the span from the first kernel's start to the last one's end: on a GPU-bound
    step, gaps between launches; more than that, the device waiting for the host.
    Returns None when the events hold no device activity (a CPU run).
    """
    compute: list[tuple[float, float]] = []
    comm: list[tuple[float, float]] = []
    for e in events:
        if e.get("cat") not in DEVICE_CATEGORIES or "dur" not in e:
            continue
        if device is not None and e.get("args", {}).get("device", device) != device:
            continue
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        (comm if "nccl" in str(e.get("name", "")).lower() else compute).append((start, end))
    if not compute and not comm:
        return None
    every = _union(compute + comm)
    compute_u, comm_u = _union(compute), _union(comm)
    span = every[-1][1] - every[0][0]
    per_step_ms = 1e-3 / steps  # trace times are microseconds
    return {
        "span_ms": span * per_step_ms,
        "compute_ms": _length(compute_u) * per_step_ms,
        "comm_ms": _length(comm_u) * per_step_ms,
        "comm_exposed_ms": (_length(comm_u) - _overlap(comm_u, compute_u)) * per_step_ms,
        "idle_ms": (span - _length(every)) * per_step_ms,
        "kernels": (len(compute) + len(comm)) / steps,
    }


def timeline_line(t: dict[str, float]) -> str:
    return (f"device timeline per step: span {t['span_ms']:.2f} ms, compute {t['compute_ms']:.2f} ms, "
            f"communication {t['comm_ms']:.2f} ms ({t['comm_exposed_ms']:.2f} ms not overlapped by compute), "
            f"idle {t['idle_ms']:.2f} ms, {t['kernels']:.0f} kernels")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
