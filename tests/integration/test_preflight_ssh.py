"""Preflight against real sshd in network namespaces: agreement, real mismatches, broken nodes.

One 3-node simulated cluster serves the module; each test writes its own cluster.yaml. Venvs,
wrapper interpreters and packages live under the cluster's folder in /var/tmp (each node's
/tmp is private) and go away with it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.launching import wait_for

from launcher.cli import main
from launcher.errors import PreflightError
from launcher.preflight import check_command, run_preflight
from launcher.spec import load_cluster, load_job

pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def cluster(netns_cluster_module):
    return netns_cluster_module(3)


def write_cluster(cluster, tmp_path: Path, *, nodes=None, **overrides):
    """cluster.yaml and its spec; the nodes run the cluster's copy of the launcher."""
    path = cluster.cluster_yaml(tmp_path / "cluster.yaml", nodes=nodes, **overrides)
    return path, load_cluster(path)


@pytest.fixture(scope="module")
def fixture_venvs(cluster) -> dict[str, str]:
    """Two venvs (--system-site-packages) with parity-fixture 1.0 and 2.0 installed.

    Installed by hand as pip would leave them (the package and its .dist-info), so no build
    tooling (setuptools, wheel) is needed: a fresh venv has none that can build.
    """
    pythons = {}
    for version in ("1.0", "2.0"):
        venv = cluster.dir / f"venv-{version}"
        subprocess.run(
            [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
            check=True,
        )
        site = venv / f"lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"
        (site / "parity_fixture").mkdir(parents=True)
        (site / "parity_fixture" / "__init__.py").write_text(f'__version__ = "{version}"\n')
        dist = site / f"parity_fixture-{version}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: parity-fixture\nVersion: {version}\n"
        )
        (dist / "INSTALLER").write_text("tests\n")
        pythons[version] = str(venv / "bin" / "python")
    return pythons


def test_equal_nodes_agree(cluster, tmp_path, capsys):
    path, spec = write_cluster(cluster, tmp_path)
    report = run_preflight(spec, deep=False)
    assert report.ok, report.table()
    assert report.verdict == "parity OK: 3 nodes agree"
    assert [report.probes[n]["hostname"] for n in cluster.node_names] == cluster.node_names
    assert all(report.gpus(n) == 0 for n in cluster.node_names)
    report.raise_for_failure()

    assert main(["check", "--cluster", str(path), "--fast"]) == 0
    assert "parity OK: 3 nodes agree" in capsys.readouterr().out
    assert check_command(str(path), None, fast=True, as_json=True) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["nodes"] == cluster.node_names


