"""A detached job's driver, the Ray Job's entrypoint on the head node: attaches to the node's
Ray, waits its turn in the queue, runs a foreground run's ``Launch``, says its state in its log.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher import signals
from launcher.errors import EXIT_INTERRUPTED, EXIT_JOB_FAILED, LauncherError
from launcher.jobs import claim, queue
from launcher.jobs import state as job_state
from launcher.jobs.api import ACTIVE, META_KEY
from launcher.orchestrate.code import plan_code
from launcher.orchestrate.plan import worker_counts
from launcher.orchestrate.ray_cluster import open_session
from launcher.orchestrate.records import Status
from launcher.orchestrate.run import Launch
from launcher.orchestrate.rundir import RunDir
from launcher.orchestrate.runlog import RunLog
from launcher.preflight import NodeFacts
from launcher.results.summary import summarize, write_summary
from launcher.spec import ClusterSpec, JobSpec, nodes_for_job
from launcher.util import setup_logging

log = logging.getLogger(__name__)

SUBMISSION_FILE = "submission.json"
CODE_DIR = "code"
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
STATE_EVERY_S = 2.0  # running-state lines at most this often
EXIT_CODES = {
    Status.SUCCEEDED: 0,
    Status.FAILED: EXIT_JOB_FAILED,
    Status.INTERRUPTED: EXIT_INTERRUPTED,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    setup_logging(debug="--debug" in args)
    signals.install()
    submission = json.loads(Path(args[0]).read_text())
    job = JobSpec.model_validate(submission["job"])
    run_dir = None  # until claimed: a folder not this job's gets nothing written into it
    try:
        # One run per run directory, as for a foreground run (exit 2 for one not this job's).
        run_dir = claim.take(_on_this_node(submission["run_dir"]), submission["job_id"])
        return drive(submission, job, run_dir)
    except LauncherError as err:
        print(f"error: {err}", flush=True)
        _final(job, run_dir, Status.FAILED, reason=str(err))
        return err.exit_code
    except KeyboardInterrupt:
        print("error: interrupted (launch stop): nothing of the job is left running", flush=True)
        _final(job, run_dir, Status.INTERRUPTED)
        return EXIT_INTERRUPTED


def drive(sub: dict[str, Any], job: JobSpec, run_dir: RunDir) -> int:
    """The job in ``run_dir`` (claimed): its turn in the queue, then a foreground run's launch."""
    emit({"state": "starting", "run_dir": str(run_dir.root)})
    _leave_upload_out()
    cluster = ClusterSpec.model_validate(sub["cluster"])
    job = _with_shipped_code(job, Path.cwd() / CODE_DIR)
    given = sub["facts"]
    facts = None if given is None else {n: NodeFacts(gpus=g) for n, g in given.items()}
    # Attach to the Ray this driver runs on; Ray Jobs sets RAY_ADDRESS for it.
    attached = cluster.model_copy(
        update={"ray": cluster.ray.model_copy(update={"address": "auto"})}
    )
    nodes = nodes_for_job(cluster, job)
    code = plan_code(job, nodes)
    run_dir.prepare(job, cluster)
    if Path("preflight").is_dir():
        shutil.copytree("preflight", run_dir.preflight, dirs_exist_ok=True)
    print(f"Job {sub['job_id']}: run directory {run_dir.root} on {os.uname().nodename}", flush=True)
    session = open_session(attached, nodes, code)
    board = None
    try:
        ticket = queue.Ticket(
            job_id=sub["job_id"],
            name=job.name,
            demand=_demand(job, nodes, facts, session.node_ips),
            node_names={ip: name for name, ip in session.node_ips.items()},
        )
        board = queue.wait_turn(ticket, alive=_alive_jobs, capacity=_capacity(), on_wait=_waiting)
        emit({"state": "running", "step": None, "tokens_per_s": None})
        outcome = DetachedLaunch(
            job=job,
            cluster=cluster,
            run_dir=run_dir,
            code=code,
            skip_parity=sub["skip_parity"],
            session=session,
            facts=facts,
            shell_env=sub.get("shell_env") or {},
        ).execute()
    finally:
        if board is not None:
            import ray

            _quietly(lambda: ray.get(board.end.remote(sub["job_id"]), timeout=10))
        session.close()
        _quietly(lambda: _keep_ray_lines(run_dir))
    emit(_done(outcome.status, outcome.summary or {}, run_dir))
    print(f"Run directory: {run_dir.root}", flush=True)
    return EXIT_CODES[outcome.status]


class StateLog(RunLog):
    """The run log, also saying the latest step and aggregate tokens/s in state lines."""

    def __init__(self, run_dir: RunDir, *, quiet: bool = False):
        super().__init__(run_dir, quiet=quiet)
        self._rates: dict[int, float] = {}
        self._step: int | None = None
        self._said_at = 0.0
        self._said: tuple[int | None, float | None] = (None, None)

    def ingest(self, node: Any, update: Any) -> None:
        super().ingest(node, update)
        for rank, record in update.records:
            if record.get("type") != "step":
                continue
            if record.get("interval_s"):
                self._rates[rank] = record.get("tokens", 0) / record["interval_s"]
            if rank == 0 and "step" in record:
                self._step = int(record["step"])
        now = time.monotonic()
        news = (self._step, round(sum(self._rates.values()), 1) if self._rates else None)
        if self._step is not None and news != self._said and now - self._said_at >= STATE_EVERY_S:
            self._said_at, self._said = now, news
            step, rate = news
            emit({"state": "running", "step": step, "tokens_per_s": rate, "attempt": self.attempt})

    def open(self, launch_plan: Any) -> None:
        if launch_plan.attempt != self.attempt:  # a restart: other ranks, perhaps fewer
            self._rates.clear()
        super().open(launch_plan)


