"""From what an agent saw to a ``Failure``: which rank, how it ended, and its last lines.

A failed rank is named from the structured error file torchrun has each worker write
(``@record``: exception, message, traceback, timestamp; the built-in trainer's entry is wrapped).
Scripts that write none are named from torchrun's own "Root Cause" report, the fallback. That
report times failures to the second and names the lowest rank on a tie, so when one rank
crashes and its peers fail on the broken connection within the same second, it may name an
echo. Among the ranks its report lists with the root cause's second, the first whose log does
not end in a peer's failure ("Connection closed by peer", ...) is named instead. A lost node and
a hung rank are named by the watch loop and described here.
"""

from __future__ import annotations

import contextlib
import re
import signal
from typing import Protocol

from launcher.orchestrate.plan import NodePlan
from launcher.orchestrate.records import ExitStatus, Failure, FailureKind, RankError
from launcher.util import first_line

ROOT_CAUSE_RANK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
ROOT_CAUSE_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")
REPORT_ENTRY = re.compile(r"\[\d+\]:\s*$")  # "[1]:" opens a failure's block in torchrun's report
REPORT_TIME = re.compile(r"\btime\s*:\s*(\S+)")
# What a rank's last lines say when it failed because a peer did (gloo, NCCL, sockets).
PEER_FAILED = re.compile(r"Connection (closed|reset) by peer|caused by a remote worker crashing|"
                         r"remote process exited|ncclRemoteError|Broken pipe", re.IGNORECASE)
TORCHRUN_LINES = 200
TAIL_LINES = 20


class Tails(Protocol):
    """What diagnosis asks of the agents (``agents.AgentGroup``, or a fake in tests)."""

    def tail(self, i: int, local_rank: int | None, n: int) -> list[str]: ...

    def errors(self, i: int) -> list[RankError]: ...


def rank_failure(agents: Tails, i: int, node: NodePlan, status: ExitStatus) -> Failure:
    """Agent ``i``'s torchrun exited non-zero: name the rank that failed first."""
    report = agents.tail(i, None, TORCHRUN_LINES)
    rank, local_rank, code = _root_cause(report)
    if rank is not None and local_rank is not None:
        rank, local_rank, code = _not_an_echo(agents, i, _failures(report), (rank, local_rank, code))
    errors = [e for e in agents.errors(i) if e.local_rank < node.nproc]
    first = errors[0] if errors else None  # the structured record wins over the text
    if first is not None:
        rank, local_rank = node.rank_of(first.local_rank), first.local_rank
    code = status.exit_code if code is None else code
    signal_name = _signal_name(code) or status.signal
    if first is not None:
        how = f"raised {first.message}"
    else:
        how = "exited with " + (f"signal {signal_name}" if signal_name else f"code {code}")
    tail = agents.tail(i, local_rank, TAIL_LINES) if local_rank is not None else report[-TAIL_LINES:]
    if first is not None and first.traceback and not any("Traceback" in line for line in tail):
        tail = first.traceback.rstrip("\n").splitlines()[-TAIL_LINES:]
    who = f"rank {rank if rank is not None else '?'} on node {node.name} ({node.host})"
    return Failure(kind=FailureKind.RANK, reason=f"{who} {how}", rank=rank, node=node.name,
                   host=node.host, exit_code=code, signal=signal_name, log_tail="\n".join(tail))


def lost_node(node: NodePlan, err: BaseException) -> Failure:
    return Failure(kind=FailureKind.LOST_NODE, rank=node.ranks[0] if node.ranks else None,
                   node=node.name, host=node.host,
                   reason=f"node {node.name} ({node.host}) was lost: its agent stopped answering "
                          f"({first_line(err)})")


def hung_rank(node: NodePlan, rank: int, quiet_s: float, limit_s: float, tail: list[str]) -> Failure:
    return Failure(kind=FailureKind.HANG, rank=rank, node=node.name, host=node.host, log_tail="\n".join(tail),
                   reason=f"rank {rank} on node {node.name} made no progress (no metrics record) for "
                          f"{quiet_s:.0f} s > launch.hang_timeout_s={limit_s:g}")


def _root_cause(lines: list[str]) -> tuple[int | None, int | None, int | None]:
    """(rank, local rank, exit code) from torchrun's last "Root Cause" block, where there is one."""
    starts = [i for i, line in enumerate(lines) if "Root Cause" in line]
    rank = local_rank = code = None
    for line in lines[starts[-1]:] if starts else []:  # after a restart the tail holds earlier blocks
        if (m := ROOT_CAUSE_RANK.search(line)) and rank is None:
            rank, local_rank = int(m.group(1)), int(m.group(2))
        elif (m := ROOT_CAUSE_EXIT.search(line)) and rank is not None:
            code = int(m.group(1))
            break
    return rank, local_rank, code


def _failures(lines: list[str]) -> list[tuple[str | None, int, int, int | None]]:
    """(time, rank, local rank, exit code) of every failure in torchrun's last report, the root
    cause last."""
    starts = [i for i, line in enumerate(lines) if "Failures:" in line]
    entries: list[list] = []
    for line in lines[starts[-1]:] if starts else []:
        if REPORT_ENTRY.search(line):
            entries.append([None, None, None, None])
        elif entries and (m := REPORT_TIME.search(line)):
            entries[-1][0] = m.group(1)
        elif entries and (m := ROOT_CAUSE_RANK.search(line)):
            entries[-1][1], entries[-1][2] = int(m.group(1)), int(m.group(2))
        elif entries and (m := ROOT_CAUSE_EXIT.search(line)):
            entries[-1][3] = int(m.group(1))
    return [(t, r, lr, c) for t, r, lr, c in entries if r is not None]


def _not_an_echo(agents: Tails, i: int, failures: list[tuple[str | None, int, int, int | None]],
                 root: tuple[int, int, int | None]) -> tuple[int, int, int | None]:
    """The root cause (rank, local rank, exit code), or, where its log shows a peer's failure,
    the first rank torchrun saw fail in the same second whose log does not."""
    times = [when for when, _, local_rank, _ in failures if local_rank == root[1]]
    if not times or times[-1] is None:
        return root

    def echo(local_rank: int) -> bool:
        return any(PEER_FAILED.search(line) for line in agents.tail(i, local_rank, TAIL_LINES))

    tied = [(rank, local_rank, code) for when, rank, local_rank, code in failures
            if when == times[-1] and local_rank != root[1]]
    if tied and echo(root[1]):
        return next((f for f in tied if not echo(f[1])), root)
    return root


def _signal_name(code: int | None) -> str | None:
    if code is None or code >= 0:
        return None
    with contextlib.suppress(ValueError):
        return signal.Signals(-code).name
    return None
