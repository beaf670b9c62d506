"""What every runner shares: the Runner interface, CommandResult and NodeError with its kinds.

A command that runs and exits non-zero is a CommandResult; failing to reach the node or a
command outliving its timeout raises NodeError, whose ``kind`` the parity table shows.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from launcher.spec.cluster import NodeSpec

# NodeError kinds. The table shows the kind; the message says what to do.
UNREACHABLE = "unreachable"
AUTH_FAILED = "authentication failed"
UNKNOWN_HOST_KEY = "unknown host key"
HOST_KEY_MISMATCH = "HOST KEY MISMATCH"
HOST_KEY_REVOKED = "HOST KEY REVOKED"
TIMEOUT = "timed out"
SSH_ERROR = "ssh error"
INTERPRETER_MISSING = "interpreter missing"
PROBE_CRASHED = "probe crashed"
BAD_JSON = "bad JSON"
INTERNAL = "internal error"


class NodeError(Exception):
    """A node could not do what was asked; ``kind`` is one of the constants above."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class CommandResult:
    """What a command printed and its exit status."""

    stdout: str
    stderr: str
    exit_code: int

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def stderr_tail(self, lines: int = 3, chars: int = 400) -> str:
        """The last lines of stderr, for messages."""
        tail = " | ".join(line.strip() for line in self.stderr.strip().splitlines()[-lines:])
        return tail[-chars:]


class Runner(ABC):
    """Runs shell commands on one node."""

    def __init__(self, node: NodeSpec):
        self.node = node
        self._closed = False
        scope: Any = getattr(fan_out_scope, "scope", None)
        if scope is not None:  # made in a fan-out's thread: closed if the fan-out is interrupted
            scope.add(self)

    @abstractmethod
    def run(
        self,
        command: str,
        *,
        stdin: str | None = None,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
    ) -> CommandResult:
        """Run ``command`` with ``sh`` (over SSH too, whatever the user's login shell);
        ``stdin`` is written then closed (EOF), None gives an empty stdin. Raises NodeError
        when the node cannot be reached or ``timeout`` passes."""

    @abstractmethod
    def describe(self) -> str:
        """``node1 (root@10.0.0.2:22)``: for messages."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection, if any, and give up on a command running now (from any
        thread): that ``run`` and every later one raise NodeError. Whether the command itself
        stops depends on the runner: LocalRunner kills it, SSHRunner does not (see its close)."""

    def closed_error(self, how: str = "is closed") -> NodeError:
        return NodeError(INTERNAL, f"the runner for {self.describe()} {how}")

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# .scope: the fan-out (launcher.remote.fanout) running in this thread; a runner made there is
# closed when that fan-out is interrupted.
fan_out_scope = threading.local()


def short(command: str, limit: int = 60) -> str:
    """``command`` cut to ``limit`` characters, for messages."""
    return command if len(command) <= limit else command[: limit - 1] + "…"
