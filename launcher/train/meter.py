"""Honest per-rank throughput: step times, tokens/s, TFLOP/s, MFU, memory, data wait.

No device synchronisation in the loop: a log step's marks are read once the next step is
queued. The warm-up is excluded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import resource
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from launcher.metrics import gpu_summary, write_record
from launcher.telemetry import Nvml
from launcher.train.health import read_interval
from launcher.util import percentile

log = logging.getLogger(__name__)

# Dense (no sparsity) peak TFLOP/s per precision, from the vendors' data sheets. Matched by
# substring of the device name, first match wins (so "H100 PCIe" precedes "H100").
PEAK_TFLOPS: list[tuple[str, dict[str, float | None]]] = [
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9}),
    ("H200", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    ("A10G", {"bf16": 125.0, "fp16": 125.0, "tf32": None, "fp32": None}),
    ("RTX 4090", {"bf16": 165.0, "fp16": 165.0, "tf32": 82.6, "fp32": 82.6}),
    ("RTX 3090", {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
]


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The dense peak for this device and precision (fp32/tf32/bf16/fp16), or None."""
    for key, peaks in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return peaks.get(precision)
    return None


class HostTimer:
    """Step marks from ``time.perf_counter`` (CPU work is synchronous)."""

    def mark(self) -> float:
        return time.perf_counter()

    @staticmethod
    def wait(mark: float) -> None:
        """Nothing to wait for: the work before the mark is done."""

    @staticmethod
    def elapsed_ms(start: float, end: float) -> float:
        return (end - start) * 1e3


class CudaTimer:
    """Step marks as CUDA events recorded on the current stream; read after a sync."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def wait(mark: torch.cuda.Event) -> None:
        """Block the host until the device has passed the mark."""
        mark.synchronize()

    @staticmethod
    def elapsed_ms(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end)


def peak_memory_gib(device: torch.device) -> float:
    """CUDA: max allocated by tensors. CPU: the process's peak RSS (ru_maxrss, KiB on Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


NO_GPU_SAMPLE: dict[str, Any] = dict.fromkeys(
    ("gpu_util_pct", "sm_clock_mhz", "power_w", "clock_limits", "energy_counter_j")
)


class GpuMonitor(Nvml):
    """One GPU through NVML: utilisation, SM clock, board power and what limits the clock; every
    value None where NVML (nvidia-ml-py) is not importable or does not answer."""

    def __init__(self, device: torch.device):
        self._nvml: Any = None
        self._handle: Any = None
        if device.type != "cuda":
            return
        super().__init__()
        if self._nvml is None:
            return
        try:
            uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))
            if uuid:
                self._handle = self._nvml.nvmlDeviceGetHandleByUUID(
                    uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
                )
            else:
                self._handle = self._nvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        except Exception as err:  # NVML runs but does not know this GPU: the values stay null
            log.warning(
                "NVML does not find %s (%s): no GPU utilisation, clock or power in the records",
                device,
                err,
            )
            self.close()

    def __call__(self) -> dict[str, Any]:
        """``gpu_util_pct``, ``sm_clock_mhz``, ``power_w``, ``clock_limits`` (names) and
        ``energy_counter_j`` (the GPU's energy since the driver loaded) now."""
        if self._nvml is None:
            return dict(NO_GPU_SAMPLE)
        sample = self.read(
            self._handle, "util_pct", "sm_clock_mhz", "power_w", "clock_limits", "energy_counter_j"
        )
        return {"gpu_util_pct": sample.pop("util_pct"), **sample}


@dataclasses.dataclass
class _Interval:
    """The steps since the last log step, closed at a log step and read one step later."""

    step: int  # the log step that closed it
    steps: int
    marks: list[Any]  # the timer marks ending each step, after the previous interval's last
    first_step: int
    rows: torch.Tensor  # per step: the loss (mean over the ranks) and grad norm, to the host
    eval_loss: torch.Tensor | None  # at its log step, on its way to the host
    aside: list[tuple[Any, Any]]  # marks around the time set aside in its last step
    ready: Any  # a mark behind the loss's copy
    data_wait_s: float
    measured: bool


