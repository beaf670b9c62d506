"""Which checkpoint resume picks, and when one is due (pure; DCP itself runs in integration and
in test_train_elastic)."""

from __future__ import annotations

from pathlib import Path

import torch

from launcher.spec.job import CheckpointSpec
from launcher.train.checkpoint import MARKER, Checkpointer, latest_checkpoint, step_dir
from launcher.train.data import SyntheticBatches


def checkpointer(spec: CheckpointSpec) -> Checkpointer:
    data = SyntheticBatches(arch="gpt", vocab_size=64, seq_len=8, micro_batch=1, grad_accum=1, mask_prob=0.15,
                            seed=0, rank=0, world_size=1, device=torch.device("cpu"))
    return Checkpointer(spec, rank=0, data=data, elastic_batch="keep")


def test_latest_complete_checkpoint_wins(tmp_path: Path):
    assert latest_checkpoint(None) is None and latest_checkpoint(tmp_path / "absent") is None
    for step, complete in [(10, True), (20, True), (30, False), (100, True)]:
        path = step_dir(tmp_path, step)
        path.mkdir()
        if complete:
            (path / MARKER).write_text(f"{step}\n")
    (tmp_path / "step_junk").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000100"
    (tmp_path / "step_00000100" / MARKER).unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000020"


def test_checkpoints_are_due_every_n_steps_and_at_the_end(tmp_path: Path):
    every = checkpointer(CheckpointSpec(dir=tmp_path, every_steps=25))
    assert [s for s in range(1, 61) if every.due(s, 60)] == [25, 50, 60]
    end_only = checkpointer(CheckpointSpec(dir=tmp_path))
    assert [s for s in range(1, 61) if end_only.due(s, 60)] == [60]
    assert not any(checkpointer(CheckpointSpec()).due(s, 60) for s in range(1, 61))
