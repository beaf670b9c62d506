"""From what an agent saw to a ``Failure``: which rank, how it ended, and its last lines."""

from __future__ import annotations

import contextlib
import re
import signal
from typing import Protocol

from launcher.errors import NonFiniteError
from launcher.orchestrate.plan import NodePlan
from launcher.orchestrate.records import ExitStatus, Failure, FailureKind, RankError
from launcher.util import first_line

ROOT_CAUSE_RANK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
ROOT_CAUSE_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")
REPORT_ENTRY = re.compile(r"\[\d+\]:\s*$")  # "[1]:" opens a failure's block in torchrun's report
REPORT_TIME = re.compile(r"\btime\s*:\s*(\S+)")
# What a rank's last lines say when it failed because a peer did (gloo, NCCL, sockets).
PEER_FAILED = re.compile(
    r"Connection (closed|reset) by peer|caused by a remote worker crashing|"
    r"remote process exited|ncclRemoteError|Broken pipe",
    re.IGNORECASE,
)
TORCHRUN_LINES = 200
TAIL_LINES = 20


class Tails(Protocol):
    """What diagnosis asks of the agents (``agents.AgentGroup``, or a fake in tests)."""

    def tail(self, i: int, local_rank: int | None, n: int) -> list[str]: ...

    def errors(self, i: int) -> list[RankError]: ...


def rank_failure(agents: Tails, i: int, node: NodePlan, status: ExitStatus) -> Failure:
    """Agent ``i``'s torchrun exited non-zero: name the rank that failed first."""
    report = agents.tail(i, None, TORCHRUN_LINES)
    others, root = _report(report)
    rank = local_rank = code = None
    if root is not None:
        _, rank, local_rank, code = _not_an_echo(agents, i, others, root)
    errors = [e for e in agents.errors(i) if e.local_rank < node.nproc]
    first = errors[0] if errors else None  # the structured record wins over the text
    code = status.exit_code if code is None else code
    signal_name = _signal_name(code) or status.signal
    how = "exited with " + (f"signal {signal_name}" if signal_name else f"code {code}")
    if first is not None:
        rank, local_rank = node.ranks[first.local_rank], first.local_rank
        how = f"raised {first.message}"
    tail = (
        agents.tail(i, local_rank, TAIL_LINES) if local_rank is not None else report[-TAIL_LINES:]
    )
    if first is not None and first.traceback and not any("Traceback" in line for line in tail):
        tail = first.traceback.rstrip("\n").splitlines()[-TAIL_LINES:]
    who = f"rank {rank if rank is not None else '?'} on node {node.name} ({node.host})"
    diverged = first is not None and first.message.startswith(f"{NonFiniteError.__name__}: ")
    return Failure(
        kind=FailureKind.NONFINITE if diverged else FailureKind.RANK,
        reason=f"{who} {how}",
        rank=rank,
        node=node.name,
        host=node.host,
        exit_code=code,
        signal=signal_name,
        log_tail="\n".join(tail),
    )


def lost_node(node: NodePlan, err: BaseException) -> Failure:
    return Failure(
        kind=FailureKind.LOST_NODE,
        rank=node.ranks[0] if node.ranks else None,
        node=node.name,
        host=node.host,
        reason=f"node {node.name} ({node.host}) was lost: its agent stopped answering "
        f"({first_line(err)})",
    )


def hung_rank(
    node: NodePlan, rank: int, quiet_s: float, limit_s: float, tail: list[str], *, where: str = ""
) -> Failure:
    """``where``: what its stack shows (the collective it is not in, its top frames)."""
    return Failure(
        kind=FailureKind.HANG,
        rank=rank,
        node=node.name,
        host=node.host,
        log_tail="\n".join(tail),
        reason=f"rank {rank} on node {node.name} made no progress (no metrics record) for "
        f"{quiet_s:.0f} s > launch.hang_timeout_s={limit_s:g}"
        + (f"; {where} (every rank's stack is in stacks/)" if where else ""),
    )


# a failure in torchrun's report: time, rank, local rank, exit code
Entry = tuple[str | None, int, int, int | None]


def _report(lines: list[str]) -> tuple[list[Entry], Entry | None]:
    """The other failures and the root cause of torchrun's last report (after a restart the
    tail holds earlier ones), where there is one."""
    roots = [i for i, line in enumerate(lines) if "Root Cause" in line]
    if not roots:
        return [], None
    at = roots[-1]
    others_at = max((i for i in range(at) if "Failures:" in lines[i]), default=at)
    root = _entries(lines[at:])[:1]
    return _entries(lines[others_at:at]), (root[0] if root else None)


def _entries(lines: list[str]) -> list[Entry]:
    """The failure blocks in these lines of the report, in order ("[1]:" opens one, where it
    is printed; a second rank line opens the next)."""
    entries: list[list] = []
    for line in lines:
        if REPORT_ENTRY.search(line):
            entries.append([None, None, None, None])
        elif entries and (m := REPORT_TIME.search(line)):
            entries[-1][0] = m.group(1)
        elif m := ROOT_CAUSE_RANK.search(line):
            if not entries or entries[-1][1] is not None:
                entries.append([None, None, None, None])
            entries[-1][1], entries[-1][2] = int(m.group(1)), int(m.group(2))
        elif (
            entries
            and entries[-1][1] is not None
            and entries[-1][3] is None
            and (m := ROOT_CAUSE_EXIT.search(line))
        ):
            entries[-1][3] = int(m.group(1))
    return [(t, r, lr, c) for t, r, lr, c in entries if r is not None]


def _not_an_echo(agents: Tails, i: int, others: list[Entry], root: Entry) -> Entry:
    """The root cause, or, where its log shows a peer's failure, the first other rank torchrun
    saw fail in the same second whose log does not."""

    def echo(local_rank: int) -> bool:
        return any(PEER_FAILED.search(line) for line in agents.tail(i, local_rank, TAIL_LINES))

    tied = [f for f in others if root[0] is not None and f[0] == root[0] and f[2] != root[2]]
    if tied and echo(root[2]):
        return next((f for f in tied if not echo(f[2])), root)
    return root


def _signal_name(code: int | None) -> str | None:
    if code is None or code >= 0:
        return None
    with contextlib.suppress(ValueError):
        return signal.Signals(-code).name
    return None
