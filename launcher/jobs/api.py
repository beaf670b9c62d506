"""Reaching a cluster's Jobs API (the local head, a bootstrapped head through an SSH tunnel,
or an attached cluster as it is) and the launcher's jobs on it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from launcher.errors import LauncherError, PreflightError, UsageError
from launcher.jobs import head as heads
from launcher.jobs import records
from launcher.jobs import state as job_state
from launcher.spec import ClusterSpec, NodeSpec
from launcher.util import accepts, first_line

log = logging.getLogger(__name__)

META_KEY = "launcher"  # Ray Job metadata: the launcher's version; marks the launcher's jobs
ACTIVE = ("PENDING", "RUNNING")
TUNNEL_READY_S = 5.0
STATE_TAIL_LINES = 2000  # the end of a driver's log that status reads for its last state line


class NoToken(PreflightError):
    """SSH reached the head and the launcher's token file is not there: no launcher Ray runs."""


class NoJobs(LauncherError):
    """No launcher-started Ray for this cluster: nothing was ever submitted (exit 0)."""

    exit_code = 0

    def __init__(self) -> None:
        super().__init__("no jobs: nothing was submitted on this cluster")


@dataclass
class JobsCluster:
    """A cluster's Jobs API, as the job commands use it."""

    kind: str  # local | bootstrap | attach
    cluster: ClusterSpec
    client: Any  # ray.job_submission.JobSubmissionClient
    url: str
    local_head: heads.LocalHead | None = None

    @property
    def head(self) -> NodeSpec:
        return self.cluster.nodes[0]

    @property
    def head_is_local(self) -> bool:
        """The drivers (and run directories) are on this machine."""
        return self.kind == "local" or self.head.is_local

    def jobs(self) -> list[Any]:
        """The launcher's jobs on the cluster, newest first (``JobDetails``)."""
        ours = [j for j in self.client.list_jobs() if META_KEY in (j.metadata or {})]
        return sorted(ours, key=lambda j: (j.start_time or 0, j.submission_id), reverse=True)

    def job(self, job_id: str) -> Any:
        """One of the launcher's jobs; UsageError (exit 2) naming the known ids otherwise."""
        jobs = self.jobs()
        for details in jobs:
            if details.submission_id == job_id:
                return details
        known = ", ".join(j.submission_id for j in jobs) or "none"
        raise UsageError(
            f"no job {job_id!r} on this cluster; known job ids: {known} (`launch list` shows them)"
        )

    def logs(self, details: Any) -> str:
        """The driver's log so far ("" while Ray has not started the driver: the log request
        goes to the driver's node, which a PENDING job does not have yet)."""
        if str(details.status.value) == "PENDING":
            return ""
        return self.client.get_job_logs(details.submission_id)

    def state_log(self, details: Any) -> str:
        """Enough of the driver's log for its last state line: its last ``STATE_TAIL_LINES``
        lines, the whole log only where they hold none (or Ray's log API fails)."""
        if str(details.status.value) == "PENDING":
            return ""
        node = getattr(details, "driver_node_id", None)
        if not node:
            return self.logs(details)
        try:
            tail = self.client.tail_log(details.submission_id, node, STATE_TAIL_LINES)
        except PreflightError:
            return self.logs(details)
        if job_state.last_state(tail) is not None or tail.count("\n") < STATE_TAIL_LINES:
            return tail
        return self.logs(details)


@contextlib.contextmanager
def connect(cluster: ClusterSpec, *, start: bool = False) -> Iterator[JobsCluster]:
    """The cluster's Jobs API; ``start`` starts the launcher's Ray where none runs (else
    NoJobs) and holds ``records.jobs_lock`` for the block."""
    with records.jobs_lock(cluster) if start else contextlib.nullcontext():
        if cluster.ray.address is not None:
            with _attached(cluster) as jobs:
                yield jobs
        elif cluster.all_local:
            head = heads.local_head(start=start)
            if head is None:
                raise NoJobs()
            yield JobsCluster(
                "local", cluster, _client(head.jobs_url, head.token()), head.jobs_url, head
            )
        else:
            with _bootstrapped(cluster, start=start) as jobs:
                yield jobs


# -- the three kinds -------------------------------------------------------------------------


@contextlib.contextmanager
def _attached(cluster: ClusterSpec) -> Iterator[JobsCluster]:
    rc = cluster.ray
    # Ray adds the token it finds to each request in token mode; a cluster without
    # authentication ignores it.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if rc.jobs_address or cluster.nodes[0].is_local:
        url = (rc.jobs_address or f"http://127.0.0.1:{rc.dashboard_port}").rstrip("/")
        yield JobsCluster("attach", cluster, _client(url, None), url)
        return
    with _tunnel(cluster) as (url, _):
        yield JobsCluster("attach", cluster, _client(url, None), url)


