"""The SSH runner against real sshd in network namespaces: interrupts, known_hosts files, keys,
leaked connections, the remote shell.

One 3-node simulated cluster serves the module (tests/netns.py); tests that change a node
put it back, also on failure.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import paramiko
import pytest
from fixtures.launching import kill, processes, sigint_when, wait_for
from netns import keygen

from launcher.remote import CommandResult, NodeError, fan_out
from launcher.remote.ssh import SSHRunner
from launcher.spec.cluster import NodeSpec, SSHSpec

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def cluster(netns_cluster_module):
    return netns_cluster_module(3)


def nodes(cluster) -> list[NodeSpec]:
    return [NodeSpec(name=name, host=cluster.host(name)) for name in cluster.node_names]


def ssh_spec(cluster, **overrides) -> SSHSpec:
    fields = {"user": "root", "key": cluster.ssh_key, "known_hosts": cluster.known_hosts}
    return SSHSpec(**{**fields, "connect_timeout_s": 5, **overrides})


def running(argv: list[str]) -> list[int]:
    """Pids of the processes (the nodes share this pid namespace) running ``argv``."""
    return [pid for pid, cmd in processes().items() if cmd == " ".join(argv)]


def test_an_interrupted_fan_out_closes_the_ssh_connections_at_once(cluster):
    """Ctrl-C while every node runs a long command: raised at once, and each node's thread
    ends with its connection (closed) instead of waiting out the command."""
    argv = ["sleep", "37.25"]
    spec = ssh_spec(cluster)

    def work(node: NodeSpec):
        with SSHRunner(node, spec) as runner:
            return runner.run(" ".join(argv), timeout=60)

    before = set(threading.enumerate())
    try:
        with sigint_when(lambda: len(running(argv)) == 3) as sent, pytest.raises(KeyboardInterrupt):
            fan_out(nodes(cluster), work)
        assert sent, "the remote commands never started"
        assert time.monotonic() - sent[0] < 3.0
        deadline = time.monotonic() + 5
        while [t for t in set(threading.enumerate()) - before if t.name.startswith("fan-out")]:
            assert time.monotonic() < deadline, "fan-out threads still busy"
            time.sleep(0.05)
    finally:
        kill(running(argv))


def test_a_known_hosts_file_as_openssh_writes_it_is_read(cluster, tmp_path):
    """Marker lines (@cert-authority, @revoked), a garbled line and bytes that are not UTF-8
    around the nodes' keys: the keys are used, the rest skipped (paramiko raised on each)."""
    other = Path(f"{cluster.extra_key('other')}.pub").read_text().split()
    known = tmp_path / "known_hosts"
    known.write_bytes(
        f"@cert-authority *.example.com {other[0]} {other[1]}\n"
        f"@revoked 10.255.0.1 {other[0]} {other[1]}\n"
        "garbled ssh-ed25519 notbase64!!\n".encode()
        + b"caf\xe9 ssh-ed25519 AAAA\n"
        + cluster.known_hosts.read_bytes()
    )
    with SSHRunner(nodes(cluster)[1], ssh_spec(cluster, known_hosts=known)) as runner:
        assert runner.run("echo hi", timeout=30).stdout == "hi\n"


def test_a_revoked_host_key_is_refused_even_with_opt_in(cluster, tmp_path):
    node0 = cluster.known_hosts.read_text().splitlines()[0]
    known = tmp_path / "known_hosts"
    for lines, accept in (([f"@revoked {node0}", node0], False), ([f"@revoked {node0}"], True)):
        known.write_text("\n".join(lines) + "\n")
        spec = ssh_spec(cluster, known_hosts=known, accept_unknown_host_keys=accept)
        with SSHRunner(nodes(cluster)[0], spec) as runner, pytest.raises(NodeError) as info:
            runner.run("echo hi", timeout=30)
        assert info.value.kind == "HOST KEY REVOKED", info.value
        assert str(known) in info.value.message
        assert known.read_text().splitlines() == lines


def test_an_unreadable_known_hosts_file_is_a_node_error_naming_it(cluster, tmp_path):
    known = tmp_path / "known_hosts"
    known.mkdir()  # root reads any file; a folder cannot be read as one
    with (
        SSHRunner(nodes(cluster)[0], ssh_spec(cluster, known_hosts=known)) as runner,
        pytest.raises(NodeError) as info,
    ):
        runner.run("echo hi", timeout=30)
    assert f"cannot read the known_hosts file {known}" in info.value.message


@pytest.mark.parametrize("kind", ["rsa", "ecdsa"])
def test_a_refused_key_of_any_type_is_an_authentication_failure(cluster, tmp_path, kind):
    """paramiko read an RSA/ECDSA key file as each key type in turn and re-raised the last
    parse error: "ssh error: SSHException: Invalid key" instead of the refusal."""
    key = keygen(tmp_path / f"id_{kind}", kind)
    node = nodes(cluster)[2]
    with SSHRunner(node, ssh_spec(cluster, key=key)) as runner, pytest.raises(NodeError) as info:
        runner.run("echo hi", timeout=30)
    assert info.value.kind == "authentication failed", info.value
    assert f"did not accept key {key}" in info.value.message

    authorized = cluster.authorized_keys(node.name)
    accepted = authorized.read_text()
    try:  # the same key, once the node accepts it
        authorized.write_text(accepted + Path(f"{key}.pub").read_text())
        with SSHRunner(node, ssh_spec(cluster, key=key)) as runner:
            assert runner.run("echo hi", timeout=30).stdout == "hi\n"
    finally:
        authorized.write_text(accepted)


