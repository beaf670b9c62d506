"""Which Ray runs the node agents: embedded, attached, or bootstrapped over SSH."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher import signals
from launcher.errors import PreflightError
from launcher.orchestrate.code import CodePlan, stage
from launcher.remote import (
    CommandResult,
    NodeError,
    SrunRunner,
    parallel_map,
    runner_for,
    tunnel_needed,
)
from launcher.spec import ClusterSpec, NodeSpec
from launcher.util import accepts, first_line, make_private_dir

log = logging.getLogger(__name__)

TOKEN_FILE = "$HOME/.ray/launcher_auth_token"
# The private parent (0700, mktemp -d, per start; removed by the stop) of a bootstrapped node's
# Ray temp dir, as ``private_ray_temp`` makes one on this machine.
NODE_TEMP_PREFIX = "/tmp/launcher-ray-node-$(id -u)-"
NICENESS_ENV = "RAY_worker_niceness"
# =0: a dead agent's torchrun gets its death signal (SIGTERM) and stops its workers, and the
# agent's reaper gets its chance, instead of a SIGKILL from the raylet that orphans them.
KILL_CHILDREN_ENV = "RAY_kill_child_processes_on_worker_exit"
TOKEN_ENV = (
    f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={TOKEN_FILE} {NICENESS_ENV}=0 {KILL_CHILDREN_ENV}=0 "
)
ALREADY_RUNNING = "but is already running at"  # `ray start --head` where a GCS runs on that address
PORT_TAKEN_EXIT = 3
OTHER_RAY_EXIT = 4
JOIN_GRACE_S = 5.0  # interrupted while nodes join: how long their stopped joins get to finish
# Run on the head before its token file is written: exit 3 when something answers on the GCS port.
_PORT_TAKEN = (
    "import socket, sys\n"
    "s = socket.socket()\n"
    "s.settimeout(3)\n"
    f"sys.exit({PORT_TAKEN_EXIT} if s.connect_ex((sys.argv[1], int(sys.argv[2]))) == 0 else 0)\n"
)
# Run on every node before its token file is written, with this cluster's HEAD:PORT: exit 4,
# naming them on stderr, where raylets of another Ray run that `ray stop` would stop too.
_OTHER_RAY = (
    "import os, sys\n"
    "ours = {'--gcs-address=' + sys.argv[1], '--gcs_address=' + sys.argv[1]}\n"
    "me, found = os.getuid(), []\n"
    "for pid in sorted(filter(str.isdigit, os.listdir('/proc') if os.path.isdir('/proc') else [])):\n"
    "    try:\n"
    "        with open('/proc/' + pid + '/comm') as f:\n"
    "            if f.read().strip() != 'raylet':\n"
    "                continue\n"
    "        if me != 0 and os.stat('/proc/' + pid).st_uid != me:\n"
    "            continue\n"
    "        with open('/proc/' + pid + '/stat') as f:\n"
    "            if f.read().rpartition(')')[2].split()[:1] == ['Z']:\n"
    "                continue\n"
    "        with open('/proc/' + pid + '/cmdline', 'rb') as f:\n"
    "            argv = f.read().decode(errors='replace').split('\\0')\n"
    "    except OSError:\n"
    "        continue\n"
    "    if any(argv) and not ours & set(argv):\n"
    "        gcs = [a.split('=', 1)[1] for a in argv if a.startswith(('--gcs-address=', '--gcs_address='))]\n"
    "        found.append('raylet pid ' + pid + ' (GCS ' + (gcs[0] if gcs else 'unknown') + ')')\n"
    "if found:\n"
    "    print(', '.join(found), file=sys.stderr)\n"
    f"    sys.exit({OTHER_RAY_EXIT})\n"
)
# Run on a node before `ray stop`, with its address, the head's and the GCS port: SIGKILL to
# this user's `ray start` of this cluster there (one given up on would start Ray after the stop).
_KILL_START = (
    "import os, signal, sys\n"
    "ip, head, port, me = sys.argv[1], sys.argv[2], sys.argv[3], os.getuid()\n"
    "for pid in filter(str.isdigit, os.listdir('/proc') if os.path.isdir('/proc') else []):\n"
    "    try:\n"
    "        if os.stat('/proc/' + pid).st_uid != me:\n"
    "            continue\n"
    "        with open('/proc/' + pid + '/cmdline', 'rb') as f:\n"
    "            argv = f.read().decode(errors='replace').split('\\0')\n"
    "    except OSError:\n"
    "        continue\n"
    "    pairs = set(zip(argv, argv[1:]))\n"
    "    ours = ('--address', head + ':' + port) in pairs or (ip == head and ('--port', port) in pairs)\n"
    "    if ('ray.scripts.scripts', 'start') in pairs and ('--node-ip-address', ip) in pairs and ours:\n"
    "        try:\n"
    "            os.kill(int(pid), signal.SIGKILL)\n"
    "        except OSError:\n"
    "            pass\n"
)


@dataclass
class RaySession:
    """A connected Ray and what to undo at the end."""

    mode: str
    address: str
    node_ips: dict[str, str]
    _started_on: list[NodeSpec] = field(default_factory=list)
    _cluster: ClusterSpec | None = None
    _head_ip: str | None = None  # bootstrap: where the others join
    _token: str | None = field(default=None, repr=False)  # bootstrap: this cluster's auth token
    _tunnel: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # to Ray Client
    _steps: list[tuple[SrunRunner, subprocess.Popen, str]] = field(default_factory=list)
    _temp_dir: str | None = None  # embedded: Ray's private temp dir, removed at close
    _watchdog: Watchdog | None = None  # stops this Ray if the launcher is killed
    _closed: bool = False

    def _watch_nodes(self) -> None:
        """Tell the watchdog which nodes run this bootstrapped Ray now."""
        if self._watchdog is not None and self._cluster is not None:
            self._watchdog.update(
                {
                    "mode": "bootstrap",
                    "cluster": self._cluster.model_dump(mode="json"),
                    "nodes": [n.name for n in self._started_on],
                    "addresses": self.node_ips,
                }
            )

    def add_node(self, node: NodeSpec) -> None:
        """Bring ``node`` into this Ray (an elastic restart's spare): started over SSH when the
        session bootstrapped Ray, else it must already be a node of it. PreflightError if not."""
        if self.mode == "bootstrap":
            self.node_ips[node.name] = _resolve(node.net_address)
            self._start_ray(node)
            assert self._cluster is not None
            _wait_for_nodes([node], self.node_ips, self._cluster.ray.join_timeout_s)
            return
        ip = (
            _match(node, _alive_nodes())
            if self.mode == "attach"
            else next(iter(self.node_ips.values()))
        )
        if ip is None:
            raise PreflightError(
                f"node {node.name} ({node.host}) is not a node of the Ray cluster at "
                f"{self.address}; start Ray there to use it as a spare"
            )
        self.node_ips[node.name] = ip

    def _start_ray(self, node: NodeSpec, *, head: bool = False) -> None:
        """``ray start`` on a node over SSH, with this cluster's token in a 0600 file first.

        A node where another Ray runs is refused before anything is written (PreflightError):
        ``ray stop`` would stop that Ray too. The node joins ``_started_on`` (what ``close``
        stops) before its ``ray start``, which an interrupt may cut short."""
        assert self._cluster is not None and self._token is not None
        cluster, rc = self._cluster, self._cluster.ray
        ip = self.node_ips.get(node.name) or _resolve(node.net_address)
        python = shlex.quote(node.interpreter())
        # Another Ray there: exit 3 (the head's port) or 4, and its token file stays as it is.
        write = (
            f"{python} -c {shlex.quote(_OTHER_RAY)} {shlex.quote(f'{self._head_ip}:{rc.port}')} "
            f"&& umask 077 && mkdir -p $HOME/.ray && cat > {TOKEN_FILE} "
            f"&& mktemp -d {NODE_TEMP_PREFIX}XXXXXXXX"
        )
        if head:
            write = f"{python} -c {shlex.quote(_PORT_TAKEN)} {shlex.quote(ip)} {rc.port} && {write}"
        result = _on_node(
            cluster, node, write, stdin=self._token, timeout=cluster.ssh.connect_timeout_s + 20
        )
        if head and result.exit_code == PORT_TAKEN_EXIT:
            raise PreflightError(
                f"Ray's port {rc.port} on the head node {node.name!r} ({ip}) is in use: a Ray runs there "
                f"already (if the launcher started it for detached jobs, `launch down --yes` stops it; "
                f"else stop it with `ray stop` there, pick another ray.port, or attach to it with "
                f"ray.address in cluster.yaml). Nothing was started or stopped"
            )
        if result.exit_code == OTHER_RAY_EXIT:
            raise PreflightError(
                f"another Ray runs on node {node.name!r} ({node.host}): {result.stderr_tail() or 'a raylet'}. "
                f"Stopping this cluster's Ray there would stop it too (`ray stop` stops every Ray on a "
                f"node), so the launcher does not start Ray there: stop that Ray (`ray stop` there; "
                f"`launch down --yes` if the launcher started it for detached jobs), leave the node "
                f"out, or attach to that Ray with ray.address in cluster.yaml. Nothing was started or stopped"
            )
        temp_dir = result.stdout.strip().splitlines()[-1:] if result.ok else []
        if not temp_dir:
            raise PreflightError(
                f"cannot write Ray's token file and make its temp dir on node {node.name!r} "
                f"({node.host}): {result.stderr_tail() or f'exit code {result.exit_code}'}"
            )
        if head:
            args = ["start", "--head", "--port", str(rc.port)]
            args += ["--ray-client-server-port", str(rc.client_port)]
            args += [f"--include-dashboard={'true' if rc.dashboard else 'false'}"]
            args += ["--dashboard-host", "127.0.0.1", "--dashboard-port", str(rc.dashboard_port)]
        else:
            args = ["start", "--address", f"{self._head_ip}:{rc.port}"]
        self._started_on.append(node)  # before the start: an interrupt may cut it short anywhere
        args += ["--node-ip-address", ip, "--temp-dir", f"{temp_dir[0]}/{RAY_TEMP_NAME}"]
        args += ["--disable-usage-stats"]
        self._watch_nodes()
        try:
            if node.slurm_job is not None:
                self._ray_step(node, args, wait_for=(ip, rc.port) if head else None)
            else:
                _ray_cli(cluster, node, args)
        except PreflightError as err:
            if ALREADY_RUNNING in str(err):  # Ray ran there before; not ours to stop
                self._started_on.remove(node)
                self._watch_nodes()
            raise

    def _ray_step(
        self, node: NodeSpec, args: list[str], *, wait_for: tuple[str, int] | None
    ) -> None:
        """``ray start --block`` as a job step that lasts the session: a step's processes end
        with it, so Ray's daemons cannot outlive a ``ray start`` that returns. With
        ``wait_for``, until that address accepts connections (the head's GCS)."""
        assert self._cluster is not None
        runner = SrunRunner(node)
        fd, log_path = tempfile.mkstemp(prefix=f"launcher-ray-{node.name}-", suffix=".log")
        os.close(fd)
        proc = runner.spawn(_ray_command(node, [*args, "--block"]), log_path)
        self._steps.append((runner, proc, log_path))
        deadline = time.monotonic() + self._cluster.ray.join_timeout_s
        while wait_for is not None:
            if proc.poll() is not None:
                tail = Path(log_path).read_text(errors="replace").strip().splitlines()[-3:]
                raise PreflightError(
                    f"`ray start` on node {node.name!r} (Slurm job {node.slurm_job}) ended with "
                    f"exit code {proc.returncode}: {' | '.join(tail) or 'no output'}"
                )
            if accepts(wait_for[1], wait_for[0]):
                return
            if time.monotonic() > deadline:
                raise PreflightError(
                    f"Ray's head on {node.name!r} did not answer on {wait_for[0]}:{wait_for[1]} "
                    f"within ray.join_timeout_s = {self._cluster.ray.join_timeout_s:g} s"
                )
            time.sleep(0.5)

    def leave_running(self) -> None:
        """Disconnect and leave the Ray this session started running, for detached jobs: its
        watchdog stands down (else it stops Ray once this process exits), nothing is stopped."""
        if not self._disconnect():
            return
        if self._watchdog is not None:
            self._watchdog.stop()

    def _disconnect(self) -> bool:
        """Leave Ray and close the tunnel to it, once; False where that was done already."""
        if self._closed:
            return False
        self._closed = True
        _shutdown()
        with contextlib.suppress(Exception):
            self._tunnel.close()
        return True

    def close(self, *, keep_ray: bool = False) -> None:
        """Disconnect; stop the Ray this session started (embedded, or bootstrapped unless keep_ray)."""
        if not self._disconnect():
            return
        os.environ.pop("RAY_AUTH_TOKEN", None)
        if self._temp_dir:
            remove_ray_temp(self._temp_dir)
        if self._watchdog is not None and keep_ray:
            self._watchdog.stop()  # Ray stays up on purpose
        if self._started_on and not keep_ray and self._cluster is not None:
            # the head first (it starts first, the others only once it runs), as stop_ray needs,
            # with the addresses their `ray start` was given
            if left := stop_ray(self._cluster, self._started_on, self.node_ips):
                log.warning(
                    "Ray may still run on %s (not reached); stop it with `ray stop` there",
                    ", ".join(left),
                )
        elif self._started_on:
            log.warning(
                "Ray left running on %s (--keep-ray); stop it with `ray stop` there",
                ", ".join(n.name for n in self._started_on),
            )
        for runner, proc, log_path in self._steps:  # Slurm: the steps that held Ray
            runner.stop(proc)
            with contextlib.suppress(OSError):
                os.unlink(log_path)
        self._steps.clear()
        if self._watchdog is not None:
            self._watchdog.stop()


def open_session(
    cluster: ClusterSpec, nodes: list[NodeSpec], code: CodePlan | None = None
) -> RaySession:
    """Connect to (or start) the Ray that hosts one agent per node, shipping ``code``'s
    snapshot where it travels. SIGINT or SIGTERM during start-up stop what was started."""
    check_ray_version()
    snapshot = stage(code) if code is not None and code.travels else None
    runtime_env: dict[str, Any] = {"working_dir": str(snapshot)} if snapshot else {}
    if snapshot:
        # The excludes are applied already: Ray must not drop files a .gitignore lists.
        os.environ["RAY_RUNTIME_ENV_IGNORE_GITIGNORE"] = "1"
    session: RaySession | None = None
    try:
        with _signals_kept():
            session = _open(cluster, nodes, runtime_env)
        return session
    except KeyboardInterrupt:
        # A signal Python dropped while Ray forked, raised again once the session was made: the
        # session is not returned, so stop what it started (a bootstrapped Ray on every node).
        if session is not None:
            session.close()
        raise
    finally:
        if snapshot:  # uploaded by ray.init, or nothing was started
            shutil.rmtree(snapshot, ignore_errors=True)


def _open(cluster: ClusterSpec, nodes: list[NodeSpec], runtime_env: dict[str, Any]) -> RaySession:
    address = cluster.ray.address
    if address is not None:
        return _attach(nodes, address, runtime_env)
    if all(n.is_local for n in nodes):
        return _embedded(cluster, nodes, runtime_env)
    return _bootstrap(cluster, nodes, runtime_env)


@contextlib.contextmanager
def _signals_kept():  # noqa: ANN202 - a context manager
    """``ray.init()`` replaces the SIGTERM handler with one that calls ``sys.exit(15)``: SIGTERM
    would then skip the interrupted path (summary, exit 130). Keep ours, also mid-init
    (``keep_handlers``; where ours are not installed, put back whatever was there after)."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with signals.keep_handlers():
            yield
        signals.check()  # a signal whose exception Python dropped while Ray forked
    except SystemExit as exit_:
        if exit_.code != signal.SIGTERM:
            raise
        _shutdown()
        raise KeyboardInterrupt("SIGTERM while Ray was starting") from None
    except KeyboardInterrupt:
        _shutdown()  # a half-started Ray of ours: stop it now, not at interpreter exit
        raise
    finally:
        if previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


class Watchdog:
    """``watchdog.py`` beside this process: stops the Ray of the last ``update``'s record should
    the launcher be killed; ``stop`` ends the watchdog (the session closed)."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.orchestrate.watchdog", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",  # `-m` puts the current folder on sys.path: one no one else may write
            start_new_session=True,  # Ctrl-C to the terminal's process group is not for it
        )

    def update(self, record: dict[str, Any]) -> None:
        assert self._proc.stdin is not None
        with contextlib.suppress(OSError):
            self._proc.stdin.write(json.dumps(record).encode() + b"\n")
            self._proc.stdin.flush()

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)
        with contextlib.suppress(OSError):
            assert self._proc.stdin is not None
            self._proc.stdin.close()


