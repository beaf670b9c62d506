"""A node of a Slurm allocation: every command is a job step, ``srun --overlap`` pinned to it.

No SSH: the step runs beside whatever else runs in the allocation. ``expand_nodelist``
reads Slurm's compact host lists (``gpu[01-03,07],login1``).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from typing import Any

from launcher.remote.local import LocalRunner, kill_group

STOP_GRACE_S = 5.0  # srun forwards SIGTERM to the step, then gets SIGKILL
_GROUP = re.compile(r"\[([^\]]*)\]")
_ITEM = re.compile(r"(?:[^,\[\s]|\[[^\]]*\])+")  # a host or pattern: commas inside [] stay


class SrunRunner(LocalRunner):
    """Runs each command as a one-task step on ``node`` of job ``node.slurm_job``."""

    def argv(self, command: str) -> list[str]:
        """``srun`` pinned to this node of the job, one task, sharing the job's resources."""
        pinned = [f"--jobid={self.node.slurm_job}", f"--nodelist={self.node.name}"]
        step = ["srun", "--overlap", *pinned, "--nodes=1", "--ntasks=1", "--quiet"]
        return [*step, "/bin/sh", "-c", command]

    def spawn(self, command: str, log: str) -> subprocess.Popen[bytes]:
        """``command`` as a step that runs on (a daemon's life, e.g. ``ray start --block``):
        its output goes to the file ``log`` on this machine; end it with ``stop``."""
        with open(log, "ab") as out:
            return subprocess.Popen(
                self.argv(command),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self, proc: subprocess.Popen[Any]) -> None:
        """SIGTERM first: srun passes it on and ends the step; SIGKILL of srun alone would
        leave the step running on the node."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            kill_group(proc)

    def describe(self) -> str:
        return f"{self.node.name} (Slurm job {self.node.slurm_job})"


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's host list expanded as ``scontrol show hostnames`` does: ``n[1-3,7]`` → n1 n2 n3
    n7, zero padding kept (``gpu[08-10]``), several bracket groups multiplied out."""
    names: list[str] = []
    for item in _ITEM.findall(nodelist):
        expanded = [""]
        pos = 0
        for match in _GROUP.finditer(item):
            prefix = item[pos : match.start()]
            choices = [v for part in match.group(1).split(",") for v in _range(part)]
            expanded = [e + prefix + c for e in expanded for c in choices]
            pos = match.end()
        names += [e + item[pos:] for e in expanded]
    return names


def _range(part: str) -> list[str]:
    if "-" not in part:
        return [part]
    low, high = part.split("-", 1)
    width = len(low) if low.startswith("0") else 0
    return [str(i).zfill(width) for i in range(int(low), int(high) + 1)]
