"""``launch submit`` to a ``slurm:`` cluster: an sbatch job that runs the same launch inside
its allocation, and ``status | logs | stop | list`` on its Slurm job id (docs/clusters.md).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from launcher.errors import PreflightError, UsageError
from launcher.jobs import records
from launcher.jobs import state as job_state
from launcher.orchestrate.rundir import BATCH_ENV, BATCH_OUTPUT, BATCH_SCRIPT, DEFAULT_BASE
from launcher.orchestrate.slurm import check_partition, request_options, require_commands
from launcher.spec import ClusterSpec, JobSpec
from launcher.util import utc_stamp, write_private

POLL_S = 1.0
STOP_WAIT_S = 120.0  # after SIGINT, how long the launch inside gets to stop and summarize
SLURM_PENDING = ("PENDING", "CONFIGURING", "REQUEUED")  # squeue's states Ray Jobs calls PENDING
SUMMARY_STATES = {"succeeded": "SUCCEEDED", "failed": "FAILED", "interrupted": "STOPPED"}


def submit(
    job: JobSpec,
    cluster: ClusterSpec,
    *,
    job_file: str,
    cluster_file: str,
    overrides: list[str],
    run_dir: Path | None,
    skip_parity: bool,
    as_json: bool,
) -> dict[str, Any]:
    """Write the batch script into the run directory and ``sbatch`` it; the job id."""
    from launcher.jobs import claim

    spec = cluster.slurm
    assert spec is not None
    require_commands()
    if job.resources.nodes == "all":
        raise UsageError(
            "resources.nodes is 'all', but a batch job must ask Slurm for a number of nodes: "
            "set resources.nodes to a number"
        )
    check_partition(spec)
    where = (run_dir or DEFAULT_BASE / f"{job.name}-{utc_stamp()}").absolute()
    claim.refuse_used(where)
    where.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "launcher", "run", str(Path(job_file).absolute())]
    argv += ["--cluster", str(Path(cluster_file).absolute()), "--run-dir", str(where)]
    argv += [a for o in overrides for a in ("--set", o)]
    argv += ["--skip-parity"] if skip_parity else []
    script = where / BATCH_SCRIPT
    script.write_text(
        "#!/bin/sh\n"
        "# Written by `launch submit`: the launch below runs inside this job's allocation.\n"
        f"export {BATCH_ENV}=1\n"
        f"exec {shlex.join(argv)}\n"
    )
    sbatch = ["sbatch", "--parsable", f"--output={where / BATCH_OUTPUT}", f"--chdir={where}"]
    sbatch += [*request_options(job, spec, int(job.resources.nodes)), str(script)]
    done = subprocess.run(sbatch, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise PreflightError(
            f"sbatch refused the job (exit {done.returncode}): {done.stderr.strip()[-300:]}"
        )
    job_id = done.stdout.strip().split(";")[0]
    record = {"job_id": job_id, "name": job.name, "run_dir": str(where), "stopped": False}
    write_private(_record_path(job_id), json.dumps(record) + "\n")
    out = {"job_id": job_id, "name": job.name, "cluster": cluster_file, "run_dir": str(where)}
    if as_json:
        print(json.dumps(out), flush=True)
    else:
        flag = f" --cluster {shlex.quote(cluster_file)}"
        print(
            f"Submitted Slurm job {job_id}; run directory {where}\nFollow it:\n"
            f"  launch status {job_id}{flag}\n  launch logs {job_id} --follow{flag}\n"
            f"  launch stop {job_id}{flag}",
            flush=True,
        )
    return out


def state(job_id: str) -> dict[str, Any]:
    """``launch status ID --json``'s fields for a batch job, from squeue and its run directory."""
    record = _record(job_id)
    run_dir = Path(record["run_dir"])
    queued = _squeue(job_id)
    summary = _summary(run_dir)
    if queued is not None:
        status = "PENDING" if queued[0] in SLURM_PENDING else "RUNNING"
    elif record.get("stopped"):
        status = "STOPPED"
    else:
        status = SUMMARY_STATES.get(str(summary.get("status")), "FAILED")
    totals = summary.get("totals") or {}
    steps = [r.get("steps") for r in summary.get("ranks", []) if r.get("steps")]
    return {
        "job_id": job_id,
        "name": record["name"],
        "status": status,
        "world_size": summary.get("world_size"),
        "step": max(steps) if steps else None,
        "tokens_per_s": totals.get("tokens_per_s"),
        "mfu": totals.get("mfu"),
        "run_dir": str(run_dir),
        "failure": summary.get("failure"),
        "reason": queued[1] if queued is not None and status == "PENDING" else None,
    }