RAY_FLOOR = (2, 52)  # token authentication (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH)


def check_ray_version() -> None:
    """PreflightError (exit 3) where the Ray installed here predates ``RAY_FLOOR``: an older
    Ray ignores ``RAY_AUTH_MODE=token`` and would serve its ports and Jobs API to anyone."""
    try:
        version = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        return  # the import that follows says it is missing
    if tuple(int(p) for p in re.findall(r"\d+", version)[:2]) < RAY_FLOOR:
        floor = ".".join(map(str, RAY_FLOOR))
        raise PreflightError(
            f"Ray {version} is installed here, but the launcher needs Ray {floor} or later: it "
            f"relies on Ray's token authentication, which older versions ignore. Upgrade it: "
            f"pip install 'ray[client,default]>={floor}'"
        )


RAY_TEMP_NAME = "ray"  # Ray's temp dir, inside a private parent of its own


def private_ray_temp() -> str:
    """A new temp dir for a Ray this launcher starts here: ``ray`` in a new private (0700)
    parent, as Ray makes its own world-writable; short, for Ray's Unix socket paths."""
    parent = make_private_dir(f"launcher-ray-{os.getuid()}-")
    return str(parent / RAY_TEMP_NAME)


def remove_ray_temp(temp_dir: str) -> None:
    """Remove a ``private_ray_temp`` with its parent (any other folder: itself only)."""
    path = Path(temp_dir)
    if path.name == RAY_TEMP_NAME and path.parent.name.startswith("launcher-ray-"):
        path = path.parent
    shutil.rmtree(path, ignore_errors=True)


