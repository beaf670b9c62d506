"""Ends a node's torchrun and its workers when the agent that started them is gone.

    python reaper.py TORCHRUN_PID GRACE_S AGENT_PID NODE_DIR

Standard library only, run by its file path. The /proc helpers here are also the agent's.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import sys
import time

POLL_S = 0.2


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (torchrun's workers run in sessions of their own)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(entry)):
            children[int(fields[1])].append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def started(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot): with the pid, a process's identity (a pid
    alone may have been reused). None when it is gone."""
    fields = _stat(pid)
    return int(fields[19]) if len(fields) > 19 else None


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def alive(pid: int) -> bool:
    """Running (a zombie is not)."""
    fields = _stat(pid)
    return bool(fields) and fields[0] != "Z"


def _stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first); none when the
    process is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def wait_gone(pids: list[int], grace_s: float) -> None:
    """Return once none of ``pids`` is alive, or after ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(POLL_S / 2)


def kill_after(pid: int, grace_s: float, family: list[int] | None = None) -> None:
    """Give ``pid`` and its descendants (and ``family``, those seen before: a worker whose
    torchrun has exited is no descendant any more) ``grace_s`` to exit, then SIGKILL every one left."""
    family = family or [pid, *descendants(pid)]
    wait_gone(family, grace_s)
    signal_all([p for p in [pid, *descendants(pid), *family] if alive(p)], signal.SIGKILL)


def end_noted(noted: dict[int, int], grace_s: float) -> None:
    """SIGTERM to the noted processes (pid → start time) still running, the same pid and start
    time (never a process that took a dead one's pid), SIGKILL to those left after ``grace_s``."""
    left = [pid for pid, start in noted.items() if alive(pid) and started(pid) == start]
    signal_all(left, signal.SIGTERM)
    wait_gone(left, grace_s)
    signal_all([p for p in left if alive(p) and started(p) == noted[p]], signal.SIGKILL)


def main(argv: list[str]) -> int:
    pid, grace_s, agent, node_dir = int(argv[0]), float(argv[1]), int(argv[2]), argv[3]
    agent_gone: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: agent_gone.append(signum))
    while alive(pid):
        if agent_gone or os.getppid() != agent:
            kill_after(pid, grace_s)
            shutil.rmtree(node_dir, ignore_errors=True)
            return 0
        time.sleep(POLL_S)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
