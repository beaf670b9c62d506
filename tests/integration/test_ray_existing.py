"""A Ray cluster started by hand on two simulated nodes, as a user would: `ray start --head` on
one, `ray start --address` on the other, token auth on. The launcher attaches to it (Ray
Client) for a foreground run and submits to its Jobs API with the cluster's token."""

from __future__ import annotations

import json
import os

import pytest
from fixtures.launching import launch as run_launcher
from fixtures.launching import quick_job
from test_jobs_netns import ended_succeeded

pytestmark = [pytest.mark.netns, pytest.mark.ray]


def _ray(cluster, node: str, args: str, token: str | None = None) -> str:
    python = cluster.node_python()
    write = (  # the head makes the cluster's token; the others are given it
        f"mkdir -p $HOME/.ray && printf %s {token} > $HOME/.ray/auth_token && "
        if token
        else f"{python} -m ray.scripts.scripts get-auth-token --generate > /dev/null && "
    )
    done = cluster.exec(
        node,
        f"{write}RAY_AUTH_MODE=token {python} -m ray.scripts.scripts {args} "
        f"--disable-usage-stats > /tmp/ray-start.log 2>&1; rc=$?; cat /tmp/ray-start.log; exit $rc",
        timeout=180,
    )
    assert done.returncode == 0, (node, done.stdout[-1500:], done.stderr[-2000:])
    return done.stdout


def test_a_run_and_a_submission_on_a_ray_cluster_started_by_hand(netns_cluster, tmp_path):
    cluster = netns_cluster(2)
    head, other = cluster.node_names
    ip = cluster.host(head)
    _ray(
        cluster,
        head,
        f"start --head --node-ip-address {ip} --port 6379 --ray-client-server-port 10001 "
        f"--dashboard-host 0.0.0.0 --dashboard-port 8265",
    )
    token = cluster.exec(head, "cat $HOME/.ray/auth_token").stdout.strip()
    assert token
    _ray(
        cluster,
        other,
        f"start --address {ip}:6379 --node-ip-address {cluster.host(other)}",
        token=token,
    )
    cluster_file = cluster.cluster_yaml(
        tmp_path / "cluster.yaml",
        ray={"address": f"ray://{ip}:10001", "jobs_address": f"http://{ip}:8265"},
    )
    job_file = quick_job(tmp_path)
    env = {**os.environ, "RAY_AUTH_TOKEN": token}

    def launch(*args: str):
        return run_launcher(*args, "--cluster", str(cluster_file), cwd=tmp_path, env=env)

    run_dir = tmp_path / "run"
    run = launch(str(job_file), "--run-dir", str(run_dir))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["nodes"] == 2
    assert {r["host"] for r in summary["ranks"]} == {ip, cluster.host(other)}

    submitted = launch("submit", str(job_file), "--json")
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    job_id = json.loads(submitted.stdout.strip().splitlines()[-1])["job_id"]
    # One follower until the job ends, not a status process every few seconds.
    follow = launch("logs", job_id, "--follow")
    ended = ended_succeeded(job_id, follow.stdout)
    assert follow.returncode == 0 and ended, follow.stdout[-3000:] + follow.stderr[-3000:]
    state = json.loads(launch("status", job_id, "--json").stdout)
    assert state["status"] == "SUCCEEDED" and state["world_size"] == 2, state
    # The cluster is the user's: still running, with both nodes.
    alive = cluster.exec(head, "pgrep -c raylet").stdout.strip()
    assert alive == "1" and cluster.exec(other, "pgrep -c raylet").stdout.strip() == "1"
