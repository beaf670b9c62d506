"""``train.profile``: torch.profiler over a window of optimizer steps on chosen ranks.

Each recording rank writes, to ``$LAUNCHER_PROFILE_DIR`` (the launcher points it at the node's
workdir and brings the files back into the run directory's ``profile/<node>/``; ``./profile``
under bare torchrun):

* ``rank<R>.trace.json.gz``: the Chrome/Perfetto trace (open it in https://ui.perfetto.dev);
* ``rank<R>.ops.txt``: the top operators by self device time (self CPU time on the CPU), and
  the recorded steps' wall time.

The profiler starts before step ``start_step`` and stops after ``start_step + steps - 1``,
with a device synchronisation at both ends so the trace holds every kernel of those steps.
"""

from __future__ import annotations

import gzip
import logging
import os
import shutil
import time
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
        trace = stem.with_suffix(".trace.json.gz")
        with open(raw, "rb") as src, gzip.open(trace, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        sort_by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=30, max_name_column_width=70)
        header = (f"rank {self.rank}, steps {self.first}..{self.last}: {wall_ms:.1f} ms per step "
                  f"under the profiler, sorted by {sort_by}\n")
        stem.with_suffix(".ops.txt").write_text(header + table + "\n", encoding="utf-8")
        log.warning("profile of steps %d..%d written to %s (%.1f ms per step while recording)",
                    self.first, self.last, trace, wall_ms)
        return trace