@dataclasses.dataclass(eq=False, kw_only=True)
class Meter:
    """Per-rank meter: ``start()``, ``step_end()`` after every optimizer step (a log step's
    record when read, else None), ``flush()`` after the last, ``finish()``. ``sync`` runs in
    ``start`` and ``flush`` only; ``reduce_loss`` may be a collective (log steps, every rank)."""

    total_steps: int
    warmup_steps: int
    log_every: int
    tokens_per_step: int
    samples_per_step: int
    flops_per_token: float
    peak_tflops: float | None
    timer: HostTimer | CudaTimer
    sync: Callable[[], None]
    start_step: int = 0
    reduce_loss: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
    peak_mem_gib: Callable[[], float | None] = lambda: None
    gpu: Callable[[], dict[str, Any]] = lambda: dict(NO_GPU_SAMPLE)  # GpuMonitor's sample
    lr: Callable[[int], float | None] = lambda step: None  # the LR that optimizer step used
    clock: Callable[[], float] = time.perf_counter
    write: Callable[[dict[str, Any]], None] = write_record
    read_late: bool = False
    also_log: Callable[[int], bool] = lambda step: False
    norm_counts: bool = True
    skips: bool = False

    def __post_init__(self) -> None:
        self.warmup_end = self.start_step + self.warmup_steps
        self._marks: list[Any] = []
        self._rows: list[torch.Tensor] = []  # this interval's (loss, grad norm) per step
        self._has_norm = False
        self._eval_loss: torch.Tensor | None = None
        self._aside: list[tuple[Any, Any]] = []
        self._run = 0  # non-finite steps in a row before the next record
        # the final record's: the run's skipped steps, the last gradient norm and evaluation
        self._health: dict[str, Any] = {
            "skipped_steps": 0,
            **dict.fromkeys(("grad_norm", "eval_loss", "eval_step")),
        }
        self._pending: _Interval | None = None
        self._last_logged = self.start_step
        self._wait_s = 0.0
        self._last_loss: float | None = None
        self._measured = {"steps": 0, "tokens": 0, "samples": 0, "seconds": 0.0, "wait_s": 0.0}
        self._measured_times: list[float] = []
        self._gpu_samples: list[dict[str, Any]] = []
        self._energy_at: float | None = None  # the GPU's energy counter at the last read

    def is_log_step(self, step: int) -> bool:
        return (
            step % self.log_every == 0
            or step == self.warmup_end
            or step == self.total_steps
            or self.also_log(step)
        )

    def start(self) -> None:
        """Start the clock (one sync, before the first step)."""
        self.sync()
        self._marks = [self.timer.mark()]
        self._energy_at = self.gpu().get("energy_counter_j")

    @contextlib.contextmanager
    def data_wait(self) -> Iterator[None]:
        """Time the training loop spends waiting for or handing over its next batch."""
        began = self.clock()
        try:
            yield
        finally:
            self._wait_s += self.clock() - began

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """Leave the time of the block (an evaluation, before ``step_end``) out of the step's
        time and the throughput; the record's ``eval_s`` holds it."""
        start = self.timer.mark()
        try:
            yield
        finally:
            self._aside.append((start, self.timer.mark()))

    def step_end(
        self,
        step: int,
        loss: torch.Tensor,
        *,
        grad_norm: torch.Tensor | None = None,
        eval_loss: torch.Tensor | None = None,
    ) -> dict[str, Any] | None:
        """Mark the end of optimizer step ``step``; read the previous log step's record if one
        waits (``read_late``: the device has this step queued meanwhile); on a log step, close
        the interval, and read it unless ``read_late``. ``grad_norm``: the step's total
        gradient norm before clipping; ``eval_loss``: an evaluation's at this (log) step."""
        self._marks.append(self.timer.mark())
        loss = loss.detach().float()
        if grad_norm is None:
            norm = torch.zeros_like(loss)
        else:
            norm, self._has_norm = grad_norm.detach().float().to(loss.device), True
        self._rows.append(torch.stack([loss, norm]))  # one small kernel: no sync
        if eval_loss is not None:
            self._eval_loss = eval_loss.detach().float()
        record = self._read() if self._pending is not None else None
        if self.is_log_step(step):
            self._close(step)
            if not self.read_late:
                record = self._read()
        return record

    def flush(self) -> dict[str, Any] | None:
        """Read the last log step's record, if one waits (a device sync)."""
        if self._pending is None:
            return None
        self.sync()
        return self._read()

    def _close(self, step: int) -> None:
        steps = step - self._last_logged
        assert len(self._rows) == steps == len(self._marks) - 1
        # Queued now, read later: each step's loss as the mean over ranks (a NaN on any rank is
        # a NaN on every one), then a copy to pinned host memory.
        rows = torch.stack(self._rows)
        losses = self.reduce_loss(rows[:, 0]).detach()
        rows = torch.stack([losses, rows[:, 1]], dim=1).to("cpu", non_blocking=True)
        eval_loss = self._eval_loss
        self._pending = _Interval(
            step=step,
            steps=steps,
            marks=self._marks,
            first_step=self._last_logged + 1,
            rows=rows,
            eval_loss=None if eval_loss is None else eval_loss.to("cpu", non_blocking=True),
            aside=self._aside,
            ready=self.timer.mark(),
            data_wait_s=self._wait_s,
            measured=self._last_logged >= self.warmup_end,
        )
        self._marks = [self._marks[-1]]
        self._rows = []
        self._eval_loss = None
        self._aside = []
        self._last_logged = step
        self._wait_s = 0.0

    def _read(self) -> dict[str, Any]:
        p, self._pending = self._pending, None
        assert p is not None
        self.timer.wait(p.ready)
        times = [self.timer.elapsed_ms(a, b) for a, b in itertools.pairwise(p.marks)]
        interval_s = self.timer.elapsed_ms(p.marks[0], p.marks[-1]) / 1e3
        aside_s = sum(self.timer.elapsed_ms(a, b) for a, b in p.aside) / 1e3
        if p.aside:  # set aside in the interval's last step
            times[-1] -= aside_s * 1e3
            interval_s -= aside_s
        health, self._run = read_interval(
            p.rows,
            first_step=p.first_step,
            has_norm=self._has_norm,
            norm_counts=self.norm_counts,
            run=self._run,
        )
        eval_loss = None if p.eval_loss is None else float(p.eval_loss.item())
        gpu = self._gpu_sample()
        record = {
            "type": "step",
            "step": p.step,
            "tokens": p.steps * self.tokens_per_step,
            "samples": p.steps * self.samples_per_step,
            "interval_s": interval_s,
            "measured": p.measured,
            "step_times_ms": [round(t, 4) for t in times],
            "loss": health.pop("loss"),
            **health,
            "skipped_steps": health["nonfinite_steps"] if self.skips else 0,
            "eval_loss": eval_loss,
            "eval_s": aside_s if p.aside else None,
            "lr": self.lr(p.step),
            "data_wait_s": p.data_wait_s,
            "peak_mem_gib": self.peak_mem_gib(),
            **gpu,
        }
        if p.measured:
            m = self._measured
            m["steps"] += p.steps
            m["tokens"] += record["tokens"]
            m["samples"] += record["samples"]
            m["seconds"] += interval_s
            m["wait_s"] += p.data_wait_s
            self._measured_times.extend(times)
            self._gpu_samples.append(gpu)
        self.write(record)
        if record["loss"] is not None:
            self._last_loss = record["loss"]
        h = self._health
        h["skipped_steps"] += record["skipped_steps"]
        if record["grad_norm"] is not None:
            h["grad_norm"] = record["grad_norm"]
        if eval_loss is not None:
            h["eval_loss"], h["eval_step"] = eval_loss, p.step
        return record

    def _gpu_sample(self) -> dict[str, Any]:
        """The GPU's sample for a record: its energy counter read becomes the energy used since
        the previous read (``energy_j``)."""
        gpu = self.gpu()
        counter = gpu.pop("energy_counter_j", None)
        gpu["energy_j"] = (
            None if counter is None or self._energy_at is None else counter - self._energy_at
        )
        self._energy_at = counter
        return gpu

    def finish(self) -> dict[str, Any]:
        """Write and return the ``final`` record (measured steps only), after ``flush``."""
        self.flush()
        m = self._measured
        rate = m["tokens"] / m["seconds"] if m["seconds"] > 0 else None
        tflops = None if rate is None else rate * self.flops_per_token / 1e12
        record = {
            "type": "final",
            "steps": self._last_logged,
            "measured_steps": m["steps"],
            "step_time_ms_p50": percentile(self._measured_times, 50),
            "step_time_ms_p95": percentile(self._measured_times, 95),
            "tokens_per_s": rate,
            "samples_per_s": m["samples"] / m["seconds"] if m["seconds"] > 0 else None,
            "tflops": tflops,
            "mfu": tflops / self.peak_tflops if tflops is not None and self.peak_tflops else None,
            "peak_mem_gib": self.peak_mem_gib(),
            "data_wait_pct": 100 * m["wait_s"] / m["seconds"] if m["seconds"] > 0 else None,
            **gpu_summary(self._gpu_samples, seconds=m["seconds"], tokens=m["tokens"]),
            "loss": self._last_loss,
            **self._health,
        }
        self.write(record)
        return record