def _shutdown() -> None:
    import ray

    with contextlib.suppress(Exception):
        ray.shutdown()


# -- modes ----------------------------------------------------------------------------------


def _embedded(
    cluster: ClusterSpec, nodes: list[NodeSpec], runtime_env: dict[str, Any]
) -> RaySession:
    import ray

    log.info("Starting an embedded Ray on this machine")
    # address="local": always a new private instance, never a Ray someone else runs here.
    # Ray runs its workers at niceness 15 unless told otherwise; training must not be niced.
    os.environ.setdefault(NICENESS_ENV, "0")
    os.environ.setdefault(KILL_CHILDREN_ENV, "0")
    temp_dir = private_ray_temp()
    watchdog = Watchdog()
    watchdog.update({"mode": "embedded", "temp_dir": temp_dir})
    try:
        with signals.ctrl_c_spared():  # a terminal's Ctrl-C: the ranks', not Ray's
            ray.init(
                address="local",
                include_dashboard=cluster.ray.dashboard,
                dashboard_host="127.0.0.1",
                log_to_driver=False,
                configure_logging=False,
                runtime_env=runtime_env or None,
                _temp_dir=temp_dir,
            )
    except BaseException as err:  # Ray raises RuntimeError, ConnectionError, TimeoutError, ...
        _shutdown()
        remove_ray_temp(temp_dir)
        watchdog.stop()
        if not isinstance(err, Exception):
            raise
        raise PreflightError(
            f"could not start the embedded Ray on this machine: {first_line(err)}. Check free "
            f"memory and /tmp space; `--debug` shows Ray's traceback"
        ) from err
    ip = _alive_nodes()[0]["NodeManagerAddress"]
    return RaySession(
        mode="embedded",
        address="local",
        node_ips={n.name: ip for n in nodes},
        _temp_dir=temp_dir,
        _watchdog=watchdog,
    )


