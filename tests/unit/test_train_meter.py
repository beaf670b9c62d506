"""The meter: no device sync in the loop (a log step is read one step later), warm-up excluded,
MFU arithmetic, record contract."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from launcher.telemetry import clock_limits
from launcher.train.meter import GpuMonitor, Meter, final_line, peak_tflops, progress_line

STEP_KEYS = {
    "type",
    "step",
    "tokens",
    "samples",
    "interval_s",
    "measured",
    "step_times_ms",
    "loss",
    "grad_norm",
    "grad_norm_max",
    "nonfinite_steps",
    "nonfinite_in_a_row",
    "first_nonfinite",
    "skipped_steps",
    "eval_loss",
    "eval_s",
    "lr",
    "data_wait_s",
    "peak_mem_gib",
    "gpu_util_pct",
    "sm_clock_mhz",
    "power_w",
    "clock_limits",
    "energy_j",
}
FINAL_KEYS = {
    "type",
    "steps",
    "measured_steps",
    "step_time_ms_p50",
    "step_time_ms_p95",
    "tokens_per_s",
    "samples_per_s",
    "tflops",
    "mfu",
    "peak_mem_gib",
    "data_wait_pct",
    "gpu_util_pct",
    "sm_clock_mhz",
    "clock_limited_pct",
    "energy_j",
    "power_w",
    "energy_mj_per_token",
    "loss",
    "skipped_steps",
    "grad_norm",
    "eval_loss",
    "eval_step",
}


class FakeClock:
    """The host's clock and the timer's marks: ``now``, which the test moves on."""

    def __init__(self):
        self.now = 0.0
        self.waited: list[float] = []

    def __call__(self) -> float:
        return self.now

    def mark(self) -> float:
        return self.now

    def wait(self, mark: float) -> None:
        self.waited.append(mark)

    @staticmethod
    def elapsed_ms(a: float, b: float) -> float:
        return (b - a) * 1e3


def make_meter(*, total=20, warmup=3, log_every=5, peak=100.0, late=False, watts=650.0, start=0):
    clock = FakeClock()
    calls = {"sync": 0, "reduce": 0}
    records: list[dict] = []

    def sync():
        calls["sync"] += 1

    def reduce(t: torch.Tensor) -> torch.Tensor:
        calls["reduce"] += 1
        return t

    # the SM clock at each read: start()'s, then each record's
    samples = iter([None, None, None] + [1980.0, 1980.0, 1755.0] * 9)

    def gpu() -> dict:  # a GPU drawing ``watts`` throughout (None: no energy counter)
        mhz = next(samples)
        return {
            "gpu_util_pct": 90.0,
            "sm_clock_mhz": mhz,
            "power_w": None if mhz is None else 600.0,
            "clock_limits": None if mhz is None else (["power cap"] if mhz < 1900 else []),
            "energy_counter_j": None if watts is None else 1e4 + watts * clock.now,
        }

    meter = Meter(
        total_steps=total,
        start_step=start,
        warmup_steps=warmup,
        log_every=log_every,
        tokens_per_step=1000,
        samples_per_step=10,
        flops_per_token=1e9,
        peak_tflops=peak,
        timer=clock,
        sync=sync,
        reduce_loss=reduce,
        peak_mem_gib=lambda: 1.5,
        gpu=gpu,
        lr=lambda step: step / 1000,
        clock=clock,
        write=records.append,
        read_late=late,
    )
    return meter, clock, calls, records


def run(meter: Meter, clock: FakeClock, steps: range, calls: dict, log_steps: list[int]):
    """No sync in the loop; the loss is reduced (queued) at each log step, whose record comes
    from that step's step_end, or the next one's with ``read_late``."""
    for step in steps:
        with meter.data_wait():
            clock.now += 0.01
        clock.now += 0.09
        syncs, reduces = calls["sync"], calls["reduce"]
        rec = meter.step_end(step, torch.tensor(float(step)))
        assert calls["sync"] == syncs, step
        assert calls["reduce"] == reduces + (step in log_steps), step
        read = step - 1 if meter.read_late else step
        assert (rec is not None) == (read in log_steps), step
        assert rec is None or rec["step"] == read


def finished(**kw) -> tuple[dict, list[dict]]:
    """A 20-step run (``make_meter(**kw)``) finished: its final record and all its records."""
    meter, clock, calls, records = make_meter(**kw)
    meter.start()
    run(meter, clock, range(1, 21), calls, log_steps=[3, 5, 10, 15, 20])
    return meter.finish(), records


@pytest.mark.parametrize("late", [False, True])
def test_log_records_without_a_sync_in_the_loop(late: bool):
    meter, clock, calls, records = make_meter(late=late)
    meter.start()
    assert calls["sync"] == 1
    run(meter, clock, range(1, 21), calls, log_steps=[3, 5, 10, 15, 20])
    assert [r["step"] for r in records] == ([3, 5, 10, 15] if late else [3, 5, 10, 15, 20])
    last = meter.flush()  # reads step 20's record if it waits, after a sync
    assert (last is records[-1] and last["step"] == 20) if late else last is None
    assert calls["sync"] == 1 + late and meter.flush() is None
    assert calls["reduce"] == 5
    assert meter.timer.waited == pytest.approx([0.3, 0.5, 1.0, 1.5, 2.0])  # each log step's own end
    assert [r["measured"] for r in records] == [False, True, True, True, True]
    assert all(set(r) == STEP_KEYS for r in records)
    assert [r["lr"] for r in records] == [0.003, 0.005, 0.01, 0.015, 0.02]  # the log step's own
    assert records[1]["tokens"] == 2000 and records[2]["samples"] == 50
    assert records[2]["step_times_ms"] == pytest.approx([100.0] * 5)
    assert records[2]["loss"] == pytest.approx(sum(range(6, 11)) / 5)  # its own steps only
    # the interval between the log steps' marks, and the data wait of its own steps
    assert records[2]["interval_s"] == pytest.approx(0.5)
    assert records[2]["data_wait_s"] == pytest.approx(0.05)
    assert [records[i]["interval_s"] for i in (0, 4)] == pytest.approx([0.3, 0.5])


@pytest.mark.parametrize("late", [False, True])
def test_final_counts_measured_steps_only_and_computes_mfu(late: bool):
    final, records = finished(late=late)
    assert set(final) == FINAL_KEYS and records[-1] is final
    assert final["steps"] == 20 and final["measured_steps"] == 17
    assert final["tokens_per_s"] == pytest.approx(1000 / 0.1)
    assert final["samples_per_s"] == pytest.approx(100)
    assert final["tflops"] == pytest.approx(1e4 * 1e9 / 1e12)  # 10 TFLOP/s
    assert final["mfu"] == pytest.approx(0.1)
    assert [final["step_time_ms_p50"], final["step_time_ms_p95"]] == pytest.approx([100, 100])
    assert final["data_wait_pct"] == pytest.approx(10)
    assert final["gpu_util_pct"] == 90.0 and final["peak_mem_gib"] == 1.5 and final["loss"] == 18.0
    # measured records' GPU samples: step 5's had no NVML answer, then 1980, 1980, 1755 MHz (power cap)
    assert [r["sm_clock_mhz"] for r in records[:-1]] == [None, None, 1980.0, 1980.0, 1755.0]
    assert records[4]["clock_limits"] == ["power cap"]
    # Energy between the reads; power as NVML read it. A GPU's reads follow its marks closely
    # (the host waits for the mark first). The fake's host reads a step after the mark with
    # read_late (at 0.4, 0.6, 1.1, 1.6 s), and at 2.0 s for the last (flush), so that one
    # interval's energy spans 0.4 s.
    seconds = 1.6 if late else 1.7
    assert [r["energy_j"] for r in records[1:-1]] == pytest.approx(
        [650 * 0.2, 650 * 0.5, 650 * 0.5, 650 * (0.4 if late else 0.5)]
    )
    assert [r["power_w"] for r in records[:-1]] == [None, None, 600.0, 600.0, 600.0]
    assert final["energy_j"] == pytest.approx(650 * seconds)
    assert final["power_w"] == pytest.approx(650 * seconds / 1.7)
    assert final["energy_mj_per_token"] == pytest.approx(1e3 * 650 * seconds / 17_000)
    assert final["sm_clock_mhz"] == pytest.approx((1980 + 1980 + 1755) / 3)
    assert final["clock_limited_pct"] == pytest.approx(100 / 3)
    assert final_line(final, world_size=1).endswith(
        "| sm clock 1905 MHz, limited 33% | "
        + ("612 W, 61.176" if late else "650 W, 65.000")
        + " mJ/token"
    )
    assert "mfu 10.0%" in final_line(final, world_size=2)


def test_without_an_energy_counter_energy_is_null():
    final, records = finished(watts=None)
    assert [r["power_w"] for r in records[:-1]] == [None, None, 600.0, 600.0, 600.0]
    assert all(r["energy_j"] is None for r in records)
    assert final["power_w"] is None and final["energy_mj_per_token"] is None
    assert final_line(final, world_size=1).endswith("limited 33%")


def test_unknown_peak_gives_null_mfu():
    final, _ = finished(peak=None)
    assert final["mfu"] is None and final["tflops"] == pytest.approx(10.0)
    assert "mfu n/a" in final_line(final, world_size=1)


def test_resumed_meter_counts_warmup_from_its_first_step():
    meter, clock, _, records = make_meter(total=30, start=20, warmup=2, peak=None)
    meter.start()
    for step in range(21, 31):
        clock.now += 0.1
        meter.step_end(step, torch.tensor(1.0))
    assert [(r["step"], r["measured"]) for r in records] == [(22, False), (25, True), (30, True)]
    assert meter.finish()["measured_steps"] == 8


def test_progress_line():
    record = {
        "step": 20,
        "loss": 7.4123,
        "tokens": 3_102_000,
        "interval_s": 10.0,
        "step_times_ms": [52.1] * 10,
        "measured": True,
    }
    line = progress_line(record, 200, flops_per_token=1e9, peak=750.0)
    assert line == "step 20/200 | loss 7.412 | 310.2k tok/s | 52.1 ms/step | mfu 41.4%"


def test_peak_table():  # percentile: test_util.py
    assert peak_tflops("NVIDIA H200", "bf16") == 989.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp16") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "tf32") == 156.0
    assert peak_tflops("NVIDIA A10G", "tf32") is None
    assert peak_tflops("Intel(R) Xeon(R)", "fp32") is None


def test_clock_limits_name_the_limiting_bits_only():
    assert clock_limits(0) == []
    # idle, application clocks, sync boost, display
    assert clock_limits(0x1 | 0x2 | 0x10 | 0x100) == []
    assert clock_limits(0x4) == ["power cap"]
    assert clock_limits(0x4 | 0x40 | 0x80) == ["power cap", "hw thermal", "power brake"]


def test_the_gpu_monitor_of_a_cpu_run_answers_nulls():
    monitor = GpuMonitor(torch.device("cpu"))
    keys = ("gpu_util_pct", "sm_clock_mhz", "power_w", "clock_limits", "energy_counter_j")
    assert monitor() == dict.fromkeys(keys)
    monitor.close()


def test_nvml_is_shut_down_when_it_does_not_find_the_gpu(monkeypatch, caplog):
    calls = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByIndex=lambda i: (_ for _ in ()).throw(RuntimeError("no GPU")),
        nvmlDeviceGetHandleByUUID=lambda u: (_ for _ in ()).throw(RuntimeError("no GPU")),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(uuid="")
    )
    monitor = GpuMonitor(torch.device("cuda", 0))
    assert calls == ["init", "shutdown"]
    assert monitor()["power_w"] is None
    assert "NVML does not find cuda:0" in caplog.text
    monitor.close()
    assert calls == ["init", "shutdown"]  # not twice
