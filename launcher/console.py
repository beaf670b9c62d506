"""A command's console (stdout, stderr) when its reader goes away or was never there.

Streams closed from the start become /dev/null. A stream whose reader goes while a command
works (``ReaderMayGo``) drops what follows, as the Python docs' SIGPIPE recipe advises.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TextIO


def open_closed_streams() -> None:
    """A stdout or stderr closed when the command started (``2>&-``: Python makes it None)
    becomes /dev/null, so that no file the command opens later takes its descriptor."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        if getattr(sys, name) is not None or _is_open(fd):
            continue
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)
            stream = open(  # noqa: SIM115 - it is the console from now on
                fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False
            )
            setattr(sys, name, stream)


def to_devnull(stream: TextIO) -> None:
    """The recipe: ``stream``'s descriptor to /dev/null, so the flush at exit does not fail again."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def stdout_reader_gone() -> bool:
    """stdout is a pipe whose reader has gone (poll says POLLERR on its write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no fileno (tests), no poll (Windows)
        return False


class ReaderMayGo:
    """A console stream whose reader may go while the command works: from the first
    BrokenPipeError on, what it is given goes to /dev/null instead of raising into the command."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._drop()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, buffer ...
        return getattr(self.stream, name)

    def _drop(self) -> None:
        to_devnull(self.stream)
        with contextlib.suppress(OSError, ValueError):
            self.stream.flush()  # what the broken write left in the buffer, to /dev/null


@contextlib.contextmanager
def reader_may_go() -> Iterator[None]:
    """sys.stdout and sys.stderr as ``ReaderMayGo`` for the block."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (None if s is None else ReaderMayGo(s) for s in saved)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True  # opened since for something else: not ours to take
