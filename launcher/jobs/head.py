"""The Ray that the launcher starts for detached jobs, and the private files that find it again.

State lives in ``$LAUNCHER_STATE_DIR`` (default ``$XDG_STATE_HOME/launcher``, else
``~/.local/state/launcher``), a 0700 folder:

- ``local/``: this machine's head. ``head.json`` (the pid of ``ray start --head --block``,
  its ports and temp dir), ``auth_token`` (0600; Ray reads it through ``RAY_AUTH_TOKEN_PATH``,
  it is never on a command line), ``head.log`` (Ray's start-up output). The head runs in a
  session of its own, so it outlives the ``launch submit`` that started it; every later
  command finds it through ``head.json``, and ``launch down`` stops exactly it.
- ``clusters/<head host>-<gcs port>.json``: a cluster bootstrapped over SSH that stays up for
  its jobs: its resolved cluster spec, so ``launch down`` stops Ray on exactly those nodes, and
  under ``ray_start_addresses`` the address each node's ``ray start`` was given (the head's is
  the one the others joined), so ``launch down`` finds a ``ray start`` left running there
  whatever the nodes' names resolve to by then (a record without it: resolved again).
  Its token stays on the nodes (``$HOME/.ray/launcher_auth_token``); commands read it over
  SSH when they open the tunnel to the head. ``clusters/<head host>-<gcs port>.lock`` is held
  while a command reads the record, bootstraps and saves it, and while ``launch down`` stops
  and forgets it.

Two locks (flock) for each launcher Ray, in two files, always taken in this order:

1. ``jobs_lock`` (``local/.jobs.lock``, or ``clusters/<head host>-<gcs port>.jobs.lock``): held
   by ``launch submit`` from finding (or starting) the launcher's Ray until Ray has the job
   (the code's upload included), and by ``launch down`` from listing the jobs until Ray is
   stopped: down stops no job it did not list. ``status``, ``list``, ``logs``, ``stop`` and
   ``fetch`` never take it, so they answer while a submission uploads or ``down`` waits for
   its jobs to stop.
2. the head's lock (``local/.lock``, or the cluster's ``.lock`` above): held only while a
   command finds, starts or stops the Ray (or reads, saves or forgets its record); every
   command takes it, and a command that holds both took ``jobs_lock`` first.

The local head binds its dashboard and Jobs API to 127.0.0.1 and needs the token for every
request (``RAY_AUTH_MODE=token``); its other ports are free ports picked at start (Ray's
defaults, such as the client server's 10001, would clash with a Ray someone else runs here).
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from launcher.errors import PreflightError, UnsafePath
from launcher.spec import ClusterSpec
from launcher.util import first_line, free_port, private_dir, write_private

log = logging.getLogger(__name__)

STATE_ENV = "LAUNCHER_STATE_DIR"
START_TIMEOUT_S = 120.0  # `ray start` with the dashboard takes ~8 s on a 2-core machine
STOP_TIMEOUT_S = 20.0
ANSWER_WAIT_S = 30.0  # a head busy starting jobs on 2 cores can take seconds to answer


class UnreadableRecord(PreflightError):
    """A state file of the launcher that cannot be read (exit 3): ``launch down --yes`` forgets it."""

    def __init__(self, path: Path, err: BaseException):
        super().__init__(
            f"the launcher's record {path} cannot be read ({first_line(err)}); `launch down --yes` "
            f"stops what it recorded and forgets it"
        )


def state_dir() -> Path:
    """The launcher's private state folder (created 0700). UnsafePath (exit 2) where it exists
    and another user owns it or may write it."""
    path, reason = private_dir(_state_root())
    if reason:
        raise UnsafePath(
            "the launcher's state folder",
            path,
            reason,
            f"Remove it (or `chmod 700` it, as its owner), or point ${STATE_ENV} at a folder of yours",
        )
    return path


def _state_root() -> Path:
    return Path(
        os.environ.get(STATE_ENV)
        or os.path.join(
            os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "launcher"
        )
    )


@dataclass(frozen=True)
class LocalHead:
    """The launcher's Ray head on this machine."""

    pid: int  # `ray start --head --block`: the head's processes end with it
    gcs_port: int
    dashboard_port: int
    agent_port: int  # the head's dashboard agent: Ray Jobs hands every submission to it
    temp_dir: str
    token_file: str

    @property
    def jobs_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def token(self) -> str:
        try:
            return Path(self.token_file).read_text().strip()
        except OSError as err:
            raise PreflightError(
                f"the launcher's Ray head on this machine has lost its token file {self.token_file} "
                f"({err.strerror or err}); `launch down --yes` stops the head and forgets it, the next "
                f"`launch submit` starts a new one"
            ) from err

    def answers(self) -> bool:
        """The process lives and its Jobs API answers an authenticated request."""
        return _is_head(self) and api_status(self.jobs_url, self.token()) == 200


