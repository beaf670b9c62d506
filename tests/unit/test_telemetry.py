"""GPU telemetry from NVML: one record per visible GPU; nothing, and no error, without NVML."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from launcher.telemetry import GpuSampler


def fake_nvml(count: int = 4) -> types.ModuleType:
    nvml = types.ModuleType("pynvml")
    nvml.NVML_CLOCK_SM = 1
    nvml.NVML_TEMPERATURE_GPU = 0
    nvml.nvmlInit = lambda: None
    nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetCount = lambda: count
    nvml.nvmlDeviceGetHandleByIndex = lambda i: ("idx", i)
    nvml.nvmlDeviceGetHandleByUUID = lambda u: ("uuid", u)
    nvml.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(gpu=87)
    nvml.nvmlDeviceGetClockInfo = lambda h, kind: 1410
    nvml.nvmlDeviceGetMaxClockInfo = lambda h, kind: 1980
    nvml.nvmlDeviceGetPowerUsage = lambda h: 690_000
    nvml.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000
    nvml.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(used=40 * 2**30, total=80 * 2**30)

    def temperature(h, sensor):
        raise RuntimeError("not supported")

    nvml.nvmlDeviceGetTemperature = temperature
    nvml.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0x4 | 0x1
    return nvml


def test_each_visible_gpu_gives_one_record(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-abc")
    sampler = GpuSampler()
    samples = sampler.sample()
    sampler.close()
    assert [s["gpu"] for s in samples] == [0, 1]
    first = samples[0]
    assert (first["util_pct"], first["sm_clock_mhz"], first["max_sm_clock_mhz"]) == (87, 1410, 1980)
    assert (first["power_w"], first["power_cap_w"], first["mem_total_gib"]) == (690, 700, 80)
    assert first["clock_limits"] == ["power cap"] and first["temp_c"] is None


@pytest.mark.parametrize(("nvml", "visible", "count"), [(3, None, 3), (4, "", 0), (None, None, 0)])
def test_every_gpu_where_none_is_named_and_none_without_nvml_or_a_visible_gpu(
    monkeypatch, nvml, visible, count
):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(nvml) if nvml else None)  # None: no import
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    sampler = GpuSampler()
    assert sampler.available is (count > 0) and len(sampler.sample()) == count
