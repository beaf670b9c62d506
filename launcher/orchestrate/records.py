"""Typed records of a launch: what an agent reports, how a run failed, how it ended.

They travel between the node agents and the driver (Ray pickles them) and are what the
summary is written from: ``Failure.to_json()`` is ``summary.json``'s ``failure``.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


class Status(str, enum.Enum):
    """How a run ended (``summary.json``'s ``status``)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class ExitStatus:
    """How a node's torchrun ended."""

    exit_code: int
    signal: str | None = None  # the signal that ended torchrun itself, if one did
    stopped: bool = False  # the launcher stopped it


@dataclass(frozen=True)
class RankError:
    """One worker's uncaught exception, from the error file torchrun's ``@record`` writes
    (a script without it writes none: torchrun's own report is read instead)."""

    local_rank: int
    message: str
    traceback: str = ""
    timestamp: float = 0.0


@dataclass(frozen=True)
class AgentUpdate:
    """One poll of a node agent: output lines since the last poll, metrics records, GPU telemetry
    samples, the exit."""

    # (local rank or None: torchrun's own, stream "out" or "err", text)
    lines: list[tuple[int | None, str, str]] = field(default_factory=list)
    records: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (global rank, record)
    exit: ExitStatus | None = None
    telemetry: list[dict[str, Any]] = field(default_factory=list)  # one per GPU and sample


class FailureKind(str, enum.Enum):
    RANK = "rank"  # a worker exited non-zero or was killed
    NONFINITE = "nonfinite"  # the built-in trainer stopped on a non-finite loss or gradient norm
    LOST_NODE = "lost_node"  # a node's agent stopped answering
    HANG = "hang"  # a rank wrote no record for launch.hang_timeout_s
    LAUNCHER = "launcher"  # the launch itself failed (placement, Ray)


@dataclass(frozen=True)
class Failure:
    """The first failure of a run: who, how, and the sentence that says it."""

    kind: FailureKind
    reason: str
    rank: int | None = None
    node: str | None = None
    host: str | None = None
    exit_code: int | None = None
    signal: str | None = None
    log_tail: str = ""

    @property
    def restartable(self) -> bool:
        """A failed rank may be restarted (``launch.max_restarts``); a lost node or a hang stop the
        job, and so does a non-finite step (a restart would train the same steps again)."""
        return self.kind is FailureKind.RANK

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "kind"}


@dataclass
class Outcome:
    """How a launch ended, and where its record is."""

    status: Status
    run_dir: Path
    failure: Failure | None = None
    summary: dict[str, Any] | None = None
