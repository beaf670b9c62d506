"""Elastic restarts on simulated nodes: a node dies mid-run, the job goes on from its last
checkpoint on the nodes that remain (or a spare), with the same global batch.

Four network-namespace nodes with their own sshd, /tmp and ~/.ray; Ray bootstrapped
over SSH; the checkpoints in a folder every node sees (/var/tmp: shared, unlike /tmp).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures.launching import Launcher, kill, wait_for, write_job

from launcher.metrics import read_records

STEPS = 16  # attempt 0 dies past step 8, attempt 1 past 12: the last runs 13-16
# A 4-node cluster, Ray bootstrapped over SSH, three attempts: minutes on a 2-core machine.
pytestmark = pytest.mark.timeout(900)


def elastic_job(
    tmp_path: Path, ckpt: Path, *, nodes: int, min_nodes: int, max_restarts: int
) -> Path:
    return write_job(
        tmp_path,
        "builtin",
        model={"arch": "bert", "size": "tiny", "vocab_size": 512, "max_positions": 64},
        data={"source": "synthetic", "seq_len": 32},
        train={
            "steps": STEPS,
            "warmup_steps": 2,
            "micro_batch": 4,
            "grad_accum": 2,
            "lr": 1.0e-3,
            "log_every": 2,
            "checkpoint": {"dir": str(ckpt), "every_steps": 4},
        },
        cudnn={"benchmark": False},
        resources={"nodes": nodes, "min_nodes": min_nodes, "nproc_per_node": 1, "device": "cpu"},
        launch={"max_restarts": max_restarts, "stop_grace_s": 2},
    )


def kill_node_mid_run(cluster, node: str, run: Launcher, rank: int, attempt: int, past: int):
    """Once rank ``rank`` (on ``node``) logged a step past ``past`` in attempt ``attempt``, every
    process there but sshd dies."""
    wait_for(
        lambda: (
            (run.run_dir / f"metrics/rank{rank}.jsonl").exists()
            and len(steps := attempts(run.run_dir, rank)) > attempt
            and any(step > past for step, _ in steps[attempt])
        ),
        timeout=300,
        what=f"rank {rank} past step {past} in attempt {attempt}",
        proc=run.proc,
    )
    keep = cluster.sshd_pids(node)
    kill([p for p in cluster.pids(node) if p not in keep])


def attempts(run_dir: Path, rank: int) -> list[list[tuple[int, float]]]:
    """Rank ``rank``'s (step, loss) records, one list per attempt (each attempt starts with a meta record)."""
    out: list[list[tuple[int, float]]] = []
    for r in read_records(run_dir / f"metrics/rank{rank}.jsonl"):
        if r.get("type") == "meta":
            out.append([])
        elif r.get("type") == "step" and r.get("loss") is not None:
            out[-1].append((r["step"], r["loss"]))
    return out


def assert_continuous(run_dir: Path, n_attempts: int) -> None:
    """After each restart the loss goes on from where it was, not back towards the initial loss.

    The attempts are told apart by their meta records, not by the step going back: the run may
    resume from a checkpoint written at the last step the attempt before logged.
    """
    runs = attempts(run_dir, 0)
    assert len(runs) == n_attempts, runs
    initial = runs[0][0][1]
    for before, after in zip(runs, runs[1:], strict=False):
        assert after[0][0] > 0, runs
        assert after[0][1] < initial - 0.5 * (initial - before[-1][1]), runs


def test_a_spare_takes_a_lost_nodes_place_then_the_job_shrinks_and_finishes(
    netns_cluster, tmp_path, shared_dir
):
    """A 3-node job on 4 nodes. Node 3 dies: the spare passes the preflight (the whole launch
    runs it), joins the bootstrapped Ray and takes its place. Then the spare dies: with no spare
    left the job goes on with 2 nodes, the same global batch, and finishes."""
    cluster = netns_cluster(4)
    first, second, victim, spare = cluster.node_names
    cluster_file = cluster.cluster_yaml(tmp_path / "cluster.yaml")
    job = elastic_job(tmp_path, shared_dir / "ckpt", nodes=3, min_nodes=2, max_restarts=2)
    run_dir = tmp_path / f"elastic-{tmp_path.name}"
    with Launcher(str(job), "--cluster", str(cluster_file), run_dir=run_dir, cwd=tmp_path) as run:
        kill_node_mid_run(cluster, victim, run, rank=2, attempt=0, past=8)
        kill_node_mid_run(cluster, spare, run, rank=2, attempt=1, past=12)
        assert run.wait(timeout=400) == 0, run.output[-4000:]
        run.assert_nothing_left()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["world_size"] == 2
    took_spare, shrank = summary["restarts"]
    assert took_spare["failed_node"] == victim and took_spare["world_size"] == 3
    assert took_spare["nodes"] == [first, second, spare] and took_spare["resumed_from_step"] >= 8
    assert shrank["failed_node"] == spare and shrank["world_size"] == 2
    assert shrank["nodes"] == [first, second] and shrank["resumed_from_step"] >= 8
    assert [a["world_size"] for a in summary["attempts"]] == [3, 3, 2]
    assert {r["node"] for r in summary["ranks"]} == {first, second}
    assert all(r["steps"] == STEPS for r in summary["ranks"])
    for attempt, nodes in ((1, [first, second, spare]), (2, [first, second])):
        plan = json.loads((run_dir / f"plan.attempt{attempt}.json").read_text())
        assert plan["world_size"] == len(nodes) and [n["name"] for n in plan["nodes"]] == nodes
    assert_continuous(run_dir, 3)
    assert "Restart 2:" in (run_dir / "summary.txt").read_text()
