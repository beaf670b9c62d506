"""A real Slurm (slurmctld here, a slurmd in each of 2 network-namespace nodes): the quickstart
inside an allocation, outside one (the launcher allocates and releases), and bad input."""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from fixtures.launching import launch, quick_job, wait_for
from slurm import SlurmCluster, missing_slurm

pytestmark = [pytest.mark.netns, pytest.mark.ray]


@pytest.fixture(scope="module")
def slurm(netns_cluster_module):
    reason = missing_slurm()
    if reason:
        pytest.skip(f"no Slurm here: {reason}")
    with SlurmCluster(netns_cluster_module(2)) as cluster:
        yield cluster


@pytest.fixture
def env(slurm):
    """The cluster's clients' environment, outside any allocation this process may be in."""
    return {k: v for k, v in slurm.env.items() if not k.startswith("SLURM_JOB")}


@pytest.fixture
def files(tmp_path):
    cluster_file = tmp_path / "slurm.yaml"
    cluster_file.write_text(yaml.safe_dump({"slurm": {"partition": "main"}}))
    return quick_job(tmp_path), cluster_file


def ranks_on_both_nodes(slurm, run_dir: Path) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["world_size"] == 2
    assert {r["node"] for r in summary["ranks"]} == set(slurm.names)


@pytest.mark.parametrize("salloc", [("salloc", "-N2", "--quiet"), ()], ids=["inside", "outside"])
def test_the_quickstart_inside_an_allocation_or_outside_one(slurm, env, files, tmp_path, salloc):
    """Outside one the launcher allocates, and releases the allocation with its Ray steps."""
    job_file, cluster_file = files
    run_dir = tmp_path / "run"
    argv = (str(job_file), "--cluster", str(cluster_file), "--run-dir", str(run_dir))
    run = launch(*argv, cwd=tmp_path, env=env, prefix=salloc)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ranks_on_both_nodes(slurm, run_dir)
    if salloc:
        # salloc's allocation stays in the queue (completing) until slurmctld hears from every node
        what = "salloc's allocation to leave the queue"
        wait_for(lambda: slurm.queue() == [], timeout=30, what=what)
        return
    assert slurm.queue() == []
    for node in slurm.nodes.node_names:  # Ray's steps ended with the allocation
        assert "raylet" not in slurm.nodes.exec(node, "ps -eo comm").stdout


def test_an_allocation_smaller_than_the_job_is_exit_2(slurm, env, files, tmp_path):
    job_file, cluster_file = files
    argv = (str(job_file), "--cluster", str(cluster_file))
    run = launch(*argv, cwd=tmp_path, env=env, prefix=("salloc", "-N1", "--quiet"))
    assert run.returncode == 2, run.stderr[-2000:]
    assert "asks for 2 nodes" in run.stderr and "has 1" in run.stderr
    # salloc's allocation stays in the queue (completing) until slurmctld hears from every node
    wait_for(lambda: slurm.queue() == [], timeout=30, what="salloc's allocation to leave the queue")


def test_an_unknown_partition_is_exit_2_and_queues_nothing(slurm, env, files, tmp_path):
    job_file, cluster_file = files
    cluster_file.write_text(yaml.safe_dump({"slurm": {"partition": "nope"}}))
    run = launch(str(job_file), "--cluster", str(cluster_file), cwd=tmp_path, env=env)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "partition 'nope'" in run.stderr and "main" in run.stderr
    assert slurm.queue() == []


def test_an_allocation_that_does_not_start_in_wait_s_is_exit_3_and_cancelled(
    slurm, env, files, tmp_path
):
    job_file, cluster_file = files
    cluster_file.write_text(yaml.safe_dump({"slurm": {"partition": "main", "wait_s": 6}}))
    blocker = slurm.run(
        "sbatch", "--parsable", "-N2", "--exclusive", "--output", "/dev/null", "--wrap", "sleep 300"
    )
    assert blocker.returncode == 0, blocker.stderr
    blocker_id = blocker.stdout.strip()
    try:
        time.sleep(1)
        run = launch(str(job_file), "--cluster", str(cluster_file), cwd=tmp_path, env=env)
        assert run.returncode == 3, run.stderr[-2000:]
        assert "waits for its allocation" in run.stderr and "slurm.wait_s" in run.stderr
        assert slurm.queue() == [blocker_id]
    finally:
        slurm.run("scancel", blocker_id)


