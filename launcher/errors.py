"""Every error a user can cause, with its exit code and a message that says what to do.

The CLI catches ``LauncherError`` and prints ``str(err)``: one paragraph, no traceback
(``--debug`` shows it). Anything else reaching the CLI is a bug and keeps its traceback.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_INVALID_INPUT = 2
EXIT_PREFLIGHT = 3
EXIT_JOB_FAILED = 4
EXIT_INTERRUPTED = 130


class LauncherError(Exception):
    """Base class: a user-facing failure with an exit code."""

    exit_code = 1  # str(err) is the message


class SpecError(LauncherError):
    """A job file, cluster file or --set override is invalid (exit 2)."""

    exit_code = EXIT_INVALID_INPUT

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None):
        where = source or "input"
        if field:
            where += f", field '{field}'"
        super().__init__(f"{where}: {message}")
        self.field = field


class UsageError(LauncherError):
    """A bad command line (exit 2)."""

    exit_code = EXIT_INVALID_INPUT


class PreflightError(LauncherError):
    """A node is unreachable, mismatched or lacks what the job needs (exit 3)."""

    exit_code = EXIT_PREFLIGHT


class JobFailed(LauncherError):
    """A worker failed or the job timed out (exit 4)."""

    exit_code = EXIT_JOB_FAILED


class NonFiniteError(JobFailed):
    """The built-in trainer stopped on a non-finite loss or gradient norm
    (``train.on_nonfinite``): the message names the step, what went non-finite and the last
    complete checkpoint. Raised in every worker; the launcher does not restart the run."""


class Interrupted(LauncherError):
    """SIGINT or SIGTERM stopped the launch (exit 130)."""

    exit_code = EXIT_INTERRUPTED


def untrusted_checkpoint(path: object, reason: str) -> str:
    """The paragraph that refuses to resume from ``path`` (a run resumes by unpickling what the
    checkpoint folder holds: whoever can change it runs code as the training user)."""
    return (
        f"refusing to resume from the checkpoint folder: {path} is not safe to load, {reason}. "
        f"Resuming unpickles what that folder holds, so whoever can change it runs code as you. "
        f"Make the folder and its files yours and writable by you alone (`chown -R`, "
        f"`chmod -R go-w`), or set train.checkpoint.resume: never to start fresh"
    )


class UnsafePath(LauncherError):
    """A folder or file the launcher must trust can be changed by another user (exit 2)."""

    exit_code = EXIT_INVALID_INPUT

    def __init__(self, what: str, path: object, reason: str, fix: str):
        super().__init__(
            f"{what} {path} is not safe to use: {reason}, so another user could change what the "
            f"launcher reads or runs from it. {fix}"
        )
        self.path = path


class UntrustedCheckpoint(LauncherError):
    """The checkpoint folder to resume from can be changed by another user (exit 2)."""

    exit_code = EXIT_INVALID_INPUT

    def __init__(self, path: object, reason: str):
        super().__init__(untrusted_checkpoint(path, reason))
