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

    exit_code = 1

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class SpecError(LauncherError):
    """A job file, cluster file or --set override is invalid (exit 2)."""

    exit_code = EXIT_INVALID_INPUT

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None):
        where = source or "input"
        if field:
            where += f", field '{field}'"
        super().__init__(f"{where}: {message}")
        self.source = source
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


class Interrupted(LauncherError):
    """SIGINT or SIGTERM stopped the launch (exit 130)."""

    exit_code = EXIT_INTERRUPTED
