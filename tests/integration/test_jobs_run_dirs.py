"""Run directories reserved for detached jobs, with the launcher's real local head and Ray Jobs.
The head is this module's own, as in ``test_jobs_local.py`` (its fixture: its own state dir;
``launch down`` stops it at the end). No job here trains: each is stopped as soon as Ray has it."""

from __future__ import annotations

import json

from test_jobs_local import ROOT, jobs  # noqa: F401  (the fixture: the module's head)


def test_an_ended_jobs_reservation_is_taken_over_and_a_live_or_unknown_one_is_not(
    jobs,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """A folder still reserved for a job that has ended (its driver never took it) is taken by
    the next submission; the head's Jobs API says so, asked with one request and the token of
    this user's own record of the head, which the reservation names (it records who the head
    is, never how to reach it). A reservation for a job the head does not know is left alone by
    a run; a submission to that head, holding its jobs lock, takes it (its submission was cut
    off before Ray had the job). A run leaves one naming another head that runs alone (exit 2); a submission asks its own
    Jobs API about the job id, which is unique."""
    import os

    from launcher.jobs import head as heads
    from launcher.orchestrate.rundir import Reservation

    def submit(run_dir) -> str:
        result = jobs.run(
            "submit",
            str(ROOT / "jobs/quickstart.yaml"),
            "--json",
            "--skip-parity",
            "--run-dir",
            str(run_dir),
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        return json.loads(result.stdout.strip().splitlines()[-1])["job_id"]

    def stop(job_id: str) -> None:
        assert jobs.run("stop", job_id, timeout=90).returncode == 0
        assert jobs.status(job_id)["status"] == "STOPPED"

    first = submit(tmp_path / "first")
    stop(first)
    monkeypatch.setenv(
        heads.STATE_ENV, jobs.env["LAUNCHER_STATE_DIR"]
    )  # this user's own record: the head's
    me = os.getuid()
    record = heads.reservation_head(heads.LocalHead(**jobs.head()))
    assert "token_file" not in record
    assert heads.reserved_job_status(record, first, owner=me) == "STOPPED"
    assert (
        heads.reserved_job_status(record, "no-such-job", owner=me) is None
    )  # without its jobs lock
    assert heads.reserved_job_status({**record, "pid": 1}, first, owner=me) == heads.GONE
    assert (
        heads.reserved_job_status(record, first, owner=me + 1) is None
    )  # another user's reservation
    another = {
        **record,
        "agent_port": record["agent_port"] + 1,
    }  # runs, and is not the recorded head
    assert heads.reserved_job_status(another, first, owner=me) is None

    stale, cut_off, other = tmp_path / "stale", tmp_path / "cut-off", tmp_path / "other"
    for folder, job_id, head in (
        (stale, first, record),
        (cut_off, "no-such-job", record),
        (other, first, another),
    ):
        (folder / "logs").mkdir(parents=True)
        Reservation(job_id, head).write(folder)  # as `launch submit` left it, its driver never ran
    # a run has no Jobs API to ask; the reservation names a head that is not this user's own
    refused = jobs.run(
        "run", str(ROOT / "jobs/quickstart.yaml"), "--skip-parity", "--run-dir", str(other)
    )
    assert refused.returncode == 2 and f"is reserved for job {first}" in refused.stderr, (
        refused.stderr
    )
    refused = jobs.run(
        "run", str(ROOT / "jobs/quickstart.yaml"), "--skip-parity", "--run-dir", str(cut_off)
    )
    assert refused.returncode == 2 and "is reserved for job no-such-job" in refused.stderr, (
        refused.stderr
    )
    for folder in (stale, cut_off):
        second = submit(folder)
        try:
            assert jobs.status(second)["run_dir"] == str(folder)
            text = (
                (folder / ".launcher-job").read_text()
                if (folder / ".launcher-job").exists()
                else second
            )
            assert (
                text.splitlines()[0] == second
            )  # the reservation is the new job's (or its driver took it)
        finally:
            stop(second)