def _attach(nodes: list[NodeSpec], address: str, runtime_env: dict[str, Any]) -> RaySession:
    # Ray sends ~/.ray/auth_token only in token mode; a cluster without authentication ignores it.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    log.info("Attaching to the running Ray at %s", address)
    try:
        retry = _server_side if address.startswith("ray://") else lambda err: False
        _connect(address, runtime_env, retry=retry, configure_logging=False)
    except Exception as err:  # Ray raises ConnectionError, RuntimeError, ...
        raise PreflightError(
            f"cannot attach to Ray at {address!r}: {_client_error(err)}. Check that the cluster "
            f"is running there (`ray status`); from outside the cluster use ray://HEAD:10001"
        ) from err
    alive = _alive_nodes()
    found = {node.name: _match(node, alive) for node in nodes}
    missing = [f"{n.name} ({n.host})" for n in nodes if found[n.name] is None]
    if missing:
        _shutdown()
        known = ", ".join(sorted(n["NodeManagerAddress"] for n in alive))
        raise PreflightError(
            f"the Ray cluster at {address!r} has no node for {', '.join(missing)} (its nodes: "
            f"{known}); start Ray there or fix the hosts in cluster.yaml"
        )
    ips = {name: ip for name, ip in found.items() if ip is not None}
    return RaySession(mode="attach", address=address, node_ips=ips)