def test_no_slurm_commands_is_exit_2(files, tmp_path):
    job_file, cluster_file = files
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    run = launch(str(job_file), "--cluster", str(cluster_file), cwd=tmp_path, env=env, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "no srun" in run.stderr and "Traceback" not in run.stderr


@pytest.fixture
def shared(slurm, files):
    """The job and cluster files where the nodes see them too (their /tmp is their own), and a
    state folder for the launcher's records."""
    folder = slurm.dir / f"batch-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    for path in files:
        (folder / path.name).write_text(path.read_text())
    # The launch runs on a node here, beside its Ray: on a loaded 2-core machine joins are slow.
    cluster = {"slurm": {"partition": "main"}, "ray": {"join_timeout_s": 180}}
    (folder / "slurm.yaml").write_text(yaml.safe_dump(cluster))
    return folder


def batch(env, shared, *argv: str, timeout=120):
    env = {**env, "LAUNCHER_STATE_DIR": str(shared / "state")}
    cluster = ("--cluster", str(shared / "slurm.yaml"))
    return launch(*argv, *cluster, cwd=shared, env=env, timeout=timeout)


def wait_status(env, shared, job_id, wanted, timeout=420):
    deadline = time.monotonic() + timeout
    while True:
        state = json.loads(batch(env, shared, "status", job_id, "--json").stdout)
        if state["status"] in wanted or time.monotonic() > deadline:
            return state
        time.sleep(2)


def test_a_submitted_batch_job_runs_on_both_nodes(slurm, env, shared):
    run_dir = shared / "run"
    submitted = batch(
        env, shared, "submit", str(shared / "job.yaml"), "--run-dir", str(run_dir), "--json"
    )
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    out = json.loads(submitted.stdout.strip().splitlines()[-1])
    job_id = out["job_id"]
    assert job_id.isdigit() and out["run_dir"] == str(run_dir)
    assert (run_dir / "launch.sbatch").is_file()
    state = wait_status(env, shared, job_id, {"SUCCEEDED", "FAILED", "STOPPED"})
    logs = batch(env, shared, "logs", job_id).stdout
    assert state["status"] == "SUCCEEDED", logs[-3000:]
    assert state["world_size"] == 2 and state["tokens_per_s"] > 0
    ranks_on_both_nodes(slurm, run_dir)
    assert "Per rank" in logs
    listed = json.loads(batch(env, shared, "list", "--json").stdout)
    assert [j["job_id"] for j in listed] == [job_id]
    assert slurm.queue() == []


def test_stop_of_a_batch_job_leaves_nothing_on_the_nodes(slurm, env, shared):
    job = yaml.safe_load((shared / "job.yaml").read_text())
    job["train"].update(steps=100000)
    (shared / "job.yaml").write_text(yaml.safe_dump(job))
    submitted = batch(env, shared, "submit", str(shared / "job.yaml"), "--json")
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    out = json.loads(submitted.stdout.strip().splitlines()[-1])
    job_id, run_dir = out["job_id"], Path(out["run_dir"])
    wait_for(
        lambda: list(run_dir.glob("metrics/rank*.jsonl")), timeout=300, what="training", poll=2
    )
    stopped = batch(env, shared, "stop", job_id, timeout=300)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert json.loads(batch(env, shared, "status", job_id, "--json").stdout)["status"] == "STOPPED"
    assert slurm.queue() == []
    for node in slurm.nodes.node_names:
        left = slurm.nodes.exec(node, "ps -eo args").stdout
        assert not any(w in left for w in ("raylet", "-m launcher", "torchrun")), left
