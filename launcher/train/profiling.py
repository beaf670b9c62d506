"""``train.profile``: torch.profiler over a window of optimizer steps on chosen ranks, written
as a Perfetto trace and an ops table per rank.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from launcher.spec.job import ProfileSpec

log = logging.getLogger(__name__)


class StepProfiler:
    """Call ``before_step(step)`` and ``after_step(step)`` around every optimizer step."""

    def __init__(
        self, spec: ProfileSpec, *, rank: int, device: torch.device, out_dir: Path | None = None
    ):
        self.enabled = spec.start_step > 0 and (spec.ranks == "all" or rank in spec.ranks)
        self.first, self.last = spec.start_step, spec.start_step + spec.steps - 1
        self.rank = rank
        self.device = device
        self.out_dir = out_dir or Path(os.environ.get("LAUNCHER_PROFILE_DIR") or "profile")
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
        timeline = kinds = gaps = None
        if self.device.type == "cuda":
            events = json.loads(data).get("traceEvents", [])
            steps = self.last - self.first + 1
            timeline = device_timeline(events, steps=steps, device=self.device.index)
            kinds = kernel_breakdown(events, steps=steps, device=self.device.index)
            gaps = idle_gaps(events, steps=steps, device=self.device.index)
        sort_by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=30, max_name_column_width=70)
        header = (
            f"rank {self.rank}, steps {self.first}..{self.last}: {wall_ms:.1f} ms per step "
            f"under the profiler, sorted by {sort_by}\n"
        )
        if timeline is not None:
            header += timeline_line(timeline) + "\n"
        if gaps is not None:
            header += gaps_text(gaps) + "\n"
        if kinds is not None:
            header += "\n" + breakdown_table(kinds) + "\n\n"
        stem.with_suffix(".ops.txt").write_text(header + table + "\n", encoding="utf-8")
        log.warning(
            "profile of steps %d..%d written to %s (%.1f ms per step while recording)",
            self.first,
            self.last,
            trace,
            wall_ms,
        )
        return trace


# -- the device timeline ----------------------------------------------------------------------

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


def device_events(events: Iterable[dict[str, Any]], device: int | None) -> Iterator[dict[str, Any]]:
    """The trace's kernels, copies and memsets on ``device`` (on every device when None)."""
    for e in events:
        if (
            e.get("cat") in DEVICE_CATEGORIES
            and "dur" in e
            and (device is None or e.get("args", {}).get("device", device) == device)
        ):
            yield e


def device_timeline(
    events: Iterable[dict[str, Any]], *, steps: int, device: int | None = None
) -> dict[str, float] | None:
    """Where a recorded step's device time goes, in ms per step, from Chrome-trace events:
    compute, communication, communication no compute overlaps, and idle; None without device
    activity."""
    compute: list[tuple[float, float]] = []
    comm: list[tuple[float, float]] = []
    for e in device_events(events, device):
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        (comm if kernel_kind(str(e.get("name", ""))) == "communication" else compute).append(
            (start, end)
        )
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
        # communication no compute overlaps: what the union adds to compute alone
        "comm_exposed_ms": (_length(every) - _length(compute_u)) * per_step_ms,
        "idle_ms": (span - _length(every)) * per_step_ms,
        "kernels": (len(compute) + len(comm)) / steps,
    }


def timeline_line(t: dict[str, float]) -> str:
    return (
        f"device timeline per step: span {t['span_ms']:.2f} ms, compute {t['compute_ms']:.2f} ms, "
        f"communication {t['comm_ms']:.2f} ms ({t['comm_exposed_ms']:.2f} ms not overlapped by compute), "
        f"idle {t['idle_ms']:.2f} ms, {t['kernels']:.0f} kernels"
    )


SHORT_GAP_US = 5.0  # from one kernel to the next in a queue the host keeps full (launch latency)


