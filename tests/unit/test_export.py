"""``launch export``: a run's DCP checkpoint (written here in one process) as a Hugging Face
folder; the step it picks; the errors a user can cause (exit 2)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from fixtures.tiny_job import tiny_job

pytest.importorskip("safetensors", reason="export writes model.safetensors (hf extra)")

from safetensors.torch import load_file  # noqa: E402

from launcher.cli import main as cli_main  # noqa: E402
from launcher.spec import load_job  # noqa: E402
from launcher.train.checkpoint import MARKER, step_dir  # noqa: E402
from launcher.train.model import build_model  # noqa: E402

MODEL = {"vocab_size": 64, "max_positions": 32, "d_ff": 96}  # of the tiny GPT


def run_dir(tmp_path: Path, steps: tuple[int, ...] = (5, 10), checkpoint: bool = True) -> Path:
    """A run directory whose job saved checkpoints at ``steps`` (different weights each)."""
    ckpt = tmp_path / "ckpt"
    spec = tiny_job(model=MODEL, checkpoint={"dir": str(ckpt) if checkpoint else None})
    tmp_path.mkdir(parents=True, exist_ok=True)
    source = tmp_path / "job-src.yaml"
    source.write_text(yaml.safe_dump(spec))
    job = load_job(source)
    for step in steps:
        torch.manual_seed(step)
        model = build_model(job.model)
        path = step_dir(ckpt, step)
        state = {"model": model.state_dict(), "train": {"step": step}}
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
        (path / MARKER).write_text(f"{step}\n")
        torch.save(model.state_dict(), tmp_path / f"params{step}.pt")
    out = tmp_path / "run"
    out.mkdir()
    (out / "job.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json")))
    return out


def test_export_writes_the_latest_checkpoint_or_the_step_asked(tmp_path):
    run = run_dir(tmp_path)
    step_dir(tmp_path / "ckpt", 15).mkdir()  # cut short: no COMPLETE marker, never exported
    assert cli_main(["export", str(run), "--out", str(tmp_path / "latest")]) == 0
    assert cli_main(["export", str(run), "--step", "5", "--out", str(tmp_path / "five")]) == 0
    for out, step in (("latest", 10), ("five", 5)):
        params = torch.load(tmp_path / f"params{step}.pt")
        tensors = load_file(tmp_path / out / "model.safetensors")
        assert torch.equal(tensors["transformer.wte.weight"], params["embed.tok.weight"])
        assert torch.equal(
            tensors["transformer.h.1.mlp.c_fc.weight"], params["blocks.1.mlp.fc.weight"].t()
        )
        config = json.loads((tmp_path / out / "config.json").read_text())
        assert config["model_type"] == "gpt2" and config["vocab_size"] == 64
        assert config["n_layer"] == 2 and config["n_inner"] == 96
    (tmp_path / "new-file").write_text("")  # the mode a new file gets under this umask
    umask_mode = stat.S_IMODE((tmp_path / "new-file").stat().st_mode)
    modes = {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "latest").iterdir()}
    assert modes == {umask_mode}


def test_export_errors_say_what_to_do(tmp_path, capsys):
    run = run_dir(tmp_path)
    assert cli_main(["export", str(run), "--step", "7", "--out", str(tmp_path / "x")]) == 2
    assert "no complete checkpoint at" in capsys.readouterr().err
    assert cli_main(["export", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "not a run directory (no job.yaml)" in capsys.readouterr().err
    bare = run_dir(tmp_path / "bare", steps=(), checkpoint=False)
    assert cli_main(["export", str(bare), "--out", str(tmp_path / "x")]) == 2
    assert "saved no checkpoint (train.checkpoint.dir was not set)" in capsys.readouterr().err
    assert cli_main(["export", str(run)]) == 2  # --out is required
