"""Bootstrapping Ray on several nodes: Ctrl-C while the workers join, nodes where another Ray
runs, the teardown. The nodes are this machine behind an SSH-like runner, with a stand-in
``ray`` that records what it was asked: the launcher's real commands run, no Ray starts."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from fixtures.launching import processes, sigint_when, wait_for

from launcher.errors import PreflightError
from launcher.jobs import records
from launcher.orchestrate import ray_cluster
from launcher.remote import INTERNAL, TIMEOUT, CommandResult, NodeError, Runner, remote_command
from launcher.spec import ClusterSpec
from launcher.util import free_port

pytestmark = [pytest.mark.processes, pytest.mark.timeout(90)]

HOSTS = [f"198.18.250.{10 + i}" for i in range(3)]
ADDRESSES = {host: f"127.0.0.{1 + i}" for i, host in enumerate(HOSTS)}  # as the launcher resolves
STARTED_WITH = {"node0": ADDRESSES[HOSTS[0]], "node1": ADDRESSES[HOSTS[1]]}  # 127.0.0.1, 127.0.0.2

# The stand-in for `python -m ray.scripts.scripts`: `start` records itself (a worker's then
# hangs, as a join to an unresponsive head does); `stop` records which of this node's starts of
# this cluster (FAKE_PORT) were still running when it ran.
FAKE_SCRIPTS = textwrap.dedent("""\
    import json, os, sys, time

    LOG = os.environ["FAKE_RAY_LOG"]

    def record(**fields):
        with open(LOG, "a") as f:
            f.write(json.dumps(fields) + "\\n")

    def running(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(") ", 1)[1][0] != "Z"
        except OSError:
            return False

    args = sys.argv[1:]
    if args[0] == "start":
        port = args[args.index("--port") + 1] if "--head" in args else args[args.index("--address") + 1].rpartition(":")[2]
        ip = args[args.index("--node-ip-address") + 1]
        record(cmd="start", ip=ip, port=port, pid=os.getpid())
        if "--head" not in args:
            time.sleep(80)
        record(cmd="started", ip=ip, port=port)
    elif args[0] == "stop":
        ip, port = os.environ["FAKE_NODE_IP"], os.environ["FAKE_PORT"]
        with open(LOG) as f:
            starts = [e for e in map(json.loads, f) if e["cmd"] == "start" and e["ip"] == ip and e["port"] == port]
        record(cmd="stop", ip=ip, running=[e["pid"] for e in starts if running(e["pid"])])
""")


class DetachedRunner(Runner):
    """Runs commands here as an SSH runner runs them on a node (``remote_command``, under
    ``sh -c`` as sshd does): closing it ends the wait with NodeError but stops nothing."""

    procs: list[subprocess.Popen[str]] = []

    def __init__(self, node, ssh=None):
        super().__init__(node)

    def run(self, command, *, stdin=None, timeout=None, env=None) -> CommandResult:
        if self._closed:
            raise NodeError(INTERNAL, "the runner is closed")
        proc = subprocess.Popen(
            ["/bin/sh", "-c", remote_command(command, timeout)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, "FAKE_NODE_IP": ray_cluster._resolve(self.node.host)},
        )
        self.procs.append(proc)
        pipe, proc.stdin = proc.stdin, None  # stdin written then closed: EOF
        with contextlib.suppress(BrokenPipeError):
            pipe.write(stdin or "")  # type: ignore[union-attr]
        with contextlib.suppress(BrokenPipeError):
            pipe.close()  # type: ignore[union-attr]
        deadline = None if timeout is None else time.monotonic() + timeout
        while proc.poll() is None:
            if self._closed:
                raise NodeError(INTERNAL, "the command was stopped: the runner was closed")
            if deadline is not None and time.monotonic() > deadline:
                raise NodeError(TIMEOUT, "the command did not finish in time")
            time.sleep(0.02)
        out, err = proc.communicate()
        return CommandResult(out, err, proc.returncode)

    def describe(self) -> str:
        return self.node.name

    def close(self) -> None:
        self._closed = True


@pytest.fixture
def fake_ray(tmp_path, monkeypatch):
    """The stand-in ``ray`` on the nodes' PYTHONPATH, HOME (token files) in tmp_path, the nodes'
    runners DetachedRunners; yields the log reader. Whatever it started is killed afterwards."""
    scripts = tmp_path / "fakeray/ray/scripts"
    scripts.mkdir(parents=True)
    (tmp_path / "fakeray/ray/__init__.py").write_text("")
    (scripts / "__init__.py").write_text("")
    (scripts / "scripts.py").write_text(FAKE_SCRIPTS)
    log = tmp_path / "ray.log"
    log.touch()
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fakeray"))
    monkeypatch.setenv("FAKE_RAY_LOG", str(log))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(ray_cluster, "runner_for", DetachedRunner)
    monkeypatch.setattr(ray_cluster, "_resolve", ADDRESSES.get)

    def entries() -> list[dict]:
        return [json.loads(line) for line in log.read_text().splitlines()]

    try:
        yield entries
    finally:
        for proc in DetachedRunner.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for entry in entries():  # under `timeout`, which puts itself in a group of its own
            if entry["cmd"] == "start" and entry["pid"] in processes():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(entry["pid"], signal.SIGKILL)
        DetachedRunner.procs.clear()


SPAWNED: list[subprocess.Popen[bytes]] = []  # killed after each test (reap)


@pytest.fixture(autouse=True)
def reap():
    yield
    for proc in SPAWNED:
        proc.kill()
        proc.wait()
    SPAWNED.clear()


def start(*args: str) -> subprocess.Popen[bytes]:
    """A process whose arguments are those of a `ray start` (it only sleeps)."""
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    argv = [*sleep, "ray.scripts.scripts", "start", *args]
    SPAWNED.append(subprocess.Popen(argv, start_new_session=True))
    return SPAWNED[-1]


def nodes(port: int, n: int = 2) -> ClusterSpec:
    """The first ``n`` of HOSTS as a cluster whose Ray uses ``port``."""
    python = sys.executable
    nodes = [{"name": f"node{i}", "host": h, "python": python} for i, h in enumerate(HOSTS[:n])]
    return ClusterSpec.model_validate(
        {"nodes": nodes, "ray": {"port": port}, "ssh": {"connect_timeout_s": 5}}
    )


def bootstrapped(cluster: ClusterSpec, port: int, **more: Any) -> ray_cluster.RaySession:
    """A bootstrap session of ``cluster``'s first two nodes, as started at STARTED_WITH."""
    return ray_cluster.RaySession(
        mode="bootstrap",
        address=f"ray://127.0.0.1:{port}",
        node_ips=dict(STARTED_WITH),
        _cluster=cluster,
        _head_ip="127.0.0.1",
        _token="t" * 64,
        **more,
    )


def test_ctrl_c_while_nodes_join_kills_their_ray_start_before_ray_stop(
    fake_ray, tmp_path, monkeypatch
):
    """Ctrl-C while the workers join: their runners are closed but their `ray start` runs on (as
    over SSH). Each node whose start was issued gets its start killed, then `ray stop`; a start
    of another cluster (another port) on a node is left alone."""
    port = free_port()
    monkeypatch.setenv("FAKE_PORT", str(port))
    # tested below; a real Ray here must not matter
    monkeypatch.setattr(ray_cluster, "_OTHER_RAY", "pass")
    cluster = nodes(port, 3)
    other = start("--address", f"127.0.0.1:{port + 1}", "--node-ip-address", "127.0.0.2")

    def starts() -> list[dict]:
        return [e for e in fake_ray() if e["cmd"] == "start" and e["port"] == str(port)]

    def joining() -> bool:
        return {e["ip"] for e in starts()} >= {"127.0.0.2", "127.0.0.3"}

    with sigint_when(joining), pytest.raises(KeyboardInterrupt):
        ray_cluster._bootstrap(cluster, list(cluster.nodes), {})

    log = fake_ray()
    started = {e["ip"] for e in starts()}
    assert started == {"127.0.0.1", "127.0.0.2", "127.0.0.3"}, log
    stops = {e["ip"]: e["running"] for e in log if e["cmd"] == "stop"}
    assert stops == {ip: [] for ip in started}, f"a `ray start` ran when Ray was stopped: {log}"
    time.sleep(0.3)
    assert not [e for e in starts() if e["pid"] in processes()]
    assert other.poll() is None, "another cluster's `ray start` was killed"


def fake_raylet(tmp_path: Path, gcs: str) -> subprocess.Popen[bytes]:
    """A process named raylet (as `ray stop` finds them) of the Ray whose GCS is ``gcs``."""
    folder = tmp_path / gcs.replace(":", "_")
    folder.mkdir()
    script = folder / "raylet"
    script.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    script.chmod(0o755)
    proc = subprocess.Popen([str(script), "--node_ip_address=127.0.0.2", f"--gcs-address={gcs}"])
    SPAWNED.append(proc)
    comm = Path(f"/proc/{proc.pid}/comm")
    wait_for(lambda: comm.read_text().strip() == "raylet", timeout=10, what="the raylet", poll=0.02)
    return proc


def test_a_node_where_another_ray_runs_is_refused_and_that_ray_left_alone(
    fake_ray, tmp_path, monkeypatch
):
    """A worker's `ray start` finds no Ray running as the head's does: it would start a second
    Ray there, and the teardown's `ray stop` would then stop both. The node is refused first."""
    port = free_port()
    cluster = nodes(port)
    started: list[str] = []
    stopped: list[str] = []
    monkeypatch.setattr(
        ray_cluster, "_ray_cli", lambda cluster, node, args: started.append(node.name)
    )
    monkeypatch.setattr(
        ray_cluster,
        "stop_ray",
        lambda cluster, nodes, addresses=None: stopped.extend(n.name for n in nodes),
    )
    session = bootstrapped(cluster, port)
    other = fake_raylet(tmp_path, f"127.0.0.9:{port}")
    pattern = rf"another Ray runs on node 'node1' .*raylet pid {other.pid} \(GCS 127.0.0.9:{port}\)"
    with pytest.raises(PreflightError, match=pattern):
        session._start_ray(cluster.nodes[1])
    session.close()
    assert started == [] and stopped == []
    # that Ray's token file untouched
    assert not (tmp_path / "home/.ray/launcher_auth_token").exists()
    assert other.poll() is None


def other_ray_check() -> subprocess.CompletedProcess[str]:
    """The bootstrap's check for another Ray on a node, for a cluster whose GCS is 127.0.0.1:7001."""
    args = [sys.executable, "-c", ray_cluster._OTHER_RAY, "127.0.0.1:7001"]
    return subprocess.run(args, capture_output=True, text=True, timeout=30)


def test_the_other_ray_check_names_raylets_of_other_clusters_only(tmp_path):
    """On a node that shares its processes with others (several nodes on one machine), this
    cluster's own raylets are not another Ray."""
    ours, theirs = fake_raylet(tmp_path, "127.0.0.1:7001"), fake_raylet(tmp_path, "127.0.0.5:7001")
    result = other_ray_check()
    assert result.returncode == ray_cluster.OTHER_RAY_EXIT, result
    assert f"raylet pid {theirs.pid} (GCS 127.0.0.5:7001)" in result.stderr
    assert f"raylet pid {ours.pid} " not in result.stderr


def test_the_other_ray_check_passes_over_a_zombie_raylet(tmp_path):
    """A raylet that has exited but is not yet reaped (state Z, its command line empty) is no
    Ray: a node with one is not refused on every bootstrap."""
    script = tmp_path / "raylet"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    zombie = subprocess.Popen([str(script), "--gcs-address=127.0.0.9:7001"])  # a zombie, unwaited
    try:
        stat = Path(f"/proc/{zombie.pid}/stat")
        what = f"{zombie.pid} (raylet) Z"  # exited, not reaped
        wait_for(lambda: stat.read_text().startswith(what), timeout=10, what=what, poll=0.02)
        assert Path(f"/proc/{zombie.pid}/cmdline").read_bytes() == b""
        result = other_ray_check()
        assert f"raylet pid {zombie.pid} " not in result.stderr, result
        # a real Ray here may run
        assert result.returncode in (0, ray_cluster.OTHER_RAY_EXIT), result
    finally:
        zombie.wait()


# What the nodes' names resolve to at teardown, unlike at start: other addresses (round-robin
# DNS, an edited /etc/hosts), or the name itself (the lookup failed; _resolve falls back to it).
RESOLVED_LATER = {
    "other addresses": {h: f"127.0.0.{7 + i}" for i, h in enumerate(HOSTS)}.get,
    "a failed lookup": lambda host: host,
}


@pytest.mark.parametrize("later", RESOLVED_LATER)
@pytest.mark.parametrize("by", ["session", "record"])
def test_the_teardown_kills_this_clusters_ray_start_only_whatever_the_names_resolve_to(
    fake_ray, tmp_path, monkeypatch, later, by
):
    """A `ray start` left running on a node is killed before `ray stop` when it is this
    cluster's: a join to this head's address, or the head's own start on the head. A join to
    another head on the same port, and another Ray's head on a worker, are left alone. The
    session's close gives the teardown the addresses its `ray start`s were given; `launch down`
    (another process, later) gets them from the cluster's record. Either way a name that
    resolves otherwise at teardown (or not at all) still finds them."""
    monkeypatch.setenv(records.STATE_ENV, str(tmp_path / "state"))
    port = free_port()
    monkeypatch.setenv("FAKE_PORT", str(port))
    cluster = nodes(port)
    records.save_cluster(cluster, STARTED_WITH)
    assert records.saved_addresses(cluster) == STARTED_WITH
    session = bootstrapped(cluster, port, _started_on=list(cluster.nodes))
    ours = {  # as the bootstrap issued them: the head's, and a join to it that hangs
        "join": start("--address", f"127.0.0.1:{port}", "--node-ip-address", "127.0.0.2"),
        "head": start("--head", "--port", str(port), "--node-ip-address", "127.0.0.1"),
    }
    theirs = [
        start("--address", f"127.0.0.9:{port}", "--node-ip-address", "127.0.0.2"),
        start("--address", f"127.0.0.1:{port + 1}", "--node-ip-address", "127.0.0.2"),
        start("--head", "--port", str(port), "--node-ip-address", "127.0.0.2"),
    ]
    monkeypatch.setattr(ray_cluster, "_resolve", RESOLVED_LATER[later])
    if by == "session":
        session.close()
    else:  # as `launch down` calls it
        addresses = records.saved_addresses(cluster)
        assert ray_cluster.stop_ray(cluster, list(cluster.nodes), addresses) == []
    for name, proc in ours.items():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        assert proc.returncode == -signal.SIGKILL, f"this cluster's {name} was not killed"
    assert [p.poll() for p in theirs] == [None] * 3, "another Ray's start was killed"
