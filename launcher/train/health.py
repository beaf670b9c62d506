"""Training health from a log interval's losses and gradient norms (``read_interval``), and
whether a non-finite step stops the run (``stop_reason``); no host sync per step:
docs/trainer.md#training-health-and-evaluation.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch


def read_interval(
    rows: torch.Tensor, *, first_step: int, has_norm: bool, norm_counts: bool, run: int
) -> tuple[dict[str, Any], int]:
    """The health fields of a record from its interval's (loss, grad norm) rows, over the
    finite steps only, and the run of non-finite steps at its end (a non-finite norm counts
    with ``norm_counts``: without a loss scaler)."""
    loss, norm = rows[:, 0].double(), rows[:, 1].double()
    bad = ~torch.isfinite(loss)
    if has_norm and norm_counts:
        bad |= ~torch.isfinite(norm)
    kept = ~bad
    longest = 0
    for is_bad in bad.tolist():
        run = run + 1 if is_bad else 0
        longest = max(longest, run)
    first = None
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        first = {
            "step": first_step + i,
            "loss": _number(float(loss[i])),
            "grad_norm": _number(float(norm[i])) if has_norm else None,
        }
    any_kept = bool(kept.any())
    fields = {
        "loss": float(loss[kept].mean()) if any_kept else None,
        "grad_norm": float(norm[kept].mean()) if has_norm and any_kept else None,
        "grad_norm_max": float(norm[kept].max()) if has_norm and any_kept else None,
        "nonfinite_steps": int(bad.sum()),
        "nonfinite_in_a_row": longest,
        "first_nonfinite": first,
    }
    return fields, run


def _number(value: float) -> float | str:
    """A finite value as it is, else ``"nan"``, ``"inf"`` or ``"-inf"`` (JSON has none of them)."""
    return value if math.isfinite(value) else str(value)


def stop_reason(
    record: dict[str, Any], *, mode: str, max_skips: int, checkpoint: Path | None
) -> str | None:
    """Why the run stops after this step record, or None to go on.

    ``stop``: any non-finite step. ``skip``: more than ``max_skips`` in a row.
    ``checkpoint``: the last complete checkpoint (None: there is none)."""
    first = record.get("first_nonfinite")
    if first is None:
        return None
    if mode == "skip" and record["nonfinite_in_a_row"] <= max_skips:
        return None
    what = " and ".join(
        f"{name} is {first[key]}"
        for key, name in (("loss", "the loss"), ("grad_norm", "the gradient norm"))
        if isinstance(first.get(key), str)
    )
    kept = (
        f"the last complete checkpoint is {checkpoint}"
        if checkpoint is not None
        else "no checkpoint was saved before it"
    )
    if mode == "skip":
        return (
            f"{record['nonfinite_in_a_row']} steps in a row up to step {record['step']} were "
            f"non-finite and skipped, more than train.max_nonfinite_skips ({max_skips}); the "
            f"first of them in this record: step {first['step']} ({what}); {kept}. Lower "
            f"train.lr or set train.grad_clip"
        )
    return (
        f"non-finite at step {first['step']}: {what} (train.on_nonfinite: stop, checked at "
        f"step {record['step']}); {kept}. Lower train.lr, set train.grad_clip, or set "
        f"train.on_nonfinite: skip to skip such steps"
    )
