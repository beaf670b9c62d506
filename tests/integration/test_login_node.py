"""Compute nodes behind a login node, named as the user's ~/.ssh/config names them.

Node 0 of the simulated cluster is the login node (on the launcher's bridge and an inner one);
the compute nodes sit on the inner bridge only. The cluster file has no ``ssh:`` section: the
aliases, users, keys, known_hosts and ProxyJump come from ``$HOME/.ssh/config``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from fixtures.launching import launch, quick_job
from netns import ssh_answers

pytestmark = [pytest.mark.netns, pytest.mark.ray]


def _ssh_config(cluster, home: Path) -> None:
    (home / ".ssh").mkdir(mode=0o700, parents=True)
    login, *compute = cluster.node_names
    common = (
        f"  User root\n  IdentityFile {cluster.ssh_key}\n"
        f"  UserKnownHostsFile {cluster.known_hosts}\n"
    )
    text = f"Host login\n  HostName {cluster.host(login)}\n{common}\n"
    for i, node in enumerate(compute):
        text += f"Host gpu-{i}\n  HostName {cluster.host(node)}\n"
    text += f"\nHost gpu-*\n  ProxyJump login\n{common}"
    (home / ".ssh/config").write_text(text)


def test_check_and_a_two_node_run_through_a_login_node(netns_cluster, tmp_path):
    cluster = netns_cluster(3, login_node=True)
    home = tmp_path / "home"
    _ssh_config(cluster, home)
    # this machine's default route may lead to something that accepts any connection: what
    # matters is that no sshd answers
    assert not ssh_answers(cluster.host("node1"), 2), "the compute nodes must be out of reach"
    python = str(cluster.node_python())
    cluster_file = tmp_path / "cluster.yaml"
    nodes = [{"name": f"gpu-{i}", "host": f"gpu-{i}", "python": python} for i in range(2)]
    cluster_file.write_text(yaml.safe_dump({"nodes": nodes}))

    env = {**os.environ, "HOME": str(home)}
    check = launch("check", "--cluster", str(cluster_file), "--json", cwd=tmp_path, env=env)
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-3000:]

    run_dir = tmp_path / "run"
    run = launch(
        str(quick_job(tmp_path)),
        *("--cluster", str(cluster_file), "--run-dir", str(run_dir)),
        cwd=tmp_path,
        env=env,
        timeout=480,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["world_size"] == 2
    assert {r["rank"]: r["host"] for r in summary["ranks"]} == {0: "gpu-0", 1: "gpu-1"}
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["master_addr"] == cluster.host("node1")  # the alias's HostName
    assert not (left := cluster.left_running()), f"left on the nodes: {left}"
