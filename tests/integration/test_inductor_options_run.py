"""benchmarks/inductor_options.py for real: the trainer compiles under the options it sets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_trainer_runs_under_the_options_and_the_counters_show_them(tmp_path):
    """The weight gradients of a 4-layer GPT batched over the layers by inductor's pass: a
    compiled run on the CPU, whose counters name the fusion."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "inductor_options.py"),
            "--option",
            "post_grad_fusion_options={'batch_linear_post_grad': {'min_fuse_set_size': 4}}",
            "--",
            "--job",
            str(REPO / "jobs" / "quickstart.yaml"),
            "--set",
            "model.arch=gpt",
            "--set",
            "model.n_layers=4",
            "--set",
            "model.bias=false",
            "--set",
            "train.compile=true",
            "--set",
            "train.steps=2",
            "--set",
            "train.warmup_steps=1",
            "--set",
            "data.seq_len=32",
            "--set",
            "train.micro_batch=2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "done: 2 steps" in proc.stdout
    assert "'batch_linear_post_grad': 4" in proc.stdout
