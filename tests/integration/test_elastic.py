"""Elastic restarts on simulated nodes: a node dies mid-run, the job goes on from its last
checkpoint on the nodes that remain (or a spare), with the same global batch.

Three (or four) network-namespace nodes with their own sshd, /tmp and ~/.ray; Ray bootstrapped
over SSH; the checkpoints in a folder every node sees (/var/tmp: shared, unlike /tmp).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

import pytest
import yaml
from fixtures.launching import Launcher, wait_for

from launcher.metrics import read_records

STEPS = 24
# A 3- or 4-node cluster, Ray bootstrapped over SSH, two attempts: minutes on a 2-core machine.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def shared_dir():
    path = Path("/var/tmp") / f"launcher-elastic-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def elastic_job(tmp_path: Path, ckpt: Path, *, nodes: int, min_nodes: int) -> Path:
    job = {
        "name": "elastic",
        "model": {"arch": "bert", "size": "tiny", "vocab_size": 512, "max_positions": 64},
        "data": {"source": "synthetic", "seq_len": 32},
        "train": {
            "steps": STEPS,
            "warmup_steps": 2,
            "micro_batch": 4,
            "grad_accum": 2,
            "lr": 1.0e-3,
            "log_every": 2,
            "checkpoint": {"dir": str(ckpt), "every_steps": 4},
        },
        "precision": {"dtype": "fp32"},
        "cudnn": {"benchmark": False},
        "resources": {"nodes": nodes, "min_nodes": min_nodes, "nproc_per_node": 1, "device": "cpu"},
        "launch": {"max_restarts": 1, "stop_grace_s": 2},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def kill_node_mid_run(cluster, node: str, run: Launcher, rank: int) -> None:
    """Once rank ``rank`` (on ``node``) is past the first two checkpoints, every process there but sshd dies."""
    metrics = run.run_dir / f"metrics/rank{rank}.jsonl"
    wait_for(
        lambda: (
            metrics.exists()
            and any(
                r.get("type") == "step" and r.get("step", 0) >= 9 for r in read_records(metrics)
            )
        ),
        timeout=300,
        what=f"rank {rank} past step 9",
        proc=run.proc,
    )
    keep = cluster.sshd_pids(node)
    for pid in [p for p in cluster.pids(node) if p not in keep]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def attempts(run_dir: Path, rank: int) -> list[list[tuple[int, float]]]:
    """Rank ``rank``'s (step, loss) records, one list per attempt (each attempt starts with a meta record)."""
    out: list[list[tuple[int, float]]] = []
    for r in read_records(run_dir / f"metrics/rank{rank}.jsonl"):
        if r.get("type") == "meta":
            out.append([])
        elif r.get("type") == "step" and r.get("loss") is not None:
            out[-1].append((r["step"], r["loss"]))
    return out


def assert_continuous(run_dir: Path) -> None:
    """After the restart the loss goes on from where it was, not back towards the initial loss.

    The attempts are told apart by their meta records, not by the step going back: the run may
    resume from a checkpoint written at the last step the first attempt logged.
    """
    first, second = attempts(run_dir, 0)
    first_loss, before, after = first[0][1], first[-1][1], second[0][1]
    assert second[0][0] > 0 and after < first_loss - 0.5 * (first_loss - before), (first, second)


def run_and_lose_node3(
    netns_cluster,
    tmp_path: Path,
    ckpt: Path,
    *,
    n_nodes: int,
    min_nodes: int,
    expect: int,
    skip_parity: bool = True,
) -> tuple[object, Path, float]:
    """Launch a 3-node elastic job on ``n_nodes`` simulated nodes, kill node 3 mid-run; returns
    (cluster, run dir, seconds from the kill to the exit) once it exited ``expect``."""
    cluster = netns_cluster(n_nodes)
    cluster_file = cluster.cluster_yaml(tmp_path / "cluster.yaml")
    job = elastic_job(tmp_path, ckpt, nodes=3, min_nodes=min_nodes)
    run_dir = tmp_path / f"elastic-{tmp_path.name}"
    args = [str(job), "--cluster", str(cluster_file), *(["--skip-parity"] if skip_parity else [])]
    with Launcher(*args, run_dir=run_dir, cwd=tmp_path) as run:
        kill_node_mid_run(cluster, cluster.node_names[2], run, rank=2)
        killed = time.monotonic()
        assert run.wait(timeout=400) == expect, run.output[-4000:]
        took = time.monotonic() - killed
        run.assert_nothing_left()
    return cluster, run_dir, took


def test_a_lost_node_shrinks_the_job_and_it_finishes(netns_cluster, tmp_path, shared_dir):
    cluster, run_dir, _ = run_and_lose_node3(
        netns_cluster, tmp_path, shared_dir / "ckpt", n_nodes=3, min_nodes=2, expect=0
    )
    victim = cluster.node_names[2]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["world_size"] == 2
    [restart] = summary["restarts"]
    assert restart["failed_node"] == victim and restart["world_size"] == 2
    assert restart["nodes"] == cluster.node_names[:2] and restart["resumed_from_step"] >= 8
    assert all(r["steps"] == STEPS for r in summary["ranks"])
    assert [a["world_size"] for a in summary["attempts"]] == [3, 2]
    second = json.loads((run_dir / "plan.attempt1.json").read_text())
    assert (
        second["world_size"] == 2 and [n["name"] for n in second["nodes"]] == cluster.node_names[:2]
    )
    assert_continuous(run_dir)
    assert "Restart 1:" in (run_dir / "summary.txt").read_text()


def test_a_spare_takes_the_lost_nodes_place(netns_cluster, tmp_path, shared_dir):
    """The spare passes the preflight (the whole launch runs it) and joins the bootstrapped Ray."""
    cluster, run_dir, _ = run_and_lose_node3(
        netns_cluster,
        tmp_path,
        shared_dir / "ckpt",
        n_nodes=4,
        min_nodes=2,
        expect=0,
        skip_parity=False,
    )
    victim, spare = cluster.node_names[2], cluster.node_names[3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["world_size"] == 3
    [restart] = summary["restarts"]
    assert restart["failed_node"] == victim and restart["nodes"] == [*cluster.node_names[:2], spare]
    assert {r["node"] for r in summary["ranks"]} == {*cluster.node_names[:2], spare}
    assert all(r["steps"] == STEPS for r in summary["ranks"])
    assert_continuous(run_dir)


def test_without_room_to_shrink_a_lost_node_ends_the_job(netns_cluster, tmp_path, shared_dir):
    cluster, run_dir, took = run_and_lose_node3(
        netns_cluster, tmp_path, shared_dir / "ckpt", n_nodes=3, min_nodes=3, expect=4
    )
    victim = cluster.node_names[2]
    assert took < 60, f"the lost node was noticed after {took:.0f} s"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["failure"]["node"] == victim
    assert "fewer than resources.min_nodes=3" in summary["failure"]["reason"]
