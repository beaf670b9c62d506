"""A detached job's run directory: marked by its submission (``.launcher-job``, created
exclusively), taken by its driver. See docs/jobs.md, "Run directories of detached jobs".
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

from launcher.errors import UsageError
from launcher.orchestrate.rundir import RunDir

MARKER = ".launcher-job"


def mark(path: Path, job_id: str) -> Callable[[], None]:
    """Make ``path`` (new or empty: UsageError otherwise) and mark it for ``job_id``. Returns
    the undo, for a submission that fails before Ray has the job."""
    refuse_used(path)
    made = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:  # another submission marked it between the look and the open
        raise _refusal(path, marked_for(path) or "?") from None
    except OSError as err:
        raise UsageError(
            f"cannot write the run directory {path}: {err.strerror or err}; pass --run-dir a "
            f"folder you can write"
        ) from err
    with os.fdopen(fd, "w") as fh:
        fh.write(job_id + "\n")

    def undo() -> None:
        if marked_for(path) == job_id:
            (path / MARKER).unlink(missing_ok=True)
        for folder in made:  # innermost first; one that something was put into stays
            with contextlib.suppress(OSError):
                folder.rmdir()

    return undo


def take(path: Path, job_id: str) -> RunDir:
    """The driver's claim: the folder its own submission marked (the marker goes), else a
    new or empty one (``RunDir.claim``). UsageError (exit 2) for anything else."""
    if marked_for(path) == job_id:
        (path / MARKER).unlink()
    else:
        refuse_used(path)
    return RunDir.claim(path)


def refuse_used(path: Path) -> None:
    """UsageError (exit 2) where ``path`` is marked for a job or holds anything."""
    other = marked_for(path)
    if other is not None:
        raise _refusal(path, other)
    RunDir.refuse_used(path)


def marked_for(path: Path) -> str | None:
    """The job id that ``path``'s marker names; None without a readable marker."""
    try:
        return (path / MARKER).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _refusal(path: Path, job_id: str) -> UsageError:
    return UsageError(
        f"--run-dir {path} is marked for job {job_id}, submitted before with the same --run-dir "
        f"(`launch status {job_id}`): a run directory holds one run. Pick a new folder for "
        f"--run-dir (or leave it out), or remove it if that job has ended; nothing was started"
    )
