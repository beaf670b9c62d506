"""Metrics records: JSON lines appended to ``$LAUNCHER_METRICS_FILE``, one file per rank.

This module is the contract between what runs in a worker (the built-in trainer's meter, or a
user script calling ``launcher.report``) and what reads the records (the node agent, which
streams them to the launcher, and ``launcher.results.summary``). Standard library only.

``$LAUNCHER_METRICS_FILE`` may contain ``{rank}``, replaced by the worker's ``RANK``.

Record types (every record has ``type``, ``rank`` and ``time``, Unix seconds):

``meta``   once at start: ``local_rank``, ``world_size``, ``host``, ``device`` ("cuda:0",
           "cpu"), ``device_name``, ``params``, ``flops_per_token`` and ``peak_tflops``
           (null where unknown), ``seq_len``, ``micro_batch``, ``grad_accum``. The built-in
           trainer adds where this attempt starts: ``start_step`` (the step of the
           checkpoint it resumed from, 0 when fresh), ``global_batch`` (micro_batch x
           grad_accum x world_size), ``start_sample`` (the global index of its first sample),
           ``resumed_from_step``, ``resumed_world_size`` and ``resumed_global_batch`` (the
           checkpoint's step, and the world size and global batch it was written at; null
           when fresh, the last two also for a checkpoint that predates them) and
           ``restart_count`` (``$LAUNCHER_RESTART_COUNT``, 0 when unset).
``step``   every ``log_every`` steps: ``step`` (optimizer steps done), ``tokens`` and
           ``samples`` processed by this rank since the previous record, ``interval_s``
           (wall seconds since the previous record), ``measured`` (false inside warm-up),
           optional ``step_times_ms`` (each step in the interval), ``loss``, ``lr`` (the
           learning rate the record's step used), ``data_wait_s``, ``peak_mem_gib``,
           ``gpu_util_pct``, ``sm_clock_mhz``, ``power_w``, ``clock_limits`` (what held the
           GPU's clock down when sampled: a list of "power cap", "hw slowdown", "sw
           thermal", "hw thermal", "power brake"), ``energy_j`` (the GPU's energy since the
           previous record, from a counter that moves in coarse steps; the GPU values null
           where NVML is unavailable). A user script's ``report()`` writes ``step`` records
           without ``interval_s``: readers derive it from consecutive ``time`` values; it may
           add ``compute_s``, this rank's own compute seconds since its previous record
           (without waiting for other ranks), which the straggler check prefers.
``final``  once at the end of the built-in trainer: ``steps``, ``measured_steps``,
           ``step_time_ms_p50``, ``step_time_ms_p95``, ``tokens_per_s``, ``samples_per_s``,
           ``tflops``, ``mfu`` (fraction, null where the peak is unknown), ``peak_mem_gib``,
           ``data_wait_pct``, ``gpu_util_pct``, ``sm_clock_mhz`` (means of the measured
           records), ``clock_limited_pct`` (the share of those whose clock was limited),
           ``energy_j``, ``power_w`` and ``energy_mj_per_token`` (the measured steps' GPU
           energy, as mean power and per token; null unless every measured record has it),
           ``loss``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

ENV_VAR = "LAUNCHER_METRICS_FILE"
SUBDIR = "metrics"  # on a node (under its node dir) and in the run directory alike
FILE_PATTERN = "rank*.jsonl"


def file_name(rank: int | str) -> str:
    """``rank<R>.jsonl``; ``file_name("{rank}")`` is the template ``$LAUNCHER_METRICS_FILE`` ends in."""
    return f"rank{rank}.jsonl"


def rank_of(name: str) -> int | None:
    """The rank a metrics file is named after, or None for another file."""
    stem = name.removesuffix(".jsonl")
    digits = stem.removeprefix("rank")
    return int(digits) if stem != name and digits != stem and digits.isdigit() else None


def metrics_path() -> str | None:
    """This worker's metrics file, or None when the launcher did not ask for one."""
    template = os.environ.get(ENV_VAR)
    if not template:
        return None
    return template.replace("{rank}", os.environ.get("RANK", "0"))


def write_record(record: dict[str, Any], path: str | None = None) -> None:
    """Append one record (adds ``rank`` and ``time`` when missing); a no-op without a path."""
    path = path or metrics_path()
    if path is None:
        return
    record.setdefault("rank", int(os.environ.get("RANK", "0")))
    record.setdefault("time", time.time())
    line = json.dumps(record, separators=(",", ":"), default=_jsonable) + "\n"
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line)


def report(
    *, step: int, tokens: int = 0, samples: int = 0, loss: float | None = None, **extra: Any
) -> None:
    """For user scripts: record progress since the previous call. A no-op outside the launcher.

    ``tokens`` and ``samples`` count what this rank processed since its previous call;
    ``compute_s=`` (seconds of this rank's own work since then, not waiting for other ranks)
    lets the launcher tell a slow rank from one that waits for it.
    """
    write_record(
        {
            "type": "step",
            "step": int(step),
            "tokens": int(tokens),
            "samples": int(samples),
            "loss": None if loss is None else float(loss),
            **extra,
        }
    )


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All complete records of one file (a torn last line from a killed worker is skipped)."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def gpu_summary(
    records: list[dict[str, Any]], *, seconds: float, tokens: float
) -> dict[str, float | None]:
    """The GPU over measured ``step`` records that took ``seconds`` for ``tokens``: mean
    utilisation and SM clock, the share of records whose clock something limited (power,
    heat), and the energy, in all, as mean power and per token (null unless every record has
    it). The keys are the ``final`` record's."""

    def mean(key: str) -> float | None:
        values = [r[key] for r in records if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    limits = [r["clock_limits"] for r in records if r.get("clock_limits") is not None]
    energies = [r.get("energy_j") for r in records]
    energy = sum(energies) if energies and None not in energies else None  # type: ignore[arg-type]
    return {
        "gpu_util_pct": mean("gpu_util_pct"),
        "sm_clock_mhz": mean("sm_clock_mhz"),
        "clock_limited_pct": 100 * sum(1 for x in limits if x) / len(limits) if limits else None,
        "energy_j": energy,
        "power_w": energy / seconds if energy is not None and seconds > 0 else None,
        "energy_mj_per_token": 1e3 * energy / tokens if energy is not None and tokens else None,
    }


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)