def test_without_ssh_key_the_agents_identity_is_used(cluster, tmp_path, monkeypatch):
    """No ``ssh.key`` in cluster.yaml: ssh-agent's identities, as the spec documents (the nodes
    accept only the cluster's key, which only the agent holds here)."""
    sock = tmp_path / "agent.sock"
    agent = subprocess.Popen(
        ["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for(sock.exists, timeout=10, what="ssh-agent's socket")
        subprocess.run(
            ["ssh-add", str(cluster.ssh_key)],
            env={"SSH_AUTH_SOCK": str(sock), "PATH": "/usr/bin:/bin"},
            check=True,
            capture_output=True,
            timeout=10,
        )
        monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
        _, spec = write_cluster(cluster, tmp_path, ssh={"key": None})
        assert spec.ssh.key is None
        report = run_preflight(spec, deep=False)
        assert report.ok, report.table()
    finally:
        agent.kill()
        agent.wait(timeout=10)


def test_deep_probe_over_ssh_and_the_nccl_interface(cluster, tmp_path):
    _, spec = write_cluster(
        cluster,
        tmp_path,
        nodes={
            "node0": {"env": {"NCCL_SOCKET_IFNAME": "eth0"}},
            "node2": {"env": {"NCCL_SOCKET_IFNAME": "ib"}},
        },
    )
    report = run_preflight(spec, deep=True)
    for node in cluster.node_names:
        deep = report.probes[node]["deep"]
        assert deep["cuda_available"] is False and deep["device_count"] == 0, deep
    verdict = "parity FAILED: node2: NCCL_SOCKET_IFNAME=ib names no interface here (has eth0, lo)"
    assert report.verdict == verdict
    report.save(tmp_path / "preflight")
    saved = sorted(p.name for p in (tmp_path / "preflight").iterdir())
    assert saved == [*(f"{node}.json" for node in cluster.node_names), "parity.txt"]


def test_gpu_job_on_cpu_nodes_and_first_k_nodes(cluster, tmp_path, capsys):
    path, spec = write_cluster(cluster, tmp_path)
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: j\nresources: {nodes: 2, device: cuda, nproc_per_node: 2}\n")
    report = run_preflight(spec, load_job(job_file), deep=False)
    assert list(report.probes) == ["node0", "node1"]
    verdict = "parity FAILED: node0: needs 2 GPUs, has 0; node1: needs 2 GPUs, has 0"
    assert report.verdict == verdict
    with pytest.raises(PreflightError) as info:
        report.raise_for_failure()
    assert info.value.exit_code == 3

    # `launch plan` (and --dry-run) show the fields × nodes table of `launch check`, then the error
    capsys.readouterr()
    for argv in (["plan", str(job_file)], [str(job_file), "--dry-run"]):
        assert main([*argv, "--cluster", str(path)]) == 3
        captured = capsys.readouterr()
        header = next(line for line in captured.out.splitlines() if line.startswith("field"))
        assert header.split() == ["field", "policy", "node0", "node1"]
        assert verdict in captured.out
        assert "Plan for job" not in captured.out
        assert "error: Preflight failed on 2 of 2 nodes (node0, node1)" in captured.err


def test_listed_package_differs_on_a_venv_node(cluster, tmp_path, fixture_venvs, capsys):
    versions = {"node0": "1.0", "node1": "1.0", "node2": "2.0"}
    nodes = {n: {"python": str(cluster.node_python(fixture_venvs[v]))} for n, v in versions.items()}
    path, spec = write_cluster(
        cluster, tmp_path, nodes=nodes, parity={"packages": ["parity-fixture"]}
    )
    report = run_preflight(spec, deep=False)
    assert report.verdict == "parity FAILED: node2 differs in parity-fixture (2.0 vs 1.0)"
    row = next(line for line in report.table().splitlines() if line.startswith("parity-fixture"))
    assert row.split()[-3:] == ["1.0", "2.0", "✗"]
    assert report.probes["node2"]["python"]["venv"] is True
    assert check_command(str(path), None, fast=True, as_json=True) == 3
    cells = next(
        f for f in json.loads(capsys.readouterr().out)["fields"] if f["field"] == "parity-fixture"
    )["cells"]
    assert cells["node2"] == {"value": "2.0", "mark": "fail"}


def test_stale_launcher_code_on_one_node(cluster, tmp_path):
    stale = cluster.launcher_copy("stale")
    with open(stale / "launcher" / "preflight" / "parity.py", "a") as fh:
        fh.write("\n# an edit that never reached the other nodes\n")
    wrapper = cluster.node_python(copy="stale")
    _, spec = write_cluster(cluster, tmp_path, nodes={"node1": {"python": str(wrapper)}})
    report = run_preflight(spec, deep=False)
    assert report.probes["node1"]["launcher"]["path"] == str(stale / "launcher")
    assert report.bad_nodes == ["node1"]
    assert "node1 differs in launcher code" in report.verdict


def test_broken_nodes_are_reported_each_and_the_rest_still_probed(netns_cluster, tmp_path):
    cluster = netns_cluster(4)
    crash = cluster.dir / "crashing-python"
    crash.write_text("#!/bin/sh\necho 'simulated probe crash' >&2; exit 3\n")
    crash.chmod(0o755)
    cluster.authorized_keys("node1").write_text(Path(f"{cluster.extra_key()}.pub").read_text())
    path, spec = write_cluster(
        cluster,
        tmp_path,
        nodes={
            "node2": {"python": "/nonexistent/bin/python"},
            "node3": {"python": str(crash)},
            "ghost": {"host": cluster.unused_host()},
        },
    )
    started = time.monotonic()
    report = run_preflight(spec, deep=False)
    elapsed = time.monotonic() - started
    kinds = {node: err["kind"] for node, err in report.errors.items()}
    assert kinds == {
        "node1": "authentication failed",
        "node2": "interpreter missing",
        "node3": "probe crashed",
        "ghost": "unreachable",
    }, report.table()
    assert report.probes["node0"]["hostname"] == "node0" and "node0" not in report.bad_nodes
    assert "simulated probe crash" in report.errors["node3"]["message"]
    assert elapsed < spec.ssh.connect_timeout_s + 10
    for node, kind in kinds.items():
        assert f"{node} {kind}" in report.verdict
    assert check_command(str(path), None, fast=True, as_json=False) == 3


def test_unknown_host_keys_are_refused_unless_opted_in(cluster, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("")
    _, spec = write_cluster(cluster, tmp_path, ssh={"known_hosts": str(known)})
    report = run_preflight(spec, deep=False)
    assert {e["kind"] for e in report.errors.values()} == {"unknown host key"}
    keyscan = f"ssh-keyscan -p 22 {cluster.host('node0')} >> {known}"
    assert keyscan in report.errors["node0"]["message"]

    _, spec = write_cluster(
        cluster, tmp_path, ssh={"known_hosts": str(known), "accept_unknown_host_keys": True}
    )
    assert run_preflight(spec, deep=False).ok
    assert len(known.read_text().splitlines()) == 3

    _, spec = write_cluster(cluster, tmp_path, ssh={"known_hosts": str(known)})
    assert run_preflight(spec, deep=False).ok  # recorded keys now verify


def test_host_key_mismatch_is_refused_even_with_opt_in(cluster, tmp_path):
    lines = cluster.known_hosts.read_text().splitlines()
    node0_key = lines[0].split(" ", 1)[1]
    forged = [lines[0], f"{cluster.host('node1')} {node0_key}", lines[2]]
    known = tmp_path / "known_hosts"
    known.write_text("\n".join(forged) + "\n")
    _, spec = write_cluster(
        cluster, tmp_path, ssh={"known_hosts": str(known), "accept_unknown_host_keys": True}
    )
    report = run_preflight(spec, deep=False)
    assert list(report.errors) == ["node1"]
    assert report.errors["node1"]["kind"] == "HOST KEY MISMATCH"
    assert "man-in-the-middle" in report.errors["node1"]["message"]
    assert known.read_text().splitlines() == forged
