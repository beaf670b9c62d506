"""Diagnosis on real runs (CPU, gloo): a straggler named while the run goes, and by ``launch
doctor`` afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from fixtures.launching import FIXTURES, Launcher


def write_job(tmp_path: Path, entry: dict, **extra) -> Path:
    job = {
        "name": "diag",
        "resources": {"nproc_per_node": 2, "device": "cpu"},
        "precision": {"dtype": "fp32"},
        "entrypoint": entry,
        **extra,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_a_rank_that_computes_longer_is_named_live_and_in_the_summary(tmp_path):
    run_dir = tmp_path / f"slow-{tmp_path.name}"
    job = write_job(tmp_path, {"script": str(FIXTURES / "slow_rank.py")})
    with Launcher(str(job), "--skip-parity", run_dir=run_dir, cwd=tmp_path) as run:
        assert run.wait(timeout=240) == 0, run.output[-3000:]
        out = run.output
    live = out.find("straggler: rank 1 on node local")
    assert live >= 0, out[-3000:]
    assert live < out.find("Per rank"), "the straggler was named only after the run"
    assert "straggler: rank 0" not in out
    line = out[live:].splitlines()[0]
    assert "slower than the median of the other ranks" in line and "compute" in line
    found = json.loads((run_dir / "summary.json").read_text())["stragglers"]
    assert [s["rank"] for s in found] == [1] and found[0]["from"] == "compute_s"
    assert 40 < found[0]["slower_pct"] < 80
