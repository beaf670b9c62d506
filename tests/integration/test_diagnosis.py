"""Diagnosis on real runs (CPU, gloo): a straggler named while the run goes, and by ``launch
doctor`` afterwards."""

from __future__ import annotations

import json
from pathlib import Path

from fixtures.launching import FIXTURES, Launcher, launch, slow_batches, write_job


def doctor(run_dir: Path) -> dict:
    out = launch("doctor", str(run_dir), "--json", cwd=run_dir, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_rank_that_computes_longer_is_named_live_in_the_summary_and_by_doctor(tmp_path):
    run_dir = tmp_path / f"slow-{tmp_path.name}"
    job = write_job(tmp_path, {"script": str(FIXTURES / "slow_rank.py"), "args": ["--steps", "30"]})
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
    afterwards = doctor(run_dir)
    assert not afterwards["clean"]
    straggler = next(f for f in afterwards["findings"] if f["kind"] == "straggler")
    assert straggler["title"] == "Straggler: rank 1 on node local"


def test_doctor_names_data_loading_first_on_a_builtin_run_that_waits_for_data(tmp_path):
    plant = slow_batches(tmp_path / "plant", 0.08)
    run_dir = tmp_path / f"wait-{tmp_path.name}"
    job = write_job(
        tmp_path,
        "builtin",
        model={"arch": "bert", "size": "tiny"},
        data={"source": "synthetic", "seq_len": 32},
        train={"steps": 24, "warmup_steps": 4, "micro_batch": 4, "log_every": 4},
        cudnn={"benchmark": False},
        launch={"env": {"PYTHONPATH": str(plant)}},
    )
    with Launcher(str(job), "--skip-parity", run_dir=run_dir, cwd=tmp_path) as run:
        assert run.wait(timeout=300) == 0, run.output[-3000:]
    found = doctor(run_dir)
    first = found["findings"][0]
    assert first["kind"] == "data_wait" and first["cost_pct"] > 10, found
    assert "waits for data" in first["evidence"] and "data" in first["change"]
