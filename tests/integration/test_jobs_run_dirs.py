"""Run directories reserved for detached jobs, with the launcher's real local head and Ray Jobs.
The head is this module's own, as in ``test_jobs_local.py`` (its fixture: its own state dir;
``launch down`` stops it at the end). No job here trains: each is stopped as soon as Ray has it."""

from __future__ import annotations

import json

from test_jobs_local import ROOT, jobs  # noqa: F401  (the fixture: the module's head)


def test_an_ended_jobs_reservation_is_taken_over_and_a_live_or_unknown_one_is_not(jobs, tmp_path):  # noqa: F811
    """A folder still reserved for a job that has ended (its driver never took it) is taken by
    the next submission; the head's Jobs API says so, asked with one request and its token. A
    reservation for a job the head does not know is left alone (exit 2, naming the job)."""
    from launcher.jobs import head as heads
    from launcher.orchestrate.rundir import Reservation

    def submit(run_dir) -> str:
        result = jobs.run("submit", str(ROOT / "jobs/quickstart.yaml"), "--json", "--skip-parity",
                          "--run-dir", str(run_dir))
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        return json.loads(result.stdout.strip().splitlines()[-1])["job_id"]

    def stop(job_id: str) -> None:
        assert jobs.run("stop", job_id, timeout=90).returncode == 0
        assert jobs.status(job_id)["status"] == "STOPPED"

    first = submit(tmp_path / "first")
    stop(first)
    record = heads.reservation_head(heads.LocalHead(**jobs.head()))
    assert heads.reserved_job_status(record, first) == "STOPPED"
    assert heads.reserved_job_status(record, "no-such-job") is None
    assert heads.reserved_job_status({**record, "pid": 1}, first) == heads.GONE

    stale, unknown = tmp_path / "stale", tmp_path / "unknown"
    for folder, job_id in ((stale, first), (unknown, "no-such-job")):
        (folder / "logs").mkdir(parents=True)
        Reservation(job_id, record).write(folder)  # as `launch submit` left it, its driver never ran
    refused = jobs.run("submit", str(ROOT / "jobs/quickstart.yaml"), "--skip-parity", "--run-dir", str(unknown))
    assert refused.returncode == 2 and "is reserved for job no-such-job" in refused.stderr, refused.stderr
    second = submit(stale)
    try:
        assert jobs.status(second)["run_dir"] == str(stale)
        text = (stale / ".launcher-job").read_text() if (stale / ".launcher-job").exists() else second
        assert text.splitlines()[0] == second  # the reservation is the new job's (or its driver took it)
    finally:
        stop(second)
