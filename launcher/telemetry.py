"""GPU telemetry: the node agent samples a node's GPUs through NVML at a low rate for the whole
run, for any entrypoint, into ``telemetry/<node>.jsonl``. Without NVML it samples nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

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


class Nvml:
    """NVML (nvidia-ml-py), initialised; ``_nvml`` stays None where it is missing or unusable."""

    def __init__(self) -> None:
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as err:  # NVML missing or unusable: every value stays null
            log.debug("NVML unavailable: %s", err)
            return
        self._nvml = pynvml

    def read(self, h: Any, *keys: str) -> dict[str, Any]:
        """``keys`` (of ``READS``) of GPU handle ``h`` now; None for what NVML does not give."""
        return {key: _read(lambda key=key: READS[key](self._nvml, h)) for key in keys}

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = None


class GpuSampler(Nvml):
    """The GPUs this process may use (``CUDA_VISIBLE_DEVICES``, by index or UUID; all where it
    is unset), read through NVML."""

    def __init__(self) -> None:
        super().__init__()
        self._gpus: list[tuple[int, Any]] = _read(lambda: _visible(self._nvml)) or []
        if not self._gpus:  # no NVML, or no GPU
            self.close()

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def sample(self) -> list[dict[str, Any]]:
        """One record per GPU now; a value NVML does not give is null."""
        if self._nvml is None:
            return []
        now = time.time()
        return [{"time": now, "gpu": index, **self.read(h, *SAMPLED)} for index, h in self._gpus]


def clock_limits(reasons: int) -> list[str]:
    """The names of the limiting reasons set in an NVML clock-event bit mask."""
    return [name for bit, name in CLOCK_LIMITS.items() if reasons & bit]


def _visible(nvml: Any) -> list[tuple[int, Any]]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(nvml.nvmlDeviceGetCount())]
    items = [x.strip() for x in visible.split(",") if x.strip()]
    by_index, by_uuid = nvml.nvmlDeviceGetHandleByIndex, nvml.nvmlDeviceGetHandleByUUID
    return [(i, by_index(int(x)) if x.isdigit() else by_uuid(x)) for i, x in enumerate(items)]


def _clock_limits(nvml: Any, h: Any) -> list[str]:
    reasons = (
        getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    )
    return clock_limits(int(reasons(h)))


# What NVML gives of a GPU's handle ``h``, by name.
READS: dict[str, Callable[[Any, Any], Any]] = {
    "util_pct": lambda nvml, h: float(nvml.nvmlDeviceGetUtilizationRates(h).gpu),
    "sm_clock_mhz": lambda nvml, h: float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
    "max_sm_clock_mhz": lambda nvml, h: float(
        nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_SM)
    ),
    "power_w": lambda nvml, h: nvml.nvmlDeviceGetPowerUsage(h) / 1e3,
    "power_cap_w": lambda nvml, h: nvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1e3,
    "mem_used_gib": lambda nvml, h: nvml.nvmlDeviceGetMemoryInfo(h).used / 2**30,
    "mem_total_gib": lambda nvml, h: nvml.nvmlDeviceGetMemoryInfo(h).total / 2**30,
    "temp_c": lambda nvml, h: float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
    "clock_limits": _clock_limits,
    "energy_counter_j": lambda nvml, h: nvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1e3,
}
SAMPLED = [k for k in READS if k != "energy_counter_j"]  # a telemetry record's values


def _read(get: Any) -> Any:
    try:
        return get()
    except Exception:
        return None
