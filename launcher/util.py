"""Small helpers the launcher's modules share. Standard library only."""

from __future__ import annotations

import datetime as dt
import os
import socket
from pathlib import Path


def first_line(err: BaseException) -> str:
    """An exception's first non-empty line, or its type's name when it has no message."""
    for line in str(err).splitlines():
        if line.strip():
            return line.strip()
    return type(err).__name__


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (files that hold environment values)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def utc_stamp() -> str:
    """``yyyymmdd-HHMMSS`` in UTC: the suffix of run and study directory names."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
