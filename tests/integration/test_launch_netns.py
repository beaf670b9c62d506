"""A real two-node launch: network namespaces with their own sshd, /tmp, /dev/shm, ~/.ray and
hostname; Ray bootstrapped over SSH; the launcher outside the nodes, like a login node."""

from __future__ import annotations

import json
import time

from fixtures.launching import Launcher, launch, quick_job


def test_two_nodes_bootstrapped_over_ssh(netns_cluster, tmp_path):
    cluster = netns_cluster(2)
    cluster_file = cluster.cluster_yaml(tmp_path / "cluster.yaml")
    job_file = quick_job(tmp_path, steps=8, profile={"start_step": 4, "steps": 2, "ranks": "all"})
    run_dir = tmp_path / "run"

    result = launch(
        str(job_file), "--cluster", str(cluster_file), "--run-dir", str(run_dir), cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["nodes"] == 2 and summary["world_size"] == 2
    hosts = {r["rank"]: r["host"] for r in summary["ranks"]}
    assert hosts == {0: cluster.host(cluster.node_names[0]), 1: cluster.host(cluster.node_names[1])}
    assert all(r["steps"] == 8 and r["tokens_per_s"] > 0 for r in summary["ranks"])
    # logs and metrics of the remote nodes came back through Ray (no shared /tmp)
    for rank, node in enumerate(cluster.node_names):
        assert (run_dir / f"logs/{node}/rank{rank}.log").is_file()
        assert (run_dir / f"metrics/rank{rank}.jsonl").stat().st_size > 0
        assert (run_dir / f"preflight/{node}.json").is_file()
        # train.profile: written in the node's private /tmp, fetched before its workdir went
        ops = (run_dir / f"profile/{node}/rank{rank}.ops.txt").read_text()
        assert ops.startswith(f"rank {rank}, steps 4..5:")
        assert (run_dir / f"profile/{node}/rank{rank}.trace.json.gz").stat().st_size > 0
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["master_addr"] == cluster.host(cluster.node_names[0])
    # No GLOO_SOCKET_IFNAME in the files: each node's route to the head chose eth0, not the
    # loopback its host name resolves to; the plan records it and why, the preflight shows it.
    parity = (run_dir / "preflight/parity.txt").read_text()
    for node in plan["nodes"]:
        assert node["env"]["GLOO_SOCKET_IFNAME"] == "eth0"
        assert node["env_sources"]["GLOO_SOCKET_IFNAME"].startswith("preflight: ")
        assert node["route"]["interface"] == "eth0"
        assert node["route"]["address"] == cluster.host(node["name"])
        assert f"eth0 {cluster.host(node['name'])}" in parity
    assert "route to head" in parity
    # Ray was stopped on both nodes, its token file removed, nothing but sshd left in them
    assert not (left := cluster.left_running()), f"left on the nodes: {left}"
    for node in cluster.node_names:
        assert "launcher_auth_token" not in cluster.exec(node, "ls -a $HOME/.ray").stdout
        # Ray's private temp dir and the run's node folder are gone; Ray never used /tmp/ray
        assert "launcher" not in cluster.exec(node, "ls -a /tmp").stdout
    # the token never reached a command line or a run record
    assert "RAY_AUTH_TOKEN=" not in result.stderr + result.stdout


def test_nodes_that_cannot_reach_the_master_port_stop_the_launch(netns_cluster, tmp_path):
    """Before any worker starts, each node, the head too, connects to the head's rendezvous port
    from its workers' interface. In one launch: node0 given loopback as its GLOO_SOCKET_IFNAME
    (its gloo peers would get 127.0.0.1), node1 with no route to that port (a prohibit rule in its
    namespace; SSH and Ray still pass). Exit 3 naming each node and what failed, the check under
    15 s, no worker started."""
    cluster = netns_cluster(2)
    lo_node, blocked_node = cluster.node_names
    port = 29555
    job_file = quick_job(tmp_path, steps=4, warmup_steps=1, log_every=1)
    head = cluster.host(0)

    cluster.exec(blocked_node, f"ip rule add ipproto tcp dport {port} prohibit", check=True)
    cluster_file = cluster.cluster_yaml(
        tmp_path / "cluster.yaml", nodes={lo_node: {"env": {"GLOO_SOCKET_IFNAME": "lo"}}}
    )
    run_dir = tmp_path / "run"
    result = launch(
        str(job_file),
        *("--set", f"launch.master_port={port}", "--cluster", str(cluster_file)),
        *("--run-dir", str(run_dir)),
        cwd=tmp_path,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 3, out[-3000:]
    assert f"node {lo_node}: GLOO_SOCKET_IFNAME=lo: lo (127.0.0.1) is loopback" in out, out[-3000:]
    expect = f"cannot connect to {head}:{port} from eth0 ({cluster.host(1)})"
    assert f"node {blocked_node}: {expect}" in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["ranks"] == []
    assert summary["launcher_timings_s"]["network"] < 15
    assert not list((run_dir / "logs").glob("*/rank*.log"))


def test_kill_9_of_the_launcher_stops_a_bootstrapped_ray_within_15_s(netns_cluster, tmp_path):
    """The launcher (outside the nodes) is SIGKILLed mid-run: its watchdog stops Ray on every
    node over SSH, and the agents' reapers end torchrun there; nothing but sshd is left."""
    cluster = netns_cluster(2)
    cluster_file = cluster.cluster_yaml(tmp_path / "cluster.yaml")
    job_file = quick_job(tmp_path, steps=100000, log_every=1)
    args = (str(job_file), "--cluster", str(cluster_file), "--skip-parity")
    with Launcher(*args, run_dir=tmp_path / "run", cwd=tmp_path) as run:
        run.wait_file("metrics/rank1.jsonl", timeout=300)
        run.proc.kill()
        run.proc.wait(timeout=10)
        killed = time.monotonic()
        while (running := cluster.left_running()) and time.monotonic() < killed + 15:
            time.sleep(0.5)
    assert not running, f"left running 15 s after kill -9 of the launcher: {running}"
