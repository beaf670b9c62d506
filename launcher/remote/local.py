"""This machine as a node: commands run as subprocesses, no SSH."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from typing import Any

from launcher.remote.base import INTERNAL, TIMEOUT, CommandResult, NodeError, Runner, short
from launcher.spec.cluster import NodeSpec


class LocalRunner(Runner):
    """This machine: a subprocess in its own process group (killed whole on timeout or close)."""

    def __init__(self, node: NodeSpec):
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen[str]] = set()
        super().__init__(node)

    def run(
        self,
        command: str,
        *,
        stdin: str | None = None,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
    ) -> CommandResult:
        with self._lock:
            if self._closed:
                raise self.closed_error()
            proc = subprocess.Popen(
                self.argv(command),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={**os.environ, **(env or {})},
                encoding="utf-8",  # as SSHRunner decodes: bytes that are not UTF-8 become U+FFFD
                errors="replace",
                start_new_session=True,
            )
            self._procs.add(proc)
        try:
            out, err = proc.communicate(stdin or "", timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop(proc)
            raise NodeError(
                TIMEOUT, f"{short(command)!r} did not finish within {timeout:g} s"
            ) from None
        except BaseException:
            self.stop(proc)
            raise
        finally:
            with self._lock:
                self._procs.discard(proc)
        if self._closed:
            raise NodeError(INTERNAL, f"{short(command)!r} was stopped: the runner was closed")
        return CommandResult(out, err, proc.returncode)

    def argv(self, command: str) -> list[str]:
        """What runs ``command`` (for ``sh``) on the node."""
        return ["/bin/sh", "-c", command]

    def stop(self, proc: subprocess.Popen[Any]) -> None:
        """End a command given up on, and reap it."""
        kill_group(proc)

    def describe(self) -> str:
        return f"{self.node.name} (this machine)"

    def close(self) -> None:
        with self._lock:
            self._closed = True
            running = list(self._procs)
        for proc in running:  # the thread in run() reaps it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)


def kill_group(proc: subprocess.Popen[Any]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=5)
