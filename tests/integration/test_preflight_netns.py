"""The simulated cluster itself: nodes answer SSH, have their own hostname, /tmp and address."""

from __future__ import annotations

import subprocess

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]


def _ssh(cluster, node: str, command: str) -> subprocess.CompletedProcess[str]:
    options = [f"UserKnownHostsFile={cluster.known_hosts}", "StrictHostKeyChecking=yes"]
    options += ["BatchMode=yes", "ConnectTimeout=5"]
    argv = ["ssh", "-i", str(cluster.ssh_key), *(f"-o{o}" for o in options)]
    return subprocess.run(
        [*argv, f"root@{cluster.host(node)}", command], capture_output=True, text=True, timeout=30
    )


def test_nodes_are_separate_machines_and_teardown_removes_everything(netns_cluster):
    cluster = netns_cluster(3)
    cluster.exec("node0", "echo secret > /tmp/only-on-node0", check=True)
    for node in cluster.node_names:
        out = _ssh(cluster, node, "hostname; ls /tmp; ip -4 -o addr show dev eth0")
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0] == node
        assert ("only-on-node0" in out.stdout) == (node == "node0")
        assert cluster.host(node) in out.stdout

    namespaces = [cluster.namespace(n) for n in cluster.node_names]
    sshd_pids = [p for n in cluster.node_names for p in cluster.pids(n)]
    assert sshd_pids
    cluster.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces)
    links = subprocess.run(["ip", "link", "show", cluster.bridge], capture_output=True, text=True)
    assert links.returncode != 0
    assert not cluster.dir.exists()
    for pid in sshd_pids:
        assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0
