"""GPU telemetry: the node agent samples a node's GPUs through NVML at a low rate for the whole
run, for any entrypoint, into ``telemetry/<node>.jsonl``. Without NVML it samples nothing.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

INTERVAL_S = 5.0
ENV_VAR = "LAUNCHER_TELEMETRY_S"  # in launch.env: seconds between samples, 0 turns it off
SUBDIR = "telemetry"
# NVML's clock event (throttle) reasons that hold the SM clock below what the load asks for.
CLOCK_LIMITS = {
    0x4: "power cap",
    0x8: "hw slowdown",
    0x20: "sw thermal",
    0x40: "hw thermal",
    0x80: "power brake",
}


class GpuSampler:
    """The GPUs this process may use (``CUDA_VISIBLE_DEVICES``, by index or UUID; all where it
    is unset), read through NVML."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._gpus: list[tuple[int, Any]] = []
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # NVML missing or unusable: no telemetry
            return
        self._nvml = pynvml
        try:
            self._gpus = list(_visible(pynvml))
        except Exception:
            self._gpus = []
        if not self._gpus:
            self.close()

    @property
    def available(self) -> bool:
        return bool(self._gpus)

    def sample(self) -> list[dict[str, Any]]:
        """One record per GPU now; a value NVML does not give is null."""
        nvml, now = self._nvml, time.time()
        if nvml is None:
            return []
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        out = []
        for index, h in self._gpus:
            mem = _read(lambda h=h: nvml.nvmlDeviceGetMemoryInfo(h))
            limits = _read(lambda h=h: reasons(h)) if reasons else None
            out.append(
                {
                    "time": now,
                    "gpu": index,
                    "util_pct": _read(lambda h=h: float(nvml.nvmlDeviceGetUtilizationRates(h).gpu)),
                    "sm_clock_mhz": _read(
                        lambda h=h: float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))
                    ),
                    "max_sm_clock_mhz": _read(
                        lambda h=h: float(nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_SM))
                    ),
                    "power_w": _read(lambda h=h: nvml.nvmlDeviceGetPowerUsage(h) / 1e3),
                    "power_cap_w": _read(lambda h=h: nvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1e3),
                    "mem_used_gib": mem.used / 2**30 if mem is not None else None,
                    "mem_total_gib": mem.total / 2**30 if mem is not None else None,
                    "temp_c": _read(
                        lambda h=h: float(
                            nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)
                        )
                    ),
                    "clock_limits": clock_limits(limits) if limits is not None else None,
                }
            )
        return out

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = None
        self._gpus = []


def clock_limits(reasons: int) -> list[str]:
    """The names of the limiting reasons set in an NVML clock-event bit mask."""
    return [name for bit, name in CLOCK_LIMITS.items() if reasons & bit]


def _visible(nvml: Any) -> list[tuple[int, Any]]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(nvml.nvmlDeviceGetCount())]
    out = []
    for i, item in enumerate(x.strip() for x in visible.split(",") if x.strip()):
        if item.isdigit():
            out.append((i, nvml.nvmlDeviceGetHandleByIndex(int(item))))
        else:
            out.append((i, nvml.nvmlDeviceGetHandleByUUID(item)))
    return out


def _read(get: Any) -> Any:
    try:
        return get()
    except Exception:
        return None