def test_key_files_that_cannot_be_used_are_named_before_connecting(cluster, tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "public").write_text(Path(f"{cluster.ssh_key}.pub").read_text())
    encrypted = keygen(tmp_path / "encrypted", "ed25519", "secret-phrase")
    cases = {
        tmp_path / "missing": "not found",
        tmp_path / "folder": "cannot read key file",  # root reads any file, but not a folder
        encrypted: "is encrypted; load it into ssh-agent",
        tmp_path / "public": "is not a private key",
    }
    for key, fragment in cases.items():
        with (
            SSHRunner(nodes(cluster)[0], ssh_spec(cluster, key=key)) as runner,
            pytest.raises(NodeError) as info,
        ):
            runner.run("echo hi", timeout=30)
        assert info.value.kind == "authentication failed", info.value
        assert fragment in info.value.message and str(key) in info.value.message


def transports() -> list[paramiko.Transport]:
    return [t for t in threading.enumerate() if isinstance(t, paramiko.Transport) and t.is_alive()]


def test_failed_connects_leave_no_transport_behind(cluster, tmp_path):
    """A refused key, a refused and a revoked host key: each connect fails after the SSH
    transport started; its thread and socket go with the failure."""
    node0 = cluster.known_hosts.read_text().splitlines()[0]
    (tmp_path / "revoked").write_text(f"@revoked {node0}\n{node0}\n")
    (tmp_path / "empty").write_text("")
    specs = [
        ssh_spec(cluster, key=cluster.extra_key()),
        ssh_spec(cluster, known_hosts=tmp_path / "empty"),
        ssh_spec(cluster, known_hosts=tmp_path / "revoked"),
    ]
    before = len(transports())
    for _ in range(3):
        for spec in specs:
            with SSHRunner(nodes(cluster)[0], spec) as runner, pytest.raises(NodeError):
                runner.run("echo hi", timeout=30)
    wait_for(lambda: len(transports()) == before, timeout=5, what="no transport left", poll=0.05)


def test_commands_run_under_sh_whatever_the_login_shell(cluster):
    """sshd hands the command to the user's login shell (bash here; csh, tcsh or fish on
    some clusters, where ``VAR=x cmd``, ``rc=$?`` and ``export K=v &&`` fail): the runner
    sends it to sh, with its environment and stdin."""
    assert cluster.exec("node0", "getent passwd root | cut -d: -f7").stdout.strip() != "/bin/sh"
    with SSHRunner(nodes(cluster)[0], ssh_spec(cluster)) as runner:
        assert runner.run("echo $0", timeout=30).stdout == "sh\n"
        result = runner.run(
            "K2=y sh -c 'echo \"$K $K2\"'; rc=$?; cat; exit $rc",
            stdin="from stdin\n",
            env={"K": "a b'c $HOME"},
            timeout=30,
        )
        assert result.stdout == "a b'c $HOME y\nfrom stdin\n" and result.exit_code == 0


def test_a_remote_command_past_its_timeout_stops_itself(cluster):
    """Closing the channel does not stop a remote command: one that outlives its timeout is
    ended on the node soon after (by coreutils' timeout), and its exit code passes through. A
    closed runner fails its next command."""
    argv = ["sleep", "41.75"]
    try:
        with SSHRunner(nodes(cluster)[0], ssh_spec(cluster)) as runner:
            result = runner.run("cat; exit 7", stdin="in\n", timeout=30)
            assert result == CommandResult("in\n", "", 7)
            with pytest.raises(NodeError) as info:
                runner.run(" ".join(argv), timeout=1)
        assert str(info.value) == "timed out: 'sleep 41.75' did not finish within 1 s"
        with pytest.raises(NodeError, match="is closed"):
            runner.run("echo hi", timeout=30)
        wait_for(lambda: not running(argv), timeout=15, what="the remote command to end")
    finally:
        kill(running(argv))


def test_a_tunnel_carries_a_connection_and_ends_one_the_node_refuses_at_once(cluster):
    """``SSHRunner.forward``: a connection reaches the node's sshd (its banner comes back); one
    to a port nothing listens on ends at once, and the tunnel serves the next (the jobs API's
    status call through a tunnel to a dead head says "no answer" without waiting its timeout)."""
    node = nodes(cluster)[0]
    with SSHRunner(node, ssh_spec(cluster)) as runner:
        with (
            runner.forward(node.host, 22) as port,
            socket.create_connection(("127.0.0.1", port), timeout=10) as sock,
        ):
            assert sock.recv(64).startswith(b"SSH-2.0-")
        with runner.forward("127.0.0.1", 9) as port:  # nothing listens there on the node
            for _ in range(2):
                began = time.monotonic()
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                    assert sock.recv(64) == b""
                assert time.monotonic() - began < 3
