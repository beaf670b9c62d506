"""``launch submit | status | logs | stop | list | fetch | down``: detached jobs on Ray Jobs."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import secrets
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from launcher import __version__
from launcher.errors import PreflightError, UsageError
from launcher.jobs import state as job_state
from launcher.jobs.api import ACTIVE, META_KEY, JobsCluster, NoJobs, api_failures, connect
from launcher.spec import ClusterSpec, JobSpec, nodes_for_job
from launcher.spec.envforward import forwarded
from launcher.util import first_line, utc_stamp, write_private

STOP_WAIT_MIN_S = 30  # RAY_JOB_STOP_WAIT_TIME_S: SIGINT, then this long to tear down, then SIGKILL
POLL_S = 0.5
RECONNECTS = 3  # broken log streams in a row that bring nothing new, then exit 3
RECONNECT_WAIT_S = 1.0
RESEND_S = 20.0  # a stream opened again must resend what was printed within this

log = logging.getLogger(__name__)


def submit(
    job: JobSpec,
    cluster: ClusterSpec,
    *,
    cluster_file: str | None,
    run_dir: Path | None,
    skip_parity: bool,
    as_json: bool,
) -> dict[str, Any]:
    """Preflight here, then the job to the cluster's Ray Jobs; returns ``{job_id, name, cluster,
    run_dir}`` once Ray has it."""
    from launcher.jobs import claim
    from launcher.jobs.driver import CODE_DIR, SUBMISSION_FILE
    from launcher.orchestrate.code import stage
    from launcher.orchestrate.plan import worker_counts
    from launcher.orchestrate.run import checked_code
    from launcher.preflight import preflight_facts

    if run_dir is not None and cluster.all_local:  # the head is this machine: look before anything
        claim.refuse_used(run_dir)
    if cluster.all_local and cluster.ray.address is None:
        # Import Ray's client (~1.5 s) while the probe runs; not before a bootstrap, which sets
        # the auth settings Ray reads at import.
        threading.Thread(
            target=importlib.import_module, args=("ray.job_submission",), daemon=True
        ).start()
    nodes = nodes_for_job(cluster, job)
    code = checked_code(job, cluster)  # what a foreground run refuses, submit refuses too
    job_id = f"{job.name}-{utc_stamp()}-{secrets.token_hex(2)}"
    with tempfile.TemporaryDirectory(prefix="launcher-submit-") as tmp:
        upload = Path(tmp)
        facts = preflight_facts(
            job, cluster, skip=skip_parity, save_to=upload / "preflight", show=not as_json
        )
        workers = worker_counts(job, nodes, facts)
        with connect(cluster, start=True) as jobs:
            release = None
            if jobs.head_is_local:
                where = str((run_dir or Path("runs") / job_id).resolve())
                # Marked for this job now (a second submission to it is exit 2); the driver takes it.
                release = claim.mark(Path(where), job_id)
            else:  # a path on the head; relative ones are under its home directory (the driver claims it)
                where = str(run_dir or Path("runs") / job_id)
            with _released_unless_submitted(release):
                try:
                    if code is not None and code.travels and not jobs.head_is_local:
                        snapshot = stage(code)  # the head cannot see this machine's workdir
                        try:
                            snapshot.rename(upload / CODE_DIR)
                        finally:
                            shutil.rmtree(snapshot, ignore_errors=True)  # gone once renamed
                    submission = {
                        "job_id": job_id,
                        "job": job.model_dump(mode="json"),
                        # The nodes' Ray is the running one's (the same, api._check_same); the rest as given now.
                        "cluster": cluster.model_copy(update={"ray": jobs.cluster.ray}).model_dump(
                            mode="json"
                        ),
                        "facts": {n: f.gpus for n, f in facts.items()}
                        if facts is not None
                        else None,
                        "skip_parity": skip_parity,
                        "run_dir": where,
                        # What the workers get from this shell, as in a foreground run:
                        # a head that is this machine runs its node's workers in it.
                        "shell_env": forwarded(
                            os.environ, job.launch.env_forward, everything=jobs.head_is_local
                        ),
                    }
                    write_private(upload / SUBMISSION_FILE, json.dumps(submission) + "\n")
                except OSError as err:  # an unreadable file in the workdir, a full disk
                    raise _staging_failed(err, code, upload) from err
                python = sys.executable if jobs.head_is_local else jobs.head.interpreter()
                stop_wait = max(STOP_WAIT_MIN_S, int(2 * job.launch.stop_grace_s) + 20)
                # The snapshot has the job's excludes applied: Ray must not drop what a .gitignore in
                # it lists (as for a foreground run, ray_cluster.open_session).
                os.environ["RAY_RUNTIME_ENV_IGNORE_GITIGNORE"] = "1"
                jobs.client.submit_job(
                    entrypoint=f"exec {shlex.quote(python)} -m launcher.jobs.driver {SUBMISSION_FILE}",
                    submission_id=job_id,
                    runtime_env={
                        "working_dir": str(upload),
                        "env_vars": {
                            "RAY_JOB_STOP_SIGNAL": "SIGINT",
                            "RAY_JOB_STOP_WAIT_TIME_S": str(stop_wait),
                        },
                    },
                    metadata={
                        META_KEY: __version__,
                        "name": job.name,
                        "run_id": job_id,
                        "world_size": str(sum(workers.values())),
                        "nodes": str(len(nodes)),
                        "node_names": ",".join(n.name for n in nodes),
                        "run_dir": where,
                    },
                )
    where_cluster = cluster_file or "this machine"
    out = {"job_id": job_id, "name": job.name, "cluster": where_cluster, "run_dir": where}
    if as_json:
        print(json.dumps(out), flush=True)
    else:
        flag = f" --cluster {shlex.quote(cluster_file)}" if cluster_file else ""
        print(
            f"Submitted job {job_id} ({sum(workers.values())} rank(s) on {len(nodes)} node(s)); "
            f"run directory {where}{'' if jobs.head_is_local else ' on ' + jobs.head.name}\n"
            f"Follow it:\n"
            f"  launch status {job_id}{flag}\n"
            f"  launch logs {job_id} --follow{flag}\n"
            f"  launch stop {job_id}{flag}\n"
            f"  launch fetch {job_id}{flag}   # the run directory, here",
            flush=True,
        )
    return out


def status(cluster: ClusterSpec, job_id: str | None, *, as_json: bool) -> int:
    """One job's state, or every job's (as ``list``)."""
    if job_id is None:
        return list_jobs(cluster, as_json=as_json)
    with _connect_for(cluster, job_id) as jobs:
        details = jobs.job(job_id)
        row = job_state.row(details, jobs.state_log(details))
    print(json.dumps(job_state.to_json(row)) if as_json else job_state.render_one(row), flush=True)
    return 0


def list_jobs(cluster: ClusterSpec, *, as_json: bool) -> int:
    try:
        with connect(cluster) as jobs:
            rows = [job_state.row(d, jobs.state_log(d)) for d in jobs.jobs()]
    except NoJobs as none:
        print("[]" if as_json else str(none), flush=True)
        return 0
    if as_json:
        print(json.dumps([job_state.to_json(r) for r in rows]), flush=True)
    else:
        print(job_state.render_table(rows) if rows else str(NoJobs()), flush=True)
    return 0


def logs(cluster: ClusterSpec, job_id: str, *, follow: bool) -> int:
    """The driver's output; with ``follow``, streamed until the job ends (Ctrl-C stops
    following only). Output into a pipe that closes early (``| head``) raises BrokenPipeError,
    which ``launcher.cli`` ends quietly (exit 0), not as a failure of the Jobs API."""
    with _connect_for(cluster, job_id) as jobs:
        details = jobs.job(job_id)
        if not follow or _status(details) not in ACTIVE:
            print(job_state.strip(jobs.logs(details)), end="", flush=True)
            if follow:
                print(
                    f"job {job_id} has ended ({_shown(jobs, details)}); nothing to follow",
                    flush=True,
                )
            return 0
        try:
            _follow(cluster, jobs, job_id)
        except KeyboardInterrupt:
            print(
                f"\nstopped following; job {job_id} goes on (`launch stop {job_id}` stops it)",
                file=sys.stderr,
                flush=True,
            )
            return 0
        print(f"job {job_id} ended: {_shown(jobs, jobs.job(job_id))}", flush=True)
    return 0


def stop(cluster: ClusterSpec, job_id: str) -> int:
    """SIGINT to the driver (as Ctrl-C to a foreground run); waits until the job has ended."""
    with _connect_for(cluster, job_id) as jobs:
        details = jobs.job(job_id)
        if _status(details) not in ACTIVE:
            print(
                f"job {job_id} has already ended ({_shown(jobs, details)}); nothing to stop",
                flush=True,
            )
            return 0
        jobs.client.stop_job(job_id)
        print(
            f"Stopping job {job_id}: its driver stops every worker and writes its summary",
            flush=True,
        )
        details = _wait_ended(jobs, job_id, timeout_s=_stop_wait(details) + 15)
        print(f"job {job_id}: {_shown(jobs, details)}", flush=True)
    return 0


def fetch(cluster: ClusterSpec, job_id: str, *, to: Path | None) -> Path:
    """The job's run directory from the head into ``to`` (default ``runs/<job id>``). A job
    without one (its driver refused the folder, or it ended before its driver started: the
    folder is not its own and may hold another run) is UsageError (exit 2), nothing copied."""
    from launcher.jobs.ssh import copy_dir

    with _connect_for(cluster, job_id) as jobs:
        details = jobs.job(job_id)
        row = job_state.row(details, jobs.state_log(details))
        if row["run_dir"] is None:
            raise UsageError(
                f"job {job_id} has no run directory to fetch ({row['status']}): {row['no_run_dir']}. "
                f"Nothing was fetched; `launch logs {job_id}` shows its driver's output"
            )
        source = (details.metadata or {})["run_dir"]
        dest = (to or Path("runs") / job_id).resolve()
        if jobs.head_is_local and Path(source).resolve() == dest:
            print(f"{dest} is the run directory itself (the head is this machine)", flush=True)
            return dest
        copy_dir(jobs.head, jobs.cluster.ssh, source, dest)
        note = " (a snapshot: the job is still running)" if _status(details) in ACTIVE else ""
        print(
            f"Fetched {source} from {jobs.head.name} into {dest}{note}\n"
            f"  launch report {shlex.quote(str(dest))}",
            flush=True,
        )
    return dest


def up(cluster: ClusterSpec) -> int:
    """Start the launcher's Ray head on this machine (once): detached jobs go to it, and a
    foreground run on this machine attaches to it instead of starting Ray."""
    from launcher.jobs.head import local_head

    if cluster.ray.address is not None or not cluster.all_local:
        raise UsageError(
            "launch up starts the launcher's Ray on this machine only; this cluster file names "
            "other nodes or a ray.address (`launch submit` bootstraps or attaches to those)"
        )
    head = local_head(start=True)
    assert head is not None
    print(
        f"The launcher's Ray head runs on this machine (127.0.0.1:{head.gcs_port}, pid {head.pid}); "
        f"runs and jobs here use it; `launch down` stops it",
        flush=True,
    )
    return 0


def down(cluster: ClusterSpec, *, yes: bool) -> int:
    """Stop the Ray the launcher started for detached jobs (never one it attached to)."""
    from launcher.jobs.records import jobs_lock

    if cluster.ray.address is not None:
        print(
            f"the Ray at ray.address {cluster.ray.address} is not the launcher's: `launch down` "
            f"stops only a Ray the launcher started; nothing stopped",
            flush=True,
        )
        return 0
    # From listing the jobs to stopping Ray: a submission waits (and starts Ray again after),
    # so the jobs stopped with Ray are exactly those listed (and confirmed, without --yes).
    with jobs_lock(cluster):
        return _down(cluster, yes=yes)


def _down(cluster: ClusterSpec, *, yes: bool) -> int:
    try:
        with connect(cluster) as jobs:
            active = [d for d in jobs.jobs() if _status(d) in ACTIVE]
            ids = ", ".join(d.submission_id for d in active)
            if active and not yes:
                raise UsageError(
                    f"{len(active)} job(s) still running: {ids}; stop them first (`launch stop ID`) "
                    f"or pass --yes to stop them and Ray"
                )
            if active:
                print(
                    f"Stopping {len(active)} job(s) and waiting for them to end: {ids}", flush=True
                )
            for details in active:
                jobs.client.stop_job(details.submission_id)
            for details in active:
                _wait_ended(jobs, details.submission_id, timeout_s=_stop_wait(details) + 15)
            spec, local = jobs.cluster, jobs.local_head  # local: the launcher's head here
    except NoJobs:
        print("no Ray started by the launcher for this cluster; nothing to stop", flush=True)
        return 0
    except PreflightError:
        # Ray that does not answer: --yes stops what is left of it unasked (and forgets a
        # bootstrapped cluster), without the job list it cannot give
        from launcher.jobs.head import recorded_local_head
        from launcher.jobs.records import UnreadableRecord, saved_cluster

        if cluster.all_local:
            spec, local = cluster, recorded_local_head()
            found = local is not None
        else:
            local = None
            try:
                saved = saved_cluster(cluster)
            except UnreadableRecord:  # its nodes unknown: cluster.yaml's, whose head it is
                saved = cluster
            found = saved is not None
            spec = saved or cluster
        if not (yes and found):
            raise
    if local is not None:
        from launcher.jobs.head import stop_local_head

        print("Stopping the launcher's Ray head on this machine ...", flush=True)
        stop_local_head(local)
        print("Stopped the launcher's Ray head on this machine", flush=True)
    else:
        from launcher.jobs.records import cluster_lock, forget_cluster, saved_addresses
        from launcher.orchestrate.ray_cluster import stop_ray

        names = ", ".join(n.name for n in spec.nodes)
        print(f"Stopping the launcher's Ray on {names} over SSH ...", flush=True)
        with cluster_lock(spec):  # inside jobs_lock, as every holder of both takes them
            left = stop_ray(spec, list(spec.nodes), saved_addresses(spec))
            forget_cluster(spec)
        stopped = [n.name for n in spec.nodes if n.name not in left]
        if left:  # forgotten all the same: a node that never answers again must not pin the record
            raise PreflightError(
                f"stopped the launcher's Ray on {', '.join(stopped) or 'no node'}, but could not reach "
                f"{', '.join(left)}: Ray may still run there (stop it with `ray stop` on each). The "
                f"launcher has forgotten this cluster"
            )
        print(f"Stopped the launcher's Ray on {', '.join(stopped)}", flush=True)
    return 0


# -- helpers --------------------------------------------------------------------------------


def _staging_failed(err: OSError, code: Any, upload: Path) -> PreflightError:
    """The files of a submission could not be put together on this machine (exit 3)."""
    what = f"{err.strerror or err}" + (f" ({err.filename})" if err.filename else "")
    fix = (
        f"make every file of the workdir {code.workdir} readable or leave it out with "
        f"entrypoint.exclude, and "
        if code is not None and code.travels
        else ""
    )
    return PreflightError(
        f"could not stage the job's files for submission: {what}. Nothing was "
        f"submitted and nothing was started; {fix}check that {upload.parent} has free space (TMPDIR "
        f"picks another folder), then submit again"
    )


@contextlib.contextmanager
def _released_unless_submitted(release: Any) -> Iterator[None]:
    """A run directory marked for a submission that fails before Ray has the job (staging,
    the Jobs API, Ctrl-C) is free again."""
    try:
        yield
    except BaseException:
        if release is not None:
            try:
                release()
            except OSError as err:  # the submission's own error is the one to report
                log.warning("could not free the marked run directory (%s)", err)
        raise


@contextlib.contextmanager
def _connect_for(cluster: ClusterSpec, job_id: str) -> Iterator[JobsCluster]:
    """``connect(cluster)`` for a command about one job: no launcher Ray means an unknown id."""
    try:
        with connect(cluster) as jobs:
            yield jobs
    except NoJobs:
        raise UsageError(
            f"no job {job_id!r}: nothing was submitted on this cluster (known job ids: none)"
        ) from None


def _follow(cluster: ClusterSpec, jobs: JobsCluster, job_id: str) -> None:
    """Stream the job's log until the job ends. A stream that breaks off is opened again on a
    new connection, skipping what was printed; exit 3 after ``RECONNECTS`` fruitless tries."""
    follower = _Follower()
    broken = 0
    while True:
        before = follower.received
        try:
            if before == 0 and broken == 0:
                asyncio.run(follower.tail(jobs.client, job_id))
            else:  # a new connection: a tunnel to the head whose forwarding died is not reused
                with _connect_for(cluster, job_id) as fresh:
                    asyncio.run(follower.tail(fresh.client, job_id))
            follower.flush()
            return
        except BrokenPipeError:  # stdout's reader went (``| head``): no failure of the Jobs API
            raise
        except api_failures() as err:
            broken = 1 if follower.received > before else broken + 1
            reason = first_line(err)
        if broken > RECONNECTS:
            raise PreflightError(
                f"following job {job_id} stopped: the Ray Jobs API at {jobs.url} broke off the log "
                f"stream ({reason}; {RECONNECTS} reconnections brought nothing); the job may go on "
                f"(`launch status {job_id}`)"
            )
        log.info("the log stream of job %s broke off (%s); reconnecting", job_id, reason)
        time.sleep(RECONNECT_WAIT_S * broken)


class _Follower:
    """Prints a job's log lines once each, across streams that each start at the beginning."""

    def __init__(self) -> None:
        self.received = 0  # characters of the log taken so far
        self._pending = ""  # a line not ended yet

    async def tail(self, client: Any, job_id: str) -> None:
        skip = self.received
        stream = client.tail_job_logs(job_id)
        while True:
            try:  # a stream opened again sends what was printed at once: silence is a dead end
                chunk = await asyncio.wait_for(anext(stream), RESEND_S if skip else None)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise ConnectionError(
                    f"nothing came within {RESEND_S:g} s of reconnecting"
                ) from None
            if skip:
                taken = min(skip, len(chunk))
                chunk, skip = chunk[taken:], skip - taken
            self.received += len(chunk)
            self._pending += chunk
            *lines, self._pending = self._pending.split("\n")
            for text in lines:
                if job_state.shown(text):
                    print(text, flush=True)

    def flush(self) -> None:
        if self._pending and job_state.shown(self._pending):
            print(self._pending, flush=True)
        self._pending = ""


def _stop_wait(details: Any) -> float:
    """How long Ray gives this job's driver to tear down after SIGINT (set at submission from
    its ``launch.stop_grace_s``) before it sends SIGKILL."""
    env = (details.runtime_env or {}).get("env_vars", {})
    return float(env.get("RAY_JOB_STOP_WAIT_TIME_S", STOP_WAIT_MIN_S))


def _wait_ended(jobs: JobsCluster, job_id: str, *, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        details = jobs.job(job_id)
        if _status(details) not in ACTIVE or time.monotonic() > deadline:
            return details
        time.sleep(POLL_S)


def _status(details: Any) -> str:
    return str(details.status.value)


def _shown(jobs: JobsCluster, details: Any) -> str:
    """The status as ``launch status`` shows it."""
    return job_state.row(details, jobs.state_log(details))["status"]