@contextlib.contextmanager
def _bootstrapped(cluster: ClusterSpec, *, start: bool) -> Iterator[JobsCluster]:
    """The bootstrapped cluster's Jobs API through the tunnel, bootstrapped by one process at a
    time. A submission to a Ray started for other nodes is UsageError; Ray is started again only
    where the head answers SSH without a launcher token (else PreflightError, record kept)."""
    with contextlib.ExitStack() as stack:
        with records.cluster_lock(cluster):
            saved = records.saved_cluster(cluster)
            if saved is None and not start:
                raise NoJobs()
            if saved is None:
                saved = _bootstrap(cluster)
                url, token = stack.enter_context(_tunnel(saved, token=True))
            else:
                if start:  # a submission runs on the saved nodes: they must be cluster.yaml's
                    _check_same(saved, cluster)
                try:
                    url, token = stack.enter_context(_tunnel(saved, token=True))
                except (PreflightError, OSError) as err:
                    if not (start and isinstance(err, NoToken)):
                        raise _not_answering(saved, err) from err
                    log.warning(
                        "the launcher's Ray on %s is gone (%s); starting it again",
                        saved.nodes[0].name,
                        first_line(err),
                    )
                    saved = _bootstrap(cluster)  # its record replaces the old one once it runs
                    url, token = stack.enter_context(_tunnel(saved, token=True))
        yield JobsCluster("bootstrap", saved, _client(url, token), url)


# what the running Ray was started with
RAY_NODE_FIELDS = ("name", "host", "port", "user", "python")


def _check_same(saved: ClusterSpec, cluster: ClusterSpec) -> None:
    """UsageError (exit 2) when the running Ray was started for other nodes (``RAY_NODE_FIELDS``)
    or Ray settings than the cluster file gives now."""
    differ = [
        f"node {a.name if a.name == b.name else f'{a.name}/{b.name}'}: {key} {getattr(a, key)!r} → {getattr(b, key)!r}"
        for a, b in zip(saved.nodes, cluster.nodes, strict=False)
        for key in RAY_NODE_FIELDS
        if getattr(a, key) != getattr(b, key)
    ]
    if len(saved.nodes) != len(cluster.nodes):
        differ.append(f"{len(saved.nodes)} node(s) → {len(cluster.nodes)}")
    saved_ray = saved.ray.model_copy(update={"dashboard": cluster.ray.dashboard})
    differ += [
        f"ray.{key} {getattr(saved_ray, key)!r} → {getattr(cluster.ray, key)!r}"
        for key in type(saved_ray).model_fields
        if getattr(saved_ray, key) != getattr(cluster.ray, key)
    ]
    if differ:
        head = saved.nodes[0]
        raise UsageError(
            f"the launcher's Ray on {head.name} ({head.host}) was started for other nodes than the "
            f"cluster file gives now ({'; '.join(differ[:5])}{'; …' if len(differ) > 5 else ''}); "
            f"`launch down --yes` first (it stops that Ray and its jobs), then submit again"
        )


def _not_answering(saved: ClusterSpec, err: BaseException) -> PreflightError:
    head = saved.nodes[0]
    return PreflightError(
        f"the Ray the launcher started on {head.name} ({head.host}) does not answer: {first_line(err)}. "
        f"It may have been stopped; `launch down --yes` stops what is left of it and forgets it, the "
        f"next `launch submit` starts it again"
    )


def _bootstrap(cluster: ClusterSpec) -> ClusterSpec:
    """Start Ray on every node of the cluster as a foreground run does, dashboard on, and
    leave it running for detached jobs; remember it and the address each node's ``ray start``
    was given (``records.save_cluster``; ``launch down`` tells this cluster's ``ray start`` by them)."""
    from launcher.orchestrate.ray_cluster import open_session

    spec = cluster.model_copy(update={"ray": cluster.ray.model_copy(update={"dashboard": True})})
    session = open_session(spec, list(spec.nodes))
    session.leave_running()
    os.environ.pop("RAY_AUTH_TOKEN", None)
    records.save_cluster(spec, session.node_ips)
    return spec


# -- the SSH tunnel ----------------------------------------------------------------------------