def idle_gaps(
    events: Iterable[dict[str, Any]], *, steps: int, device: int | None = None, top: int = 5
) -> dict[str, Any] | None:
    """Where the device sat idle, in ms per step: gaps under ``SHORT_GAP_US`` and longer ones
    (waiting for the host), the ``top`` longest with what ran on either side."""
    found = sorted(device_events(events, device), key=lambda e: float(e["ts"]))
    if not found:
        return None
    gaps: list[tuple[float, str, str]] = []
    busy_until, last = float(found[0]["ts"]) + float(found[0]["dur"]), str(found[0].get("name", ""))
    for e in found[1:]:
        start, end, name = float(e["ts"]), float(e["ts"]) + float(e["dur"]), str(e.get("name", ""))
        if start > busy_until:
            gaps.append((start - busy_until, last, name))
        if end > busy_until:
            busy_until, last = end, name
    short = [g for g in gaps if g[0] < SHORT_GAP_US]
    long = sorted((g for g in gaps if g[0] >= SHORT_GAP_US), reverse=True)
    per_step_ms = 1e-3 / steps
    return {
        "short_ms": sum(g[0] for g in short) * per_step_ms,
        "short": len(short) / steps,
        "long_ms": sum(g[0] for g in long) * per_step_ms,
        "long": len(long) / steps,
        "longest": [
            {"us": us, "after": after, "before": before} for us, after, before in long[:top]
        ],
    }


def gaps_text(g: dict[str, Any], name_width: int = 60) -> str:
    lines = [
        f"idle per step: {g['short_ms']:.2f} ms in {g['short']:g} gaps under {SHORT_GAP_US:g} us "
        f"(kernel to kernel), {g['long_ms']:.2f} ms in {g['long']:g} longer ones (the device waiting "
        f"for the host)"
    ]
    lines += [
        f"  {x['us']:9.1f} us after {x['after'][:name_width]}, before {x['before'][:name_width]}"
        for x in g["longest"]
    ]
    return "\n".join(lines)


# Kinds of kernels, by name: the first kind with a matching (lower-case) pattern wins;
# kernels that match nothing are "other".
KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl",)),
    ("attention", ("fmha", "flash", "sdpa", "attention", "attn", "cudnn::fusion")),
    (
        "matrix products",
        ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk", "sm90_", "sm80_", "ampere_"),
    ),
    (
        "optimizer and gradient norm",
        ("adam", "sgd", "fusedoptimizer", "lpnorm", "multi_tensor_apply"),
    ),
    ("normalization", ("layer_norm", "rms_norm", "batch_norm", "group_norm")),
    ("activation", ("gelu", "silu", "relu", "tanh", "sigmoid")),
    ("loss", ("logsumexp", "cross_entropy", "nll_loss", "log_softmax", "xent")),
    (
        "copies, casts, memsets",
        ("memcpy", "memset", "copy", "clone", "cat", "stack", "permute", "transpose"),
    ),
)


def kernel_kind(name: str) -> str:
    lower = name.lower()
    return next(
        (kind for kind, patterns in KERNEL_KINDS if any(p in lower for p in patterns)), "other"
    )


def kernel_breakdown(
    events: Iterable[dict[str, Any]], *, steps: int, device: int | None = None, top: int = 15
) -> dict[str, Any] | None:
    """Device time per step by kind of kernel (``KERNEL_KINDS``) and the ``top`` kernels.

    Times are the kernels' own durations summed (kernels on concurrent streams both count),
    in ms per recorded step; counts are launches per step. None without device activity.
    """
    per_name: dict[str, list[float]] = {}
    for e in device_events(events, device):
        entry = per_name.setdefault(str(e.get("name", "")), [0.0, 0])
        entry[0] += float(e["dur"])
        entry[1] += 1
    if not per_name:
        return None
    per_step_ms = 1e-3 / steps
    kind_of = {name: kernel_kind(name) for name in per_name}
    kinds: dict[str, float] = {}
    for name, (us, _) in per_name.items():
        kinds[kind_of[name]] = kinds.get(kind_of[name], 0.0) + us * per_step_ms
    busiest = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "total_ms": sum(kinds.values()),
        "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "top": [
            {"name": name, "kind": kind_of[name], "ms": us * per_step_ms, "launches": n / steps}
            for name, (us, n) in busiest
        ],
    }


def breakdown_table(b: dict[str, Any], name_width: int = 90) -> str:
    from tabulate import tabulate

    total = b["total_ms"] or 1.0
    kinds = tabulate(
        [(kind, f"{ms:.2f}", f"{100 * ms / total:.1f}") for kind, ms in b["kinds"].items()],
        headers=["kernels by kind", "ms per step", "% of kernel time"],
        disable_numparse=True,
    )
    top = tabulate(
        [
            (f"{k['ms']:.3f}", f"{k['launches']:g}", k["kind"], k["name"][:name_width])
            for k in b["top"]
        ],
        headers=["ms per step", "launches per step", "kind", "kernel"],
        disable_numparse=True,
    )
    return f"{kinds}\n\n{top}"


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
