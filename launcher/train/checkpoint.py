"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): model, optimizer, LR scheduler,
step and each rank's RNG state.

Layout: ``<dir>/step_00000100/`` holds DCP's files; ``COMPLETE`` is written there last, by
rank 0, after every rank finished writing (a barrier). Resume picks the highest step folder
with the marker, so a checkpoint cut short by a crash is never loaded. DCP writes each rank's
shard in parallel and works alike under DDP (replicated state, written once) and FSDP
(sharded DTensors); ``get_state_dict``/``set_state_dict`` translate between the wrapped
model's parameter names and the plain ones, so a checkpoint does not depend on the wrapper.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from launcher.spec.job import CheckpointSpec

log = logging.getLogger(__name__)

MARKER = "COMPLETE"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def latest_checkpoint(root: Path | None) -> Path | None:
    """The newest complete checkpoint folder under ``root``, or None."""
    if root is None or not root.is_dir():
        return None
    done = [p for p in root.glob("step_*") if (p / MARKER).is_file() and p.name[5:].isdigit()]
    return max(done, key=lambda p: int(p.name[5:]), default=None)


class Checkpointer:
    """Saves every ``every_steps`` and at the end; resumes from the latest complete one."""

    def __init__(self, spec: CheckpointSpec, *, rank: int):
        self.spec = spec
        self.root = Path(spec.dir) if spec.dir is not None else None
        self.rank = rank

    def due(self, step: int, total_steps: int) -> bool:
        if self.root is None:
            return False
        every = self.spec.every_steps
        return step == total_steps or (every > 0 and step % every == 0)

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler) -> Path:
        assert self.root is not None
        path = step_dir(self.root, step)
        if self.rank == 0:
            if path.exists():  # a leftover from a run that died while saving this step
                shutil.rmtree(path)
            path.mkdir(parents=True)
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        # Non-tensor leaves are pickled by DCP; each rank's RNG state has its own key.
        state = {"model": model_sd, "optim": optim_sd,
                 "train": {"step": step, "scheduler": pickle.dumps(scheduler.state_dict())},
                 "rng": {f"rank{self.rank}": _rng_state()}}
        dcp.save(state, checkpoint_id=str(path))
        _barrier()
        if self.rank == 0:
            tmp = path / f".{MARKER}.tmp"
            tmp.write_text(f"{step}\n")
            os.replace(tmp, path / MARKER)
        _barrier()
        log.info("checkpoint saved: %s", path)
        return path

    def maybe_resume(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                     scheduler: torch.optim.lr_scheduler.LRScheduler) -> int:
        """Load the latest complete checkpoint when resume is auto; the step it ends (or 0)."""
        if self.spec.resume != "auto":
            return 0
        path = latest_checkpoint(self.root)
        if path is None:
            return 0
        model_sd, optim_sd = get_state_dict(model, optimizer)
        # DCP loads tensors in place and replaces the non-tensor leaves of this dict.
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd,
                                 "train": {"step": 0, "scheduler": b""}}
        rng_key = f"rank{self.rank}"
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        has_rng = f"rng.{rng_key}" in saved
        if has_rng:
            state["rng"] = {rng_key: b""}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        scheduler.load_state_dict(pickle.loads(state["train"]["scheduler"]))
        if has_rng:
            _set_rng_state(pickle.loads(state["rng"][rng_key]))
        else:
            log.warning("%s has no RNG state for %s (different world size); keeping fresh RNG", path, rng_key)
        step = int(state["train"]["step"])
        log.info("resumed from %s (step %d)", path, step)
        return step


def _rng_state() -> bytes:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return pickle.dumps(state)


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