def _bootstrap(
    cluster: ClusterSpec, nodes: list[NodeSpec], runtime_env: dict[str, Any]
) -> RaySession:
    head = nodes[0]
    ips = {n.name: _resolve(n.net_address) for n in nodes}
    rc = cluster.ray
    token = secrets.token_hex(32)
    session = RaySession(
        mode="bootstrap",
        address=f"ray://{ips[head.name]}:{rc.client_port}",
        node_ips=ips,
        _cluster=cluster,
        _head_ip=ips[head.name],
        _token=token,
        _watchdog=Watchdog(),
    )
    try:
        log.info("Starting Ray head on %s (%s)", head.name, head.host)
        session._start_ray(head, head=True)
        others = nodes[1:]
        if others:
            log.info(
                "Joining %d node(s) to Ray: %s", len(others), ", ".join(n.name for n in others)
            )
            # Interrupted: joins under way get JOIN_GRACE_S; close() below stops the rest.
            outcomes = parallel_map(
                session._start_ray, others, cluster.ssh.max_parallel, grace_s=JOIN_GRACE_S
            )
            bad = [e for e in outcomes if isinstance(e, BaseException)]
            if bad:
                raise bad[0]
        if tunnel_needed(head, cluster.ssh):  # behind a login node: Ray Client over SSH
            from launcher.remote.ssh import SSHRunner

            runner = SSHRunner(head, cluster.ssh)
            session._tunnel.enter_context(runner)
            try:
                port = session._tunnel.enter_context(runner.forward(ips[head.name], rc.client_port))
            except NodeError as err:
                raise PreflightError(
                    f"cannot open an SSH tunnel to Ray Client on {head.name}: {err}"
                ) from err
            session.address = f"ray://127.0.0.1:{port}"
        # Ray reads these when it is imported: set them first, in this process only.
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN"] = token
        try:
            _connect(session.address, runtime_env)
        except Exception as err:
            raise PreflightError(
                f"Ray started on the nodes but the launcher cannot reach it at {session.address}: "
                f"{_client_error(err)}. The launcher drives a bootstrapped cluster through Ray Client: "
                f"port {rc.client_port} on {head.host} must be reachable from this machine"
            ) from err
        _wait_for_nodes(nodes, ips, rc.join_timeout_s)
        return session
    except BaseException:
        session.close()
        raise


