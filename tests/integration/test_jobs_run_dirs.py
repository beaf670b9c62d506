"""Run directories of detached jobs, with the launcher's real local head and Ray Jobs.
The head is this module's own, as in ``test_jobs_local.py`` (its fixture: its own state dir;
``launch down`` stops it at the end). No job here trains: each is stopped as soon as Ray has it."""

from __future__ import annotations

import json
import shutil

import pytest
from test_jobs_local import ROOT, jobs  # noqa: F401  (the fixture: the module's head)

pytestmark = pytest.mark.ray


def test_a_run_dir_marked_for_a_job_is_refused_until_it_is_removed(
    jobs,  # noqa: F811
    tmp_path,
):
    """The first submission marks the folder for its job; a second one given the same
    --run-dir is refused (exit 2, naming the remedy) while the folder is there, also after the
    first job ended; removed, the folder is the next job's."""
    folder = tmp_path / "shared"

    def submit():
        return jobs.run(
            "submit",
            str(ROOT / "jobs/quickstart.yaml"),
            "--json",
            "--skip-parity",
            "--run-dir",
            str(folder),
        )

    def stop(job_id: str) -> None:
        assert jobs.run("stop", job_id, timeout=90).returncode == 0
        assert jobs.status(job_id)["status"] == "STOPPED"

    result = submit()
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    first = json.loads(result.stdout.strip().splitlines()[-1])["job_id"]
    refused = submit()
    assert refused.returncode == 2, refused.stderr
    assert f"--run-dir {folder}" in refused.stderr and "remove" in refused.stderr
    stop(first)
    assert submit().returncode == 2  # the folder is still there: one run per folder
    shutil.rmtree(folder)
    result = submit()
    assert result.returncode == 0, result.stderr[-2000:]
    second = json.loads(result.stdout.strip().splitlines()[-1])["job_id"]
    try:
        assert jobs.status(second)["run_dir"] == str(folder)
    finally:
        stop(second)
