"""Metrics records: JSON lines appended to ``$LAUNCHER_METRICS_FILE``, one file per rank.

The contract between what runs in a worker (the trainer's meter, or a script calling
``launcher.report``) and what reads the records; docs/running.md lists the record types.
Standard library only.
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
    """For user scripts: this rank's progress since its previous call (``compute_s``: its own
    work, not waiting for other ranks). A no-op outside the launcher."""
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