def _si(value: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= div:
            return f"{value / div:.1f}{suffix}"
    return f"{value:.1f}"


def progress_line(
    record: dict[str, Any], total_steps: int, flops_per_token: float, peak: float | None
) -> str:
    """``step 20/200 | loss 7.412 | grad norm 0.82 | 310.2k tok/s | 52.1 ms/step | mfu 41.3%``
    (this rank)."""
    times = record["step_times_ms"]
    ms = sum(times) / len(times)
    tok_s = record["tokens"] / record["interval_s"] if record["interval_s"] > 0 else 0.0
    parts = [
        f"step {record['step']}/{total_steps}",
        "loss n/a" if record.get("loss") is None else f"loss {record['loss']:.3f}",
    ]
    if record.get("grad_norm") is not None:
        parts.append(f"grad norm {record['grad_norm']:.3g}")
    if record.get("eval_loss") is not None:
        parts.append(f"eval loss {record['eval_loss']:.3f}")
    parts += [f"{_si(tok_s)} tok/s", f"{ms:.1f} ms/step"]
    if peak:
        parts.append(f"mfu {100 * tok_s * flops_per_token / 1e12 / peak:.1f}%")
    if record.get("nonfinite_steps"):
        parts.append(
            f"{record['nonfinite_steps']} non-finite step(s)"
            + (" skipped" if record.get("skipped_steps") else "")
        )
    if not record["measured"]:
        parts.append("(warm-up)")
    return " | ".join(parts)


def final_line(record: dict[str, Any], world_size: int) -> str:
    """One-line summary of the ``final`` record (rank 0's numbers; tokens/s per rank)."""

    def fmt(value: float | None, spec: str, unit: str = "") -> str:
        return "n/a" if value is None else f"{value:{spec}}{unit}"

    mfu = record["mfu"]
    gpu = ""  # the GPU's clock, then its power and energy, where NVML read them
    if record.get("sm_clock_mhz") is not None:
        limited = record.get("clock_limited_pct")
        gpu = f" | sm clock {record['sm_clock_mhz']:.0f} MHz" + (
            f", limited {limited:.0f}%" if limited else ""
        )
    if record.get("energy_mj_per_token") is not None:
        gpu += f" | {record['power_w']:.0f} W, {record['energy_mj_per_token']:.3f} mJ/token"
    return (
        f"done: {record['steps']} steps ({record['measured_steps']} measured) | "
        f"loss {fmt(record['loss'], '.3f')} | "
        f"{'n/a' if record['tokens_per_s'] is None else _si(record['tokens_per_s'])} tok/s/rank x {world_size} | "
        f"p50 {fmt(record['step_time_ms_p50'], '.1f', ' ms')} p95 {fmt(record['step_time_ms_p95'], '.1f', ' ms')} | "
        f"{fmt(record['tflops'], '.2f')} TFLOP/s | mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | "
        f"peak mem {fmt(record['peak_mem_gib'], '.2f', ' GiB')} | data wait {fmt(record['data_wait_pct'], '.1f', '%')}"
        f"{gpu}"
    )
