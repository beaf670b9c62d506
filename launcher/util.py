"""Small helpers that several stages need, each written once. Standard library only: the
trainer (torch + stdlib) and the node agent import it too."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import math
import os
import socket
import threading
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "first_line",
    "free_port",
    "percentile",
    "setup_logging",
    "utc_stamp",
    "write_atomic",
    "write_private",
]


def first_line(err: BaseException) -> str:
    """The first non-empty line of an error's message, for one-paragraph messages and logs.

    Never raises: an exception without a message (``TimeoutError()``) gives its type's name.
    """
    for line in str(err).splitlines():
        if line.strip():
            return line.strip()
    return type(err).__name__


def write_private(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path``, readable by its owner only (0600), whole or not at all: for
    files that hold environment values, which may be secrets, and for the launcher's state (a
    wider existing file is replaced, not reused)."""
    _replace(Path(path), text, private=True)


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all, with the umask's mode. For files that are
    read back (``summary.json``, ``scaling.json``)."""
    _replace(Path(path), text, private=False)


def _replace(path: Path, text: str, *, private: bool) -> None:
    """Into a new file beside ``path``, then renamed over it: a kill or a full disk mid-write
    leaves the previous file, never a truncated one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            if private:
                os.fchmod(fh.fileno(), 0o600)  # O_CREAT's mode applies only to a new file
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def utc_stamp() -> str:
    """Now in UTC as run and study directories are named: ``20261201-084500``."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (q in 0..100), linearly interpolated between order statistics;
    None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def free_port() -> int:
    """A TCP port that is free on every interface of this machine now.

    Bound on all interfaces, so the port also serves a rendezvous other nodes connect to.
    Another process may take it before it is used; callers that bind it soon after accept
    that small race, as torchrun's own ``--master-port`` choice does.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def setup_logging(debug: bool) -> None:
    """The launcher's log output on stderr: messages only, or levels, names and debug records
    with ``--debug``; the chatty libraries at warnings unless debugging."""
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s" if debug else "%(message)s",
    )
    if not debug:
        for noisy in ("ray", "paramiko", "fabric", "invoke", "torch"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