def local_head(*, start: bool) -> LocalHead | None:
    """The running local head; with ``start``, one is started when none runs (else None).

    A head whose process lives is never replaced: a busy one may answer late (it is given
    ``ANSWER_WAIT_S``), and one that does not answer raises PreflightError; ``launch down
    --yes`` stops it. Only a head whose process is gone (a crash, a reboot) is cleared. The
    recorded pid is the head only while that process's command line names the head's temp
    dir: after a reboot the pid may be another process's, which is left alone.
    """
    folder = _local_folder()
    with _locked(folder / ".lock"):
        head = _load(folder)
        if head is not None and _is_head(head):
            deadline = time.monotonic() + ANSWER_WAIT_S
            while not head.answers():
                if time.monotonic() > deadline:
                    raise PreflightError(
                        f"the launcher's Ray head on this machine (pid {head.pid}) does not answer at "
                        f"{head.jobs_url} within {ANSWER_WAIT_S:.0f} s; try again, or stop it with "
                        f"`launch down --yes` (its start-up log: {folder / 'head.log'})"
                    )
                time.sleep(0.5)
            return head
        if head is not None:  # its process is gone: clear what remains of it
            _stop(head)
            (folder / "head.json").unlink(missing_ok=True)
        return _start(folder) if start else None


def recorded_local_head() -> LocalHead | None:
    """The local head's record, whether it answers or not (for ``launch down --yes``). An
    unreadable record gives what is known without it: the head's temp dir, whose processes
    ``stop_local_head`` stops (no pid: none is signalled by pid)."""
    folder = _local_folder()
    try:
        return _load(folder)
    except UnreadableRecord:
        return LocalHead(
            pid=0,
            gcs_port=0,
            dashboard_port=0,
            agent_port=0,
            temp_dir=_temp_dir(folder),
            token_file=str(folder / "auth_token"),
        )


def stop_local_head(head: LocalHead) -> None:
    """Stop the local head and everything it started; forget it."""
    folder = _local_folder()
    with _locked(folder / ".lock"):
        _stop(head)
        for name in ("head.json", "auth_token", TEMP_DIR_FILE):
            (folder / name).unlink(missing_ok=True)


# -- requests to the local head's Jobs API ---------------------------------------------------


def _direct() -> urllib.request.OpenerDirector:
    """An opener for the local head's 127.0.0.1 dashboard: plain HTTP, no proxy (whatever
    http_proxy says), and no redirect followed (urllib's would resend the token wherever it
    points): a 3xx is an HTTPError."""
    opener = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.ProxyHandler({}),
        urllib.request.HTTPHandler(),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    return opener


LOOPBACK = ("127.0.0.1", "localhost")


