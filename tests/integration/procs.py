"""Process bookkeeping for integration tests: what a test started must be gone after it."""

from __future__ import annotations

import contextlib
import os
import time

PATTERNS = ("raylet", "gcs_server", "torch.distributed.run", "launcher.train", "custom_train.py")


def matching(extra: tuple[str, ...] = ()) -> dict[int, str]:
    """pid → command line of every live process whose command line contains a pattern."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{entry}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        if cmd and any(p in cmd for p in (*PATTERNS, *extra)):
            out[int(entry)] = cmd
    return out


def assert_none_left(before: dict[int, str], *, marker: str | None = None, wait_s: float = 15.0) -> None:
    """No process matching the patterns exists now that did not exist in ``before``."""
    deadline = time.monotonic() + wait_s
    while True:
        left = {pid: cmd for pid, cmd in matching((marker,) if marker else ()).items() if pid not in before}
        if marker:
            left = {pid: cmd for pid, cmd in left.items()
                    if marker in cmd or any(p in cmd for p in ("raylet", "gcs_server"))}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, f"left running: {left}"


def kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
