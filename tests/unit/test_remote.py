"""The remote-command layer without SSH: the local runner, fan-out, error classification, probe
output parsing."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import paramiko
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import dsa
from fixtures.launching import processes, sigint_when, wait_for

import launcher.preflight.probe
from launcher.preflight import PROBE_SOURCE, nodes_for_job, parse_probe_output, probe_node
from launcher.remote import (
    AUTH_FAILED,
    BAD_JSON,
    HOST_KEY_MISMATCH,
    INTERPRETER_MISSING,
    PROBE_CRASHED,
    TIMEOUT,
    UNKNOWN_HOST_KEY,
    UNREACHABLE,
    CommandResult,
    LocalRunner,
    NodeError,
    fan_out,
    runner_for,
)
from launcher.remote.classify import classify_ssh_error
from launcher.remote.hostkeys import UnknownHostKeyError
from launcher.remote.ssh import SSHRunner
from launcher.spec.cluster import ClusterSpec, NodeSpec, SSHSpec
from launcher.spec.fit import gpus_needed
from launcher.spec.fit import spec_env as worker_env
from launcher.spec.job import JobSpec

pytestmark = pytest.mark.timeout(60)

LOCAL = NodeSpec(name="local", host="localhost")


@pytest.mark.processes
def test_a_run_on_this_machine_imports_no_ssh_library() -> None:
    """The command, the preflight, the agents and the trainer leave fabric and paramiko out:
    they slow every start, and only a node reached over SSH needs them."""
    code = (
        "import sys, launcher.cli, launcher.jobs.commands, launcher.orchestrate.run, "
        "launcher.orchestrate.agent, launcher.preflight, launcher.train.__main__\n"
        "print(sorted(m for m in ('fabric', 'invoke', 'paramiko') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_runner_for_picks_local_or_ssh() -> None:
    assert isinstance(runner_for(LOCAL, SSHSpec()), LocalRunner)
    assert isinstance(runner_for(NodeSpec(name="n", host="10.1.2.3"), SSHSpec()), SSHRunner)


@pytest.mark.processes
def test_local_runner_stdin_env_and_exit_code() -> None:
    runner = LocalRunner(LOCAL)
    result = runner.run(
        "cat; echo $GREETING; echo oops >&2; exit 5", stdin="from stdin\n", env={"GREETING": "hi"}
    )
    assert result == CommandResult("from stdin\nhi\n", "oops\n", 5)
    assert not result.ok and result.stderr_tail() == "oops"
    assert runner.run("cat | wc -c").stdout.strip() == "0"  # no stdin: empty, never the terminal
    # output that is not UTF-8 is replaced, not an error
    result = runner.run("printf 'caf\\351'; printf 'caf\\351' >&2", stdin="caf\u00e9")
    assert result == CommandResult("caf\ufffd", "caf\ufffd", 0)


@pytest.mark.processes
def test_local_runner_timeout_kills_the_whole_group() -> None:
    runner = LocalRunner(LOCAL)
    started = time.monotonic()
    with pytest.raises(NodeError) as info:
        runner.run("sleep 30 & sleep 30", timeout=0.5)
    assert info.value.kind == TIMEOUT
    assert time.monotonic() - started < 10


@pytest.mark.processes
def test_every_node_runs_the_launchers_own_probe(monkeypatch) -> None:
    """The probe's source goes on stdin to ``python -`` of a local runner: no node runs a probe
    of its own, so the document needs no format version to be read right."""
    sent: dict[str, str | None] = {}

    class Recording(LocalRunner):
        def run(self, command, *, stdin=None, timeout=None, env=None):
            sent.update(command=command, stdin=stdin)
            return super().run(command, stdin=stdin, timeout=timeout, env=env)

    monkeypatch.setattr(launcher.preflight, "runner_for", lambda node, ssh: Recording(node))
    cluster = ClusterSpec.model_validate(
        {"nodes": [{"name": "local", "host": "localhost"}], "parity": {"packages": ["pytest"]}}
    )
    probe = probe_node(cluster.nodes[0], cluster, None, deep=False)
    assert sent["stdin"] == PROBE_SOURCE == Path(launcher.preflight.probe.__file__).read_text()
    assert shlex.split(sent["command"] or "")[1:] == ["-", "--packages", "pytest"]
    assert probe["node"] == "local" and "probe_version" not in probe
    assert probe["packages"]["pytest"] == pytest.__version__
    assert probe["deep"] is None and probe["python"]["executable"]


def test_fan_out_is_parallel_bounded_and_keeps_every_outcome_in_node_order() -> None:
    nodes = [NodeSpec(name=f"n{i}", host=f"10.0.0.{i + 1}") for i in range(8)]
    lock, running, peak = threading.Lock(), [0], [0]

    def work(node: NodeSpec) -> str:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05 * (8 - int(node.name[1:])))  # finish in reverse order
        with lock:
            running[0] -= 1
        if node.name in ("n1", "n4"):
            raise NodeError(UNREACHABLE, f"{node.name} is down")
        return node.name.upper()

    started = time.monotonic()
    group = fan_out(nodes, work, max_parallel=4)
    assert peak[0] == 4
    assert time.monotonic() - started < 0.05 * 36 / 2  # one after another: 1.8 s
    assert list(group) == [n.name for n in nodes]
    outcomes = [v.message if isinstance(v, NodeError) else v for v in group.values()]
    assert outcomes == ["N0", "n1 is down", "N2", "N3", "n4 is down", "N5", "N6", "N7"]


@pytest.mark.processes
def test_interrupted_fan_out_returns_at_once_and_kills_the_local_commands(tmp_path: Path) -> None:
    """Ctrl-C during a fan-out: raised at once, not after every node's command ended; the
    commands (each a process group) are killed and the threads end with them."""
    nodes = [NodeSpec(name=f"local{i}", host="localhost") for i in range(3)]

    def work(node: NodeSpec) -> CommandResult:
        with runner_for(node, SSHSpec()) as runner:
            return runner.run(f"sleep 6 & echo $! > {tmp_path}/{node.name}.pid; wait")

    def started() -> bool:
        return all((tmp_path / f"{n.name}.pid").is_file() for n in nodes)

    before = set(threading.enumerate())
    try:
        with sigint_when(started) as sent, pytest.raises(KeyboardInterrupt):
            fan_out(nodes, work)
        assert time.monotonic() - sent[0] < 1.5
        pids = [int((tmp_path / f"{n.name}.pid").read_text()) for n in nodes]
        wait_for(lambda: not set(pids) & set(processes()), timeout=2, what="the commands to die")
        wait_for(lambda: not set(threading.enumerate()) - before, timeout=2, what="threads to end")
    finally:
        for pid_file in tmp_path.glob("*.pid"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


@pytest.mark.processes
def test_an_interrupted_fan_out_never_holds_up_the_interpreters_exit() -> None:
    """Work that no runner can stop (here a sleep) keeps its thread busy: the process still
    exits right after the interrupt, as the threads are daemons."""
    script = (
        "import os, signal, threading, time\n"
        "from launcher.remote import fan_out\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # even if inherited ignored
        "from launcher.spec.cluster import NodeSpec\n"
        "threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
        "fan_out([NodeSpec(name=f'n{i}', host=f'10.0.0.{i + 1}') for i in range(3)], lambda n: time.sleep(20))\n"
    )
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert "KeyboardInterrupt" in proc.stderr and proc.returncode != 0
    assert time.monotonic() - started < 10


# -- error classification --------------------------------------------------------------------


@pytest.fixture
def ssh_runner(tmp_path: Path) -> SSHRunner:
    node = NodeSpec(name="node1", host="10.9.8.7", port=2222)
    ssh = SSHSpec(
        user="ubuntu",
        key=tmp_path / "id",
        known_hosts=tmp_path / "known_hosts",
        connect_timeout_s=3,
    )
    return SSHRunner(node, ssh)


KEY = paramiko.RSAKey.generate(1024)


@pytest.mark.parametrize(
    ("err", "kind", "fragments"),
    [
        (  # never accepted
            paramiko.BadHostKeyException("[10.9.8.7]:2222", KEY, KEY),
            HOST_KEY_MISMATCH,
            ["man-in-the-middle", "never accepted", "ssh-keygen -R '[10.9.8.7]:2222'"],
        ),
        (  # says how to add it
            UnknownHostKeyError("[10.9.8.7]:2222", KEY),
            UNKNOWN_HOST_KEY,
            [
                "ssh-keyscan -p 2222 10.9.8.7 >> {known_hosts}",
                "ssh.accept_unknown_host_keys: true",
                "does not exist",
            ],
        ),
        (
            paramiko.AuthenticationException("Authentication failed."),
            AUTH_FAILED,
            ["ubuntu@10.9.8.7:2222 did not accept key {key}"],
        ),
        (TimeoutError("timed out"), UNREACHABLE, ["no answer from 10.9.8.7:2222 within 3 s"]),
        (
            paramiko.ssh_exception.NoValidConnectionsError(
                {("10.9.8.7", 2222): ConnectionRefusedError(errno.ECONNREFUSED, "refused")}
            ),
            UNREACHABLE,
            ["refused the connection on port 2222"],
        ),
        (
            paramiko.ssh_exception.NoValidConnectionsError(
                {("10.9.8.7", 2222): OSError(errno.EHOSTUNREACH, "no route")}
            ),
            UNREACHABLE,
            ["no route to 10.9.8.7:2222"],
        ),
        (
            socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
            UNREACHABLE,
            ["cannot resolve host name"],
        ),
    ],
)
def test_connect_errors_say_what_to_do(ssh_runner: SSHRunner, err, kind, fragments) -> None:
    found = classify_ssh_error(err, ssh_runner)
    assert found.kind == kind
    for fragment in fragments:
        assert fragment.format(**dict(ssh_runner.ssh)) in found.message


def test_ssh_options_are_key_only(ssh_runner: SSHRunner) -> None:
    opts = ssh_runner.connect_kwargs(KEY)
    assert (opts["password"], opts["look_for_keys"], opts["allow_agent"]) == (None, False, False)
    assert opts["pkey"] is KEY and "key_filename" not in opts  # read by the runner (load_key)
    assert opts["banner_timeout"] == opts["auth_timeout"] == 3
    agent_runner = SSHRunner(NodeSpec(name="n", host="10.0.0.1"), SSHSpec())
    assert agent_runner.load_key() is None
    agent = agent_runner.connect_kwargs(agent_runner.load_key())
    assert not {"pkey", "key_filename"} & agent.keys()
    assert agent["look_for_keys"] and agent["allow_agent"]


@pytest.mark.filterwarnings("ignore:SSH DSA key")
@pytest.mark.skipif(hasattr(paramiko, "DSSKey"), reason="paramiko < 4.0 reads DSA keys (DSSKey)")
@pytest.mark.parametrize(
    ("form", "layout"), [("DSA", "TraditionalOpenSSL"), ("OPENSSH", "OpenSSH")]
)
def test_a_dsa_key_file_is_an_authentication_failure_that_says_which_keys_work(
    ssh_runner: SSHRunner, form: str, layout: str
) -> None:
    """paramiko >= 4.0 reads no DSA keys: ``PKey.from_path`` raises UnknownKeyType, no
    SSHException. Refused before any connection is made."""
    key = ssh_runner.ssh.key
    assert key is not None
    key.write_bytes(
        dsa.generate_private_key(key_size=1024).private_bytes(
            serialization.Encoding.PEM,
            getattr(serialization.PrivateFormat, layout),
            serialization.NoEncryption(),
        )
    )
    assert key.read_text().startswith(f"-----BEGIN {form} PRIVATE KEY-----")
    with pytest.raises(NodeError) as info:
        ssh_runner.run("echo hi", timeout=5)
    assert info.value.kind == AUTH_FAILED
    assert f"key file {key} holds a DSA key" in info.value.message
    assert "ed25519, RSA and ECDSA keys only" in info.value.message
    assert "set ssh.key to it" in info.value.message


# -- probe output --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("result", "kind"),
    [
        (CommandResult("", "sh: 1: /opt/venv/bin/python: not found", 127), INTERPRETER_MISSING),
        (
            CommandResult("", "bash: line 1: /opt/py: No such file or directory", 127),
            INTERPRETER_MISSING,
        ),
        (CommandResult("", "bash: /opt/py: Permission denied", 126), INTERPRETER_MISSING),
        (
            CommandResult("", "Traceback\n  File x\nModuleNotFoundError: No module named 'x'", 1),
            PROBE_CRASHED,
        ),
        (CommandResult("hello\n", "", 0), BAD_JSON),
        (CommandResult("{not json\n", "", 0), BAD_JSON),
    ],
)
def test_probe_output_failures(result: CommandResult, kind: str) -> None:
    with pytest.raises(NodeError) as info:
        parse_probe_output(result, "/opt/py")
    assert info.value.kind == kind
    if kind == PROBE_CRASHED:  # the message carries the stderr tail
        assert "exit 1: Traceback | File x | ModuleNotFoundError: No module" in info.value.message


def test_probe_output_tolerates_login_noise() -> None:
    doc = {"hostname": "n1", "time": 1.0}
    out = "Welcome to n1\n" + json.dumps(doc) + "\n"
    assert parse_probe_output(CommandResult(out, "", 0), "python3") == doc


# -- what the specs ask of each node ---------------------------------------------------------


def test_nodes_gpus_and_env_for_a_job() -> None:
    cluster = ClusterSpec(
        nodes=[
            NodeSpec(name="a", host="10.0.0.1", gpus=8, env={"NCCL_SOCKET_IFNAME": "ib0"}),
            NodeSpec(name="b", host="10.0.0.2"),
            NodeSpec(name="c", host="10.0.0.3"),
        ]
    )
    resources = {"nodes": 2, "nproc_per_node": 4, "device": "cuda"}
    job = JobSpec(name="j", resources=resources, launch={"env": {"NCCL_SOCKET_IFNAME": "eth0"}})
    assert [n.name for n in nodes_for_job(cluster, job)] == ["a", "b"]
    assert [n.name for n in nodes_for_job(cluster, None)] == ["a", "b", "c"]
    assert gpus_needed(cluster.nodes[0], job) == 8
    assert gpus_needed(cluster.nodes[1], job) == 4
    assert gpus_needed(cluster.nodes[1], None) == 0
    cpu_job = JobSpec(name="j", resources={"device": "cpu"}, precision={"dtype": "fp32"})
    assert gpus_needed(cluster.nodes[1], cpu_job) == 0
    assert worker_env(cluster.nodes[0], job)["NCCL_SOCKET_IFNAME"] == "ib0"
    assert worker_env(cluster.nodes[1], job)["NCCL_SOCKET_IFNAME"] == "eth0"
