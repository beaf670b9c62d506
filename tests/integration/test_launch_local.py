"""`launch` end to end on this machine: embedded Ray, real torchrun (gloo, CPU)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from fixtures.launching import (
    QUICK,
    TORCHRUN_NOISE,
    assert_none_left,
    launch,
    sets,
    write_job,
)

from launcher.metrics import read_records
from launcher.results.summary import RANK_KEYS

ROOT = Path(__file__).resolve().parents[2]
RUN_FILES = (  # what every run that got as far as its workers leaves in its run directory
    "plan.json",
    "logs/local/rank0.log",
    "logs/local/rank1.log",
    "metrics/rank0.jsonl",
    "metrics/rank1.jsonl",
    "summary.json",
    "summary.csv",
    "summary.txt",
)


@pytest.fixture
def mark(monkeypatch: pytest.MonkeyPatch) -> str:
    """In the environment of everything the test's launch starts (``fixtures.launching.ours``)."""
    value = uuid.uuid4().hex
    monkeypatch.setenv("LAUNCHER_TEST_MARK", value)
    return value


def custom_job(tmp_path: Path, *script_args: str) -> Path:
    return write_job(
        tmp_path, {"script": str(ROOT / "examples/custom_train.py"), "args": list(script_args)}
    )


def test_quickstart_end_to_end(tmp_path, mark):
    run_dir = tmp_path / f"run-{tmp_path.name}"
    run_dir.mkdir()  # an empty folder is a fine --run-dir
    quickstart = str(ROOT / "jobs/quickstart.yaml")
    result = launch(quickstart, "--run-dir", str(run_dir), cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Per rank" in result.stdout
    for name in (*RUN_FILES, "job.yaml", "cluster.yaml", "preflight/parity.txt"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "preflight/local.json").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["world_size"] == 2 and summary["nodes"] == 1
    assert summary["failure"] is None
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    for row in summary["ranks"]:
        assert set(row) >= set(RANK_KEYS)  # the names are tests/unit/test_summary.py's
        assert row["tokens_per_s"] > 0 and row["steps"] == 30 and row["mfu"] is None
    assert summary["totals"]["tokens_per_s"] > 0
    timings = summary["launcher_timings_s"]  # the preflight ran while Ray started, agents placed
    beside = timings["preflight"] + timings["ray"] + timings["agents"]
    assert timings["preflight+ray+agents"] < beside - 0.05, timings
    assert oct((run_dir / "plan.json").stat().st_mode & 0o777) == "0o600"
    # the run id names the nodes' folders: the run dir's name and a suffix of this launch alone;
    # the workers' LAUNCHER_RUN_ID stays the run dir's name
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["run_id"].startswith(f"{run_dir.name}-") and plan["run_name"] == run_dir.name
    assert plan["nodes"][0]["node_dir"] == "{node_dir}"  # each agent makes its own, private
    assert plan["nodes"][0]["env"]["LAUNCHER_RUN_ID"] == run_dir.name
    assert_none_left(mark, run_dir.name)
    # the same --run-dir again: refused (exit 2) before anything starts, the first run untouched
    kept = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    again = launch(quickstart, "--run-dir", str(run_dir), cwd=ROOT, timeout=60)
    assert again.returncode == 2, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"--run-dir {run_dir} is not empty" in again.stderr and "Traceback" not in again.stderr
    assert "Pick a new folder" in again.stderr and again.stderr.count("\n") == 1
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == kept
    assert_none_left(mark, run_dir.name)


def test_quickstart_whose_stdout_reader_goes_after_one_line_runs_to_its_end(tmp_path, mark):
    """`launch jobs/quickstart.yaml | head -1` (six steps): the reader going away changes nothing
    of the run. Exit 0, no "Broken pipe", the run directory in full, the console's lines from
    then on dropped; nothing of the run left running."""
    run_dir = tmp_path / f"run-{tmp_path.name}"
    with open(tmp_path / "stderr", "wb") as err:
        argv = [sys.executable, "-m", "launcher", str(ROOT / "jobs/quickstart.yaml"), *QUICK]
        argv += ["--run-dir", str(run_dir)]
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=err)
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline()  # the parity table's first line
            proc.stdout.close()
            code = proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
    stderr = (tmp_path / "stderr").read_text()
    assert code == 0, stderr[-3000:]
    assert "Broken pipe" not in stderr and "could not" not in stderr and "Traceback" not in stderr
    for name in RUN_FILES:
        assert (run_dir / name).is_file(), name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["failure"] is None
    assert [r["steps"] for r in summary["ranks"]] == [6, 6]
    # rank 0's lines, the shown ones, kept
    assert "step 6/6" in (run_dir / "logs/local/rank0.log").read_text()
    assert_none_left(mark, run_dir.name)