@dataclass
class DetachedLaunch(Launch):
    """``Launch`` with the run log that writes state lines."""

    def __post_init__(self) -> None:
        self.log = StateLog(self.run_dir, quiet=self.quiet)


def emit(state: dict[str, Any]) -> None:
    """One state line into the job's log (a single write: no other line lands inside it)."""
    sys.stdout.write(job_state.line(state) + "\n")
    sys.stdout.flush()


# -- the queue's inputs ----------------------------------------------------------------------


def _demand(
    job: JobSpec, nodes: list, facts: dict[str, NodeFacts] | None, node_ips: dict[str, str]
) -> dict[str, dict[str, float]]:
    """GPUs per node on cuda, worker processes (CPU slots) per node on cpu; by node address."""
    resource = "GPU" if job.resources.device == "cuda" else "CPU"
    return {
        node_ips[name]: {resource: float(n)} for name, n in worker_counts(job, nodes, facts).items()
    }


def _capacity() -> dict[str, dict[str, float]]:
    import ray

    return {
        n["NodeManagerAddress"]: {r: float(n["Resources"].get(r, 0.0)) for r in ("CPU", "GPU")}
        for n in ray.nodes()
        if n.get("Alive")
    }


def _alive_jobs() -> list[queue.Alive]:
    """The launcher's jobs Ray Jobs reports PENDING or RUNNING (from this node's Jobs API)."""
    from ray.job_submission import JobSubmissionClient

    jobs = JobSubmissionClient("auto").list_jobs()
    return [
        queue.Alive(j.submission_id, (j.metadata or {}).get("name", ""), j.start_time or 0)
        for j in jobs
        if j.submission_id is not None
        and META_KEY in (j.metadata or {})
        and str(j.status.value) in ACTIVE
    ]


def _waiting(reason: str) -> None:
    print(f"Waiting: {reason}", flush=True)
    emit({"state": "pending", "reason": reason})


# -- helpers ----------------------------------------------------------------------------------


def _on_this_node(run_dir: str) -> Path:
    """A run directory given relative (a remote head's default) is under the home directory."""
    path = Path(run_dir).expanduser()
    return path if path.is_absolute() else Path.home() / path


def _leave_upload_out() -> None:
    """The uploaded folder is the driver's alone: drop it from the runtime_env Ray hands the
    driver (``$RAY_JOB_CONFIG_JSON_ENV_VAR``), so the agents do not get it as working_dir."""
    raw = os.environ.get(JOB_CONFIG_ENV)
    if raw:
        config = json.loads(raw)
        (config.get("runtime_env") or {}).pop("working_dir", None)
        os.environ[JOB_CONFIG_ENV] = json.dumps(config)


def _with_shipped_code(job: JobSpec, shipped: Path) -> JobSpec:
    """A script job whose workdir travelled with the submission runs from that copy."""
    entry = job.script_entry
    if entry is None or not shipped.is_dir():
        return job
    workdir = Path(entry.workdir) if entry.workdir is not None else Path(entry.script).parent
    script = shipped / Path(entry.script).relative_to(workdir)
    moved = entry.model_copy(update={"workdir": str(shipped), "script": str(script)})
    return job.model_copy(update={"entrypoint": moved})


def _done(status: Status, summary: dict[str, Any], run_dir: RunDir | None) -> dict[str, Any]:
    """The final state line; ``run_dir`` None: the job's folder was refused, it has none."""
    totals = summary.get("totals") or {}
    return {
        "state": "done",
        "status": status.value,
        "tokens_per_s": totals.get("tokens_per_s"),
        "mfu": totals.get("mfu"),
        "failure": summary.get("failure"),
        "attempt": len(summary.get("restarts") or []),
        "world_size": summary.get("world_size"),
        "run_dir": str(run_dir.root) if run_dir is not None else None,
    }


def _final(job: JobSpec, run_dir: RunDir | None, status: Status, reason: str | None = None) -> None:
    """A job that ended before ``Launch`` wrote its summary: a summary with no ranks that says
    so (none without a run directory), and the final state line."""
    if run_dir is None or not (run_dir.root / "summary.json").is_file():
        failure = {"reason": reason} if reason else None
        summary = summarize(job.name, [], {}, status=status.value, failure=failure)
        if run_dir is not None:
            _quietly(lambda: write_summary(run_dir.root, summary))
    else:
        summary = json.loads((run_dir.root / "summary.json").read_text())
    emit(_done(status, summary, run_dir))


def _keep_ray_lines(run_dir: RunDir) -> None:
    """Ray's own lines of this driver's log (its stdout: the file Ray writes the job's log to)
    into the run directory's ``logs/ray.log``; ``launch logs`` leaves them out."""
    sys.stdout.flush()
    log_file = Path(os.readlink("/proc/self/fd/1"))
    if not log_file.is_file():
        return
    text = log_file.read_text(encoding="utf-8", errors="replace")
    kept = [t + "\n" for t in text.split("\n") if job_state.RAY_LINE.match(t)]
    if kept:
        with open(run_dir.root / "logs" / "ray.log", "a", encoding="utf-8") as fh:
            fh.writelines(kept)


def _quietly(fn: Any) -> None:
    try:
        fn()
    except Exception as err:  # the end of a run: report, never mask what happened
        log.warning("%s", err)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
