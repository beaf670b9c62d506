"""From what an agent saw to a ``Failure``: which rank, how it ended, and its last lines.

A failed rank is named from the structured error file torchrun has each worker write
(``@record``: exception, message, traceback, timestamp; the built-in trainer's entry is wrapped).
Scripts that write none are named from torchrun's own "Root Cause" report, the fallback. A
lost node and a hung rank are named by the watch loop and described here.
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


def _signal_name(code: int | None) -> str | None:
    if code is None or code >= 0:
        return None
    with contextlib.suppress(ValueError):
        return signal.Signals(-code).name
    return None
