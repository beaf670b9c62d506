"""The Ray that the launcher starts on this machine for detached jobs, found again through
its record in the launcher's state folder (``records``).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from launcher.errors import PreflightError
from launcher.jobs.records import UnreadableRecord, local_folder, locked
from launcher.spec import ClusterSpec, JobSpec, nodes_for_job
from launcher.util import accepts, free_port, write_private

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # `ray start` with the dashboard takes ~8 s on a 2-core machine
STOP_TIMEOUT_S = 20.0
ANSWER_WAIT_S = 30.0  # a head busy starting jobs on 2 cores can take seconds to answer


@dataclass(frozen=True)
class LocalHead:
    """The launcher's Ray head on this machine."""

    temp_dir: str
    token_file: str
    pid: int = 0  # `ray start --head --block`: the head's processes end with it (0: unknown)
    gcs_port: int = 0
    dashboard_port: int = 0
    agent_port: int = 0  # the head's dashboard agent: Ray Jobs hands every submission to it

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

    A head whose process lives is never replaced: it gets ``ANSWER_WAIT_S`` to answer, else
    PreflightError. A head whose process is gone is cleared (``_is_head``: a reused pid is not
    the head)."""
    folder = local_folder()
    with locked(folder / ".lock"):
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


def attach_to_local_head(cluster: ClusterSpec, job: JobSpec) -> ClusterSpec:
    """The cluster a foreground run uses: where the job runs on this machine alone, ``ray.address``
    is unset and the launcher's head is up (``launch up``, ``launch submit``), that head, whose
    Ray runs already (attaching costs ~0.1 s, starting Ray ~8 s); else ``cluster`` unchanged."""
    if cluster.ray.address is not None or cluster.slurm is not None:
        return cluster
    if not all(node.is_local for node in nodes_for_job(cluster, job)):
        return cluster
    try:
        head = local_head(start=False)
    except (PreflightError, UnreadableRecord) as err:  # a head that does not answer: start Ray
        log.info("not using the launcher's Ray head: %s", err)
        return cluster
    if head is None:
        return cluster
    print("Using the launcher's Ray head on this machine (`launch down` stops it)", flush=True)
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = head.token_file
    os.environ.pop("RAY_AUTH_TOKEN", None)  # another cluster's
    ray = cluster.ray.model_copy(update={"address": f"127.0.0.1:{head.gcs_port}"})
    return cluster.model_copy(update={"ray": ray})


def recorded_local_head() -> LocalHead | None:
    """The local head's record, whether it answers or not (for ``launch down --yes``). An
    unreadable record gives what is known without it: the head's temp dir, whose processes
    ``stop_local_head`` stops (no pid: none is signalled by pid)."""
    folder = local_folder()
    try:
        return _load(folder)
    except UnreadableRecord:
        return LocalHead(temp_dir=_temp_dir(folder), token_file=str(folder / "auth_token"))


def stop_local_head(head: LocalHead) -> None:
    """Stop the local head and everything it started; forget it."""
    folder = local_folder()
    with locked(folder / ".lock"):
        _stop(head)
        for name in ("head.json", "auth_token", TEMP_DIR_FILE):
            (folder / name).unlink(missing_ok=True)


# -- requests to the local head's Jobs API ---------------------------------------------------


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


# -- helpers ------------------------------------------------------------------------------------


def _load(folder: Path) -> LocalHead | None:
    """The recorded head; None without a record; UnreadableRecord for one that cannot be read
    (never "no head": a second head would start in the temp dir of one that may run)."""
    path = folder / "head.json"
    if not path.is_file():
        return None
    try:
        return LocalHead(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as err:
        raise UnreadableRecord(path, err) from err


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
    from launcher.orchestrate.ray_cluster import KILL_CHILDREN_ENV, NICENESS_ENV, check_ray_version

    check_ray_version()

    token_file = folder / "auth_token"
    write_private(token_file, secrets.token_hex(32) + "\n")
    temp_dir = _new_temp_dir(folder)
    ports = {f"{name}_port": free_port() for name in ("gcs", "dashboard", "agent")}
    head = LocalHead(temp_dir=temp_dir, token_file=str(token_file), **ports)
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token_file),
        "RAY_USAGE_STATS_ENABLED": "0",
        NICENESS_ENV: "0",
        KILL_CHILDREN_ENV: "0",
    }
    for name in ("RAY_AUTH_TOKEN", "RAY_ADDRESS"):  # this head's token and address, no one else's
        env.pop(name, None)
    no_proxy_for_loopback(env)  # its drivers ask its 127.0.0.1 Jobs API
    argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block"]
    argv += ["--port", str(head.gcs_port), "--include-dashboard", "true"]
    argv += ["--dashboard-host", "127.0.0.1", "--dashboard-port", str(head.dashboard_port)]
    argv += ["--ray-client-server-port", str(free_port())]
    argv += ["--dashboard-agent-listen-port", str(head.agent_port)]
    argv += ["--temp-dir", temp_dir, "--disable-usage-stats"]
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
    head = replace(head, pid=proc.pid)
    deadline = time.monotonic() + START_TIMEOUT_S
    # Ready once the Jobs API answers and the agent listens (else the first submission waits
    # for the agent, ~7 s on 2 cores).
    try:  # until head.json names it, nothing else would stop this head: stop it on any way out
        while not (head.answers() and accepts(head.agent_port)):
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
    """SIGTERM to ``ray start --block``, then SIGKILL to what is left of the head: its process
    group and any process under its temp dir. A stale record's pid, no longer the head's, is
    never signalled."""
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


def _processes_under(temp_dir: str) -> list[int]:
    """Processes whose command line names the head's temp dir (Ray's own, each one); none for
    an unknown ("") temp dir."""
    return [
        int(entry)
        for entry in os.listdir("/proc")
        if entry.isdigit() and int(entry) != os.getpid() and _names(int(entry), temp_dir)
    ]


def _is_head(head: LocalHead) -> bool:
    """The recorded pid runs and is the head: its command line names the head's temp dir."""
    return _pid_alive(head.pid) and _names(head.pid, head.temp_dir)


def _group_is_heads(head: LocalHead) -> bool:
    """The process group ``head.pid`` holds a process of the head (Linux does not reuse a pid
    while a group of that id has members)."""
    for pid in _processes_under(head.temp_dir):
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == head.pid:
                return True
    return False


def _names(pid: int, temp_dir: str) -> bool:
    """The process's command line names ``temp_dir`` (never an unknown "" one)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return bool(temp_dir) and temp_dir.encode() in fh.read()
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
    through a proxy; a redirect is not followed (urllib's would resend the token wherever it
    points): its 3xx status is returned."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"{url}/api/version", headers=headers)
    opener = urllib.request.OpenerDirector()  # plain HTTP, and none of the redirect handlers
    for handler in (
        urllib.request.ProxyHandler({}),
        urllib.request.HTTPHandler(),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    try:
        with opener.open(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code
    except (OSError, ValueError, http.client.HTTPException):
        return None