def status(job_id: str | None, *, as_json: bool) -> int:
    """One job's state, or every batch job's (``list``)."""
    if job_id is None:
        return list_jobs(as_json=as_json)
    row = state(job_id)
    print(json.dumps(job_state.to_json(row)) if as_json else _line(row), flush=True)
    return 0


def list_jobs(*, as_json: bool) -> int:
    """Every batch job this user submitted, newest first."""
    folder = _records_dir()
    ids = sorted((p.stem for p in folder.glob("*.json")), key=_id_order, reverse=True)
    rows = [state(i) for i in ids]
    if as_json:
        print(json.dumps([job_state.to_json(r) for r in rows]))
    else:
        print("\n".join(_line(r) for r in rows) or "no batch jobs", flush=True)
    return 0


def logs(job_id: str, *, follow: bool) -> int:
    """Slurm's output of the job (the launch's console); with ``follow`` until the job ends."""
    path = Path(_record(job_id)["run_dir"]) / BATCH_OUTPUT
    offset = 0
    while True:
        if path.exists():
            with path.open("rb") as fh:
                fh.seek(offset)
                data = fh.read()
            offset += len(data)
            sys.stdout.write(data.decode(errors="replace"))
            sys.stdout.flush()
        if not follow:
            return 0
        if _squeue(job_id) is None:
            if path.exists() and path.stat().st_size > offset:
                continue  # what was written before the job left the queue
            print(f"job {job_id} ended: {state(job_id)['status']}", flush=True)
            return 0
        time.sleep(POLL_S)


def stop(job_id: str) -> int:
    """SIGINT to the launch inside the job (as Ctrl-C to a foreground run: it stops every
    worker and writes its summary), then the job is cancelled once it has ended or after
    ``STOP_WAIT_S``."""
    record = _record(job_id)
    if _squeue(job_id) is None:
        print(f"job {job_id} has already ended ({state(job_id)['status']}); nothing to stop")
        return 0
    record["stopped"] = True
    write_private(_record_path(job_id), json.dumps(record) + "\n")
    subprocess.run(["scancel", "--batch", "--signal=INT", job_id], capture_output=True, timeout=60)
    print(f"Stopping Slurm job {job_id}: the launch in it stops every worker", flush=True)
    deadline = time.monotonic() + STOP_WAIT_S
    while _squeue(job_id) is not None and time.monotonic() < deadline:
        time.sleep(POLL_S)
    subprocess.run(["scancel", job_id], capture_output=True, timeout=60)
    while _squeue(job_id) is not None:
        time.sleep(POLL_S)
    print(f"job {job_id} stopped", flush=True)
    return 0


# -- helpers --------------------------------------------------------------------------------


def _records_dir() -> Path:
    folder = records.state_dir() / "slurm"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def _record_path(job_id: str) -> Path:
    return _records_dir() / f"{job_id}.json"


def _record(job_id: str) -> dict[str, Any]:
    if not job_id.isdigit() or not _record_path(job_id).is_file():
        known = ", ".join(sorted(p.stem for p in _records_dir().glob("*.json"))) or "none"
        raise UsageError(
            f"no batch job {job_id!r} submitted from here; known Slurm job ids: {known}"
        )
    return dict(json.loads(_record_path(job_id).read_text()))


def _squeue(job_id: str) -> tuple[str, str] | None:
    """(state, reason) while Slurm has the job in its queue, else None."""
    done = subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%T|%r"], capture_output=True, text=True, timeout=60
    )
    line = done.stdout.strip()
    if done.returncode != 0 or not line:
        return None
    slurm_state, _, reason = line.partition("|")
    return slurm_state, reason


def _summary(run_dir: Path) -> dict[str, Any]:
    """The run's summary; empty while it has none."""
    try:
        return dict(json.loads((run_dir / "summary.json").read_text()))
    except (OSError, ValueError):
        return {}


def _line(row: dict[str, Any]) -> str:
    extra = f" — {row['reason']}" if row.get("reason") else ""
    return f"job {row['job_id']} ({row['name']}): {row['status']}{extra} · {row['run_dir']}"


def _id_order(job_id: str) -> int:
    return int(job_id) if job_id.isdigit() else -1