# -- helpers --------------------------------------------------------------------------------


def _connect(
    address: str,
    runtime_env: dict[str, Any],
    attempts: int = 3,
    retry: Callable[[Exception], bool] = lambda err: True,
    **init: Any,
) -> None:
    """``ray.init`` at ``address``, retried where ``retry`` says: a head's Ray Client server starts
    a server process per connection, which can die or miss Ray's 30 s channel timeout while the
    head is starting or loaded."""
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(address=address, log_to_driver=False, runtime_env=runtime_env or None, **init)
            return
        except Exception as err:
            if attempt == attempts or not retry(err):
                raise
            log.warning(
                "Ray Client connect to %s failed (%s); retrying", address, _client_error(err)
            )
            _shutdown()
            time.sleep(CLIENT_RETRY_WAIT_S * attempt)


CLIENT_RETRY_WAIT_S = 2.0
SERVER_INIT_FAILED = "Initialization failure from server:"


def _server_side(err: Exception) -> bool:
    """The head's client server was reached, but the server process for this connection failed
    to start (not a runtime environment that cannot be built): worth another connection."""
    return (
        isinstance(err, ConnectionAbortedError)
        and str(err).startswith(SERVER_INIT_FAILED)
        and "Failed to create runtime_env" not in str(err)
    )


def _client_error(err: BaseException) -> str:
    """One line for a Ray Client error: a failure on the server comes as a traceback whose last
    line says what failed."""
    text = str(err)
    if text.startswith(SERVER_INIT_FAILED):
        lines = [line.strip() for line in text.splitlines()[1:] if line.strip()]
        return f"{SERVER_INIT_FAILED} {lines[-1]}" if lines else SERVER_INIT_FAILED
    return first_line(err)