def no_proxy_for_loopback(env: dict[str, str] | os._Environ[str]) -> None:
    """Add 127.0.0.1 and localhost to ``env``'s ``no_proxy`` (and ``NO_PROXY`` where set): a
    request to a head's 127.0.0.1 Jobs API (Ray's client uses requests, which follows
    http_proxy) must not go through a proxy, nor take the token there."""
    for name in ("no_proxy", "NO_PROXY"):
        if name == "NO_PROXY" and name not in env:
            continue  # no_proxy is read first (requests, urllib, curl)
        given = env.get(name) or env.get("NO_PROXY") or ""
        have = [h.strip() for h in given.split(",") if h.strip()]
        if "*" not in have:
            env[name] = ",".join(have + [h for h in LOOPBACK if h not in have])


# -- bootstrapped clusters kept up for their jobs -------------------------------------------------


def cluster_record(cluster: ClusterSpec) -> Path:
    head = cluster.nodes[0]
    folder = state_dir() / "clusters"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder / f"{head.host}-{cluster.ray.port}.json"


@contextlib.contextmanager
def cluster_lock(cluster: ClusterSpec) -> Iterator[None]:
    """One process at a time reads, bootstraps and saves (or stops and forgets) this cluster's
    record (``clusters/<head host>-<gcs port>.lock``)."""
    with _locked(cluster_record(cluster).with_suffix(".lock")):
        yield


@contextlib.contextmanager
def jobs_lock(cluster: ClusterSpec) -> Iterator[None]:
    """The jobs lock of the launcher's Ray for ``cluster`` (none for a Ray it attaches to): held
    by a submission until Ray has the job and by ``launch down`` from listing the jobs to
    stopping Ray. A file of its own (``.jobs.lock``), not the head's lock that every command
    takes briefly (``local_head``, ``cluster_lock``): those are taken inside it, never around
    it, so ``status`` and ``list`` do not wait for a submission's upload."""
    if cluster.ray.address is not None:
        yield
    elif cluster.all_local:
        with _locked(_local_folder() / ".jobs.lock"):
            yield
    else:
        with _locked(cluster_record(cluster).with_suffix(".jobs.lock")):
            yield


ADDRESSES_KEY = (
    "ray_start_addresses"  # in a cluster's record, beside its spec: node name -> address
)


def saved_cluster(cluster: ClusterSpec) -> ClusterSpec | None:
    """The spec a bootstrapped cluster with this head was started with, if the launcher keeps one."""
    record = _read_record(cluster)
    if record is None:
        return None
    record.pop(ADDRESSES_KEY, None)
    try:
        return ClusterSpec.model_validate(record)
    except ValueError as err:  # a record of another version
        raise UnreadableRecord(cluster_record(cluster), err) from err


def saved_addresses(cluster: ClusterSpec) -> dict[str, str]:
    """The address each node's ``ray start`` was given (``--node-ip-address``; the head's is the
    ``--address`` the others joined), by node name, as the record of this cluster keeps them.
    Empty without a record or for an unreadable one."""
    try:
        record = _read_record(cluster)
    except (UnreadableRecord, OSError):  # OSError: no state folder to look in
        return {}
    return dict((record or {}).get(ADDRESSES_KEY) or {})


def save_cluster(cluster: ClusterSpec, addresses: Mapping[str, str] | None = None) -> None:
    """Record a bootstrapped cluster: its spec, and ``addresses`` (``saved_addresses``) if given."""
    record = cluster.model_dump(mode="json")
    if addresses:
        record[ADDRESSES_KEY] = dict(addresses)
    write_private(cluster_record(cluster), json.dumps(record, indent=2) + "\n")


def forget_cluster(cluster: ClusterSpec) -> None:
    cluster_record(cluster).unlink(missing_ok=True)


def _read_record(cluster: ClusterSpec) -> dict[str, Any] | None:
    """The cluster's record as written; None without one; UnreadableRecord for one that is not
    a JSON object."""
    path = cluster_record(cluster)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:  # ValueError: bad JSON
        raise UnreadableRecord(path, err) from err
    if not isinstance(record, dict):
        raise UnreadableRecord(path, ValueError("not a JSON object"))
    return record


