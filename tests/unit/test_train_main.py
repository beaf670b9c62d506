"""``python -m launcher.train``: problems with the job's inputs that a worker finds at start end
as one paragraph with exit code 2, not a traceback (real processes, a world of one, CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fixtures.launching import sets
from fixtures.tiny_job import tiny_job

pytestmark = pytest.mark.processes  # starts processes: not in `just test-fast`

REPO = Path(__file__).resolve().parents[2]


def train(job: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    drop = ("RANK", "WORLD_SIZE", "LAUNCHER_METRICS_FILE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    args = [sys.executable, "-m", "launcher.train", "--job", str(job), *sets(*overrides)]
    return subprocess.run(
        args, capture_output=True, text=True, timeout=300, env=env, cwd=job.parent
    )


def test_a_checkpoint_it_cannot_resume_from_is_one_paragraph_with_exit_2(tmp_path: Path):
    """A ResumeError (here: a global batch other than the checkpoint's under elastic_batch keep)
    is printed like a SpecError, naming the job file."""
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(tiny_job(steps=1, checkpoint={"dir": str(tmp_path / "ckpt")})))
    first = train(job)
    assert first.returncode == 0, first.stderr
    refused = train(job, "train.steps=2", "train.grad_accum=2")
    assert refused.returncode == 2, refused.stderr
    message = refused.stderr.strip()
    assert "Traceback" not in refused.stderr and "\n" not in message, refused.stderr
    assert message.startswith(f"{job}: checkpoint ") and "global batch of 2 samples" in message
    assert "set train.grad_accum: 1 to keep it" in message