def _on_node(
    cluster: ClusterSpec, node: NodeSpec, command: str, *, stdin: str | None = None, timeout: float
) -> CommandResult:
    """``command`` on ``node`` over a connection closed afterwards. A node that cannot be
    reached, or a command that outlives ``timeout``, is a PreflightError that names the node
    (a spare that fails this way is passed over; a node of the first attempt stops the launch)."""
    try:
        with runner_for(node, cluster.ssh) as runner:
            return runner.run(command, stdin=stdin, timeout=timeout)
    except NodeError as err:
        raise PreflightError(
            f"cannot run Ray's commands on node {node.name!r} ({node.host}): {err}"
        ) from err


def _ray_command(node: NodeSpec, args: list[str]) -> str:
    return f"{TOKEN_ENV}{shlex.quote(node.interpreter())} -m ray.scripts.scripts {shlex.join(args)}"


def _ray_cli(cluster: ClusterSpec, node: NodeSpec, args: list[str]) -> None:
    command = _ray_command(node, args)
    result = _on_node(cluster, node, command, timeout=cluster.ssh.connect_timeout_s + 90)
    if result.exit_code != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise PreflightError(
            f"`ray {args[0]}` failed on node {node.name!r} ({node.host}) with exit code "
            f"{result.exit_code}: {' | '.join(tail) or 'no output'}. If Ray already runs there, "
            f"stop it (`ray stop`) or attach to it with ray.address in cluster.yaml"
        )


def stop_ray(
    cluster: ClusterSpec, nodes: list[NodeSpec], addresses: Mapping[str, str]
) -> list[str]:
    """On every node in parallel: kill a ``ray start`` of this cluster still running
    (``_KILL_START``), ``ray stop --force``, remove the token file and Ray's temp dirs.
    ``nodes[0]`` is the head; ``addresses`` gives each node's ``ray start`` address (else its
    host is resolved now). Returns the nodes where that failed: Ray may still run there."""

    def address(node: NodeSpec) -> str:
        return addresses.get(node.name) or _resolve(node.net_address)

    head = shlex.quote(address(nodes[0])) if nodes else ""

    def stop(node: NodeSpec) -> str | None:
        python = shlex.quote(node.interpreter())
        kill = (
            f"{python} -c {shlex.quote(_KILL_START)} {shlex.quote(address(node))} {head} "
            f"{cluster.ray.port}"
        )
        try:
            result = _on_node(
                cluster,
                node,
                f"{kill}; {python} -m ray.scripts.scripts stop --force; rc=$?; "
                f"rm -f {TOKEN_FILE}; rm -rf {NODE_TEMP_PREFIX}*; exit $rc",
                timeout=cluster.ssh.connect_timeout_s + 60,
            )
        except Exception as err:  # noqa: BLE001 - every node gets its try; the caller names the failed
            log.warning("could not stop Ray on %s (%s): %s", node.name, node.host, first_line(err))
            return node.name
        if not result.ok:
            why = result.stderr_tail() or f"exit code {result.exit_code}"
            log.warning("`ray stop` failed on %s (%s): %s", node.name, node.host, why)
            return node.name
        return None

    log.info("Stopping Ray on %s", ", ".join(n.name for n in nodes))
    outcomes = parallel_map(stop, nodes, cluster.ssh.max_parallel)
    return [
        node.name if isinstance(outcome, BaseException) else outcome
        for node, outcome in zip(nodes, outcomes, strict=True)
        if outcome is not None
    ]


def _wait_for_nodes(nodes: list[NodeSpec], ips: dict[str, str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = {n["NodeManagerAddress"] for n in _alive_nodes()}
        missing = [n for n in nodes if ips[n.name] not in alive]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise PreflightError(
                f"nodes did not join the Ray cluster within {timeout_s:.0f} s: "
                f"{', '.join(f'{n.name} ({n.host})' for n in missing)}; check that they reach "
                f"the head's port and raise ray.join_timeout_s if they are slow"
            )
        time.sleep(0.5)


def _alive_nodes() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def _match(node: NodeSpec, alive: list[dict]) -> str | None:
    if node.is_local and len(alive) == 1:
        return alive[0]["NodeManagerAddress"]
    wanted = {node.host, node.net_address, _resolve(node.net_address)}
    if node.is_local:
        wanted |= {socket.gethostname(), _resolve(socket.gethostname())}
    for entry in alive:
        if entry["NodeManagerAddress"] in wanted or entry.get("NodeManagerHostname") in wanted:
            return entry["NodeManagerAddress"]
    return None


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host