def test_failing_rank_stops_everything_and_is_named(tmp_path, mark):
    run_dir = tmp_path / f"run-{tmp_path.name}"
    start = time.monotonic()
    job = custom_job(tmp_path, "--steps", "4000", "--fail-at", "30")
    result = launch(str(job), "--skip-parity", "--run-dir", str(run_dir), cwd=tmp_path)
    took = time.monotonic() - start
    assert result.returncode == 4, result.stderr[-3000:]
    assert "rank 1 on node local" in result.stderr
    assert "injected failure at step 30" in result.stderr
    assert took < 60, f"fail-fast took {took:.0f} s"
    # the rank's own traceback, as it wrote it (torch marks each line [rank1]:); not torchrun's
    console = result.stdout + result.stderr
    assert re.search(r"^\[local/rank1\] (\[rank1\]: )?Traceback", console, re.MULTILINE)
    others = [line for line in console.splitlines() if not line.startswith("[local/rank1]")]
    assert not [bad for bad in TORCHRUN_NOISE if any(bad in line for line in others)], console[
        -4000:
    ]
    assert "Token authentication is enabled" not in console
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["failure"]["rank"] == 1 and summary["failure"]["node"] == "local"
    assert summary["failure"]["exit_code"] == 1
    assert "injected failure" in summary["failure"]["log_tail"]
    assert "injected failure" in (run_dir / "logs/local/rank1.log").read_text()
    assert (run_dir / "metrics/rank0.jsonl").stat().st_size > 0
    assert_none_left(mark, run_dir.name)


def test_a_diverging_quickstart_stops_with_exit_4_naming_the_step(tmp_path, mark):
    """A loss that goes NaN by step 5: every rank stops at the first log step that reads a
    non-finite step, and the summary says which."""
    run_dir = tmp_path / f"run-{tmp_path.name}"
    diverging = sets("train.lr=1.0", "train.weight_decay=1e30", "train.steps=40")
    quickstart = str(ROOT / "jobs/quickstart.yaml")
    result = launch(quickstart, *diverging, "--run-dir", str(run_dir), cwd=ROOT)
    assert result.returncode == 4, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    reason = summary["failure"]["reason"]
    assert "NonFiniteError: non-finite at step " in reason, reason
    step = int(reason.split("non-finite at step ")[1].split(":")[0])
    assert 1 <= step <= 5 and "the loss is nan" in reason, reason  # checked at step 5 (log_every)
    assert "no checkpoint was saved before it" in reason and reason in result.stderr
    logged = [r for r in read_records(run_dir / "metrics/rank1.jsonl") if r["type"] == "step"]
    assert logged[-1]["step"] == 5 and logged[-1]["first_nonfinite"]["step"] == step
    assert summary["training"]["step"] == 5
    assert_none_left(mark, run_dir.name)


def test_a_node_without_its_python_is_exit_3_with_the_preflight_and_4_without(
    tmp_path, mark, monkeypatch
):
    """The node's interpreter is missing. The probe cannot run while the embedded Ray starts:
    the preflight's verdict and exit 3, no worker, and the Ray it started is stopped. With the
    preflight skipped, torchrun cannot start: exit 4 and one paragraph naming the node and the
    missing file. No traceback either way, no table of ranks that never ran."""
    monkeypatch.setenv("LAUNCHER_STATE_DIR", str(tmp_path / "state"))  # no head: embedded Ray
    run_dir = tmp_path / f"run-{tmp_path.name}"
    job, cluster = custom_job(tmp_path, "--steps", "5"), tmp_path / "cluster.yaml"
    node = {"name": "local", "host": "localhost", "python": str(tmp_path / "nopy")}  # none there
    cluster.write_text(yaml.safe_dump({"nodes": [node]}))
    result = launch(str(job), "--cluster", str(cluster), "--run-dir", str(run_dir), cwd=tmp_path)
    console = result.stdout + result.stderr
    assert result.returncode == 3, console[-3000:]
    assert "nopy cannot run there" in console and "FAILED before any worker started" in console
    for unfit in ("Per rank", "rank None", "Traceback"):
        assert unfit not in console, console[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["ranks"] == []
    assert not (run_dir / "plan.json").exists()  # no attempt was planned: no worker
    timings = summary["launcher_timings_s"]
    assert timings["preflight"] < timings["ray"] <= timings["preflight+ray+agents"]  # Ray started
    assert "agents" not in timings  # not placed once the preflight had failed
    assert_none_left(mark, run_dir.name)

    run_dir = tmp_path / f"skipped-{tmp_path.name}"
    args = ["--cluster", str(cluster), "--skip-parity", "--run-dir", str(run_dir)]
    result = launch(str(job), *args, cwd=tmp_path)
    assert result.returncode == 4, result.stderr[-3000:]
    assert "torchrun could not be started on node local" in result.stderr
    assert "nopy" in result.stderr and "Traceback" not in result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "torchrun could not be started" in json.dumps(summary)
    assert_none_left(mark, run_dir.name)