# -- helpers ------------------------------------------------------------------------------------


def _local_folder() -> Path:
    folder = state_dir() / "local"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


_held = threading.local()  # the lock files this thread holds


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One process at a time holds ``path`` (flock): starts or stops a head, two submits at
    once share one. A thread that holds it already goes on (a second flock of the same file
    would wait for itself); other threads wait as other processes do."""
    held: set[str] = _held.__dict__.setdefault("paths", set())
    key = str(path.resolve())
    if key in held:
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        held.add(key)
        try:
            yield
        finally:
            held.discard(key)
            fcntl.flock(fh, fcntl.LOCK_UN)


def _load(folder: Path) -> LocalHead | None:
    """The recorded head; None without a record; UnreadableRecord for one that cannot be read
    (never "no head": a second head would start in the temp dir of one that may run)."""
    path = folder / "head.json"
    if not path.is_file():
        return None
    try:
        head = LocalHead(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as err:
        raise UnreadableRecord(path, err) from err
    fields = (head.pid, head.gcs_port, head.dashboard_port, head.agent_port)
    if not all(type(v) is int for v in fields) or not all(
        isinstance(v, str) for v in (head.temp_dir, head.token_file)
    ):
        raise UnreadableRecord(path, ValueError("a field has the wrong type"))
    return head


TEMP_DIR_FILE = "temp_dir"  # in the local folder: the running (or last) head's temp dir


def _temp_dir(folder: Path) -> str:
    """The temp dir of the last head started from this state folder ("" where none is known)."""
    try:
        return (folder / TEMP_DIR_FILE).read_text().strip()
    except OSError:
        return ""


def _new_temp_dir(folder: Path) -> str:
    """A new temp dir for a head in a private parent (``private_ray_temp``), recorded in the
    state folder before Ray runs in it."""
    from launcher.orchestrate.ray_cluster import private_ray_temp

    temp_dir = private_ray_temp()
    write_private(folder / TEMP_DIR_FILE, temp_dir + "\n")
    return temp_dir


def _start(folder: Path) -> LocalHead:
    from launcher.orchestrate.ray_cluster import KILL_CHILDREN_ENV, NICENESS_ENV

    token_file = folder / "auth_token"
    write_private(token_file, secrets.token_hex(32) + "\n")
    temp_dir = _new_temp_dir(folder)
    head = LocalHead(
        pid=0,
        gcs_port=free_port(),
        dashboard_port=free_port(),
        agent_port=free_port(),
        temp_dir=temp_dir,
        token_file=str(token_file),
    )
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token_file),
        "RAY_USAGE_STATS_ENABLED": "0",
        NICENESS_ENV: "0",
        # When an agent's process dies (its driver was killed), the raylet would SIGKILL the
        # agent's children, torchrun among them, and torchrun's workers (each in a session
        # of its own) would live on. Without that, torchrun gets the agent's death signal
        # (PR_SET_PDEATHSIG: SIGTERM) and stops its workers itself.
        KILL_CHILDREN_ENV: "0",
    }
    for name in ("RAY_AUTH_TOKEN", "RAY_ADDRESS"):  # this head's token and address, no one else's
        env.pop(name, None)
    no_proxy_for_loopback(
        env
    )  # its drivers ask its 127.0.0.1 Jobs API (JobSubmissionClient("auto"))
    argv = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        "--block",
        "--port",
        str(head.gcs_port),
        "--include-dashboard",
        "true",
        "--dashboard-host",
        "127.0.0.1",
        "--dashboard-port",
        str(head.dashboard_port),
        "--ray-client-server-port",
        str(free_port()),
        "--dashboard-agent-listen-port",
        str(head.agent_port),
        "--temp-dir",
        temp_dir,
        "--disable-usage-stats",
    ]
    log.info("Starting the launcher's Ray head on this machine for detached jobs")
    with open(folder / "head.log", "wb") as out:
        proc = subprocess.Popen(
            argv,
            env=env,
            cwd=folder,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    head = LocalHead(**{**asdict(head), "pid": proc.pid})
    deadline = time.monotonic() + START_TIMEOUT_S
    # Ready once the Jobs API answers and the agent listens (else the first submission waits
    # for the agent, ~7 s on 2 cores).
    try:  # until head.json names it, nothing else would stop this head: stop it on any way out
        while not (head.answers() and _listening(head.agent_port)):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (folder / "head.log").read_text(errors="replace").strip().splitlines()[-3:]
                raise PreflightError(
                    f"could not start the launcher's Ray head on this machine "
                    f"({'it exited' if proc.returncode is not None else 'no answer'} after "
                    f"{START_TIMEOUT_S - max(0.0, deadline - time.monotonic()):.0f} s): "
                    f"{' | '.join(tail) or 'no output'}. Its log is {folder / 'head.log'}; check free "
                    f"memory and /tmp space"
                )
            time.sleep(0.25)
        write_private(folder / "head.json", json.dumps(asdict(head)) + "\n")
    except BaseException:  # the error above, Ctrl-C, SIGTERM
        _stop(head)
        raise
    return head


def _stop(head: LocalHead) -> None:
    """SIGTERM to ``ray start --block`` (it stops the processes it started), then SIGKILL to
    whatever of the head is left: its process group and any process under its temp dir.

    Only processes that are the head's are signalled: the recorded pid while its command line
    names the temp dir, its process group while a process of the head is in it (a stale record's
    pid may be an unrelated process now, also a session leader)."""
    if head.pid and _is_head(head):
        with contextlib.suppress(ProcessLookupError):
            os.kill(head.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while _is_head(head) and time.monotonic() < deadline:
            time.sleep(0.2)
    if head.pid and _group_is_heads(head):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(head.pid, signal.SIGKILL)
    for pid in _processes_under(head.temp_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _pid_alive(head.pid)  # reaps it when this process started it
    if head.temp_dir:
        from launcher.orchestrate.ray_cluster import remove_ray_temp

        remove_ray_temp(head.temp_dir)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _processes_under(temp_dir: str) -> list[int]:
    """Processes whose command line names the head's temp dir (Ray's own, each one); none for
    an unknown ("") temp dir."""
    needle = temp_dir.encode()
    found: list[int] = []
    if not temp_dir:
        return found
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/cmdline", "rb") as fh:
                if needle in fh.read():
                    found.append(int(entry))
    return found


def _is_head(head: LocalHead) -> bool:
    """The recorded pid runs and is the head: its command line names the head's temp dir."""
    return _pid_alive(head.pid) and _names(head.pid, head.temp_dir.encode())


def _group_is_heads(head: LocalHead) -> bool:
    """The process group ``head.pid`` holds a process of the head (Linux does not reuse a pid
    while a group of that id has members)."""
    for pid in _processes_under(head.temp_dir):
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == head.pid:
                return True
    return False


def _names(pid: int, needle: bytes) -> bool:
    if not needle:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return needle in fh.read()
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    """Linux: the process exists (an exited child of this process is reaped, and is gone)."""
    if pid <= 0:
        return False
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    return Path(f"/proc/{pid}").exists()


def api_status(url: str, token: str | None) -> int | None:
    """The HTTP status of a Jobs API's version route at ``url`` (a head's 127.0.0.1, directly or
    through the SSH tunnel), with the token or without (None: nothing answers there). Never
    through a proxy; a redirect is not followed (its 3xx status is returned)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"{url}/api/version", headers=headers)
    try:  # a head's 127.0.0.1 (or the tunnel's): no proxy, no redirect
        with _direct().open(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code
    except (OSError, ValueError, http.client.HTTPException):
        return None