@contextlib.contextmanager
def _tunnel(cluster: ClusterSpec, *, token: bool = False) -> Iterator[tuple[str, str | None]]:
    """A local port forwarded over SSH to the head's 127.0.0.1 dashboard port: (url, token),
    the token read on the same connection; PreflightError where the Jobs API does not answer."""
    from launcher.orchestrate.ray_cluster import TOKEN_FILE
    from launcher.remote import NodeError
    from launcher.remote.ssh import SSHRunner

    head = cluster.nodes[0]
    with contextlib.ExitStack() as stack:
        runner = SSHRunner(head, cluster.ssh)
        stack.enter_context(runner)
        try:
            result = None
            if token:
                result = runner.run(f"cat {TOKEN_FILE}", timeout=cluster.ssh.connect_timeout_s + 10)
                if not (result.ok and result.stdout.strip()):
                    raise NoToken(
                        f"no launcher token on {head.name} ({shlex.quote(TOKEN_FILE)} "
                        f"is missing): Ray is not running there"
                    )
            port = stack.enter_context(runner.forward("127.0.0.1", cluster.ray.dashboard_port))
        except NodeError as err:
            raise PreflightError(
                f"cannot reach the head node {head.name} ({head.host}) over SSH: {err}"
            ) from err
        secret = result.stdout.strip() if result is not None else None
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + TUNNEL_READY_S  # the listener is a thread's
        while not accepts(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        # Ask once with a timeout: Ray's client would wait forever on a dead tunnel.
        if heads.api_status(url, secret) is None:
            raise PreflightError(
                f"Ray's Jobs API on {head.name} (127.0.0.1:{cluster.ray.dashboard_port} there, "
                f"through the SSH tunnel) does not answer"
            )
        yield url, secret


def _client(url: str, token: str | None) -> Any:
    from ray.job_submission import JobSubmissionClient

    # Ray logs "Uploading package ..." at INFO on every submit (these loggers set their own level).
    for name in ("ray.dashboard.modules.dashboard_sdk", "ray._private.runtime_env.packaging"):
        logging.getLogger(name).setLevel(logging.WARNING)
    headers = {"Authorization": f"Bearer {token}"} if token else None
    if urllib.parse.urlsplit(url).hostname in heads.LOOPBACK:
        # A head's 127.0.0.1 (the local head, the SSH tunnel's end): Ray's client uses requests,
        # which would send the token through http_proxy.
        heads.no_proxy_for_loopback(os.environ)
    try:
        return _Guarded(JobSubmissionClient(url, headers=headers), url, headers)
    except Exception as err:  # Ray raises ConnectionError, RuntimeError, ...
        raise PreflightError(
            f"cannot reach the Ray Jobs API at {url}: {first_line(err)}. Check that the cluster "
            f"runs, its dashboard is on (ray[default] installed there) and the token is right"
        ) from err


def api_failures() -> tuple[type[BaseException], ...]:
    """What Ray's Jobs client raises when the API fails after connecting: requests' errors
    (OSError), an HTTP error status (RuntimeError), a refused token (RayError), aiohttp's."""
    from ray.exceptions import RayError

    try:
        from aiohttp import ClientError
    except ImportError:  # no ray[default] here: Ray's client will say so
        return (OSError, RuntimeError, RayError)
    return (OSError, RuntimeError, RayError, ClientError)


class _Guarded:
    """A ``JobSubmissionClient`` whose calls turn the Jobs API's failures into PreflightError
    (exit 3, one paragraph) instead of a traceback. ``tail_job_logs`` (an async generator) is
    handed out as it is: its caller catches ``api_failures()``."""

    def __init__(self, client: Any, url: str, headers: dict[str, str] | None = None):
        self._client = client
        self._url = url
        self._headers = headers

    def tail_log(self, job_id: str, node_id: str, lines: int) -> str:
        """The last ``lines`` lines of a job's driver log on its node (``driver_node_id``),
        through Ray's log API, which reads them from the end of the file."""
        import requests

        try:
            with requests.get(
                f"{self._url}/api/v0/logs/file",
                params={"submission_id": job_id, "node_id": node_id, "lines": str(lines)},
                headers=self._headers,
                timeout=60,
            ) as answer:
                if answer.status_code != 200:
                    raise RuntimeError(f"HTTP {answer.status_code}: {answer.text.strip()[:200]}")
                return answer.content.decode("utf-8", "replace")
        except api_failures() as err:
            raise self._failed("log API", err) from err

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr) or name == "tail_job_logs":
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            except LauncherError:
                raise
            except api_failures() as err:
                raise self._failed("Jobs API", err, f" ({name})") from err

        return call

    def _failed(self, what: str, err: BaseException, call: str = "") -> PreflightError:
        return PreflightError(
            f"the Ray {what} at {self._url} failed{call}: {first_line(err)}. Check that the "
            f"cluster's Ray still runs (`launch status`); `--debug` shows the traceback"
        )
