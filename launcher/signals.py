"""SIGINT and SIGTERM stop the launch (exit 130), even when Python drops the exception.

The handler remembers the signal, and ``check()`` raises it again at every stage boundary.
``ctrl_c_spared`` keeps a terminal's Ctrl-C from the processes started within it (Ray's).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

_pending: int | None = None
_previous_unraisablehook = sys.unraisablehook


def install() -> None:
    """Route SIGINT and SIGTERM to :func:`_interrupt` (main thread only) and forget old ones."""
    global _pending, _previous_unraisablehook
    _pending = None
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    if sys.unraisablehook is not _unraisable:
        _previous_unraisablehook = sys.unraisablehook
        sys.unraisablehook = _unraisable


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """:func:`install` for the block; the handlers and hook found before are put back after it
    (``launcher.cli.main`` called in a process that goes on: a test, a notebook)."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    hook = sys.unraisablehook
    install()
    try:
        yield
    finally:
        global _pending
        for s, handler in handlers.items():
            signal.signal(s, handler)
        sys.unraisablehook = hook
        _pending = None


def _interrupt(signum: int, frame: FrameType | None) -> None:
    global _pending
    _pending = signum
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def _unraisable(unraisable: sys.UnraisableHookArgs) -> None:
    """Drop our own interrupt silently (``check()`` raises it again); everything else goes to
    the hook that was there before."""
    dropped = unraisable.exc_type
    if _pending is not None and dropped is not None and issubclass(dropped, KeyboardInterrupt):
        return
    _previous_unraisablehook(unraisable)


def pending() -> int | None:
    """The signal received, if any."""
    return _pending


def check() -> None:
    """Raise KeyboardInterrupt if a signal arrived (again, if its first raise was dropped)."""
    if _pending is not None:
        raise KeyboardInterrupt(f"signal {signal.Signals(_pending).name}")


@contextlib.contextmanager
def keep_handlers() -> Iterator[None]:
    """Within the block, attempts to replace the SIGINT/SIGTERM handlers are ignored (only
    where ours are installed; elsewhere, e.g. under a test runner, nothing changes)."""
    ours = threading.current_thread() is threading.main_thread() and all(
        signal.getsignal(s) is _interrupt for s in (signal.SIGINT, signal.SIGTERM)
    )
    if not ours:
        yield
        return
    original = signal.signal

    def guarded(signalnum, handler):  # noqa: ANN001, ANN202 - signal.signal's signature
        if signalnum in (signal.SIGINT, signal.SIGTERM):
            return signal.getsignal(signalnum)
        return original(signalnum, handler)

    signal.signal = guarded
    try:
        yield
    finally:
        signal.signal = original


@contextlib.contextmanager
def ctrl_c_spared() -> Iterator[None]:
    """Processes started within the block (in this thread) have SIGINT blocked: a terminal's
    Ctrl-C is the ranks' (the launcher passes it on), not the embedded Ray's."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    done = threading.Event()
    taker = threading.Thread(target=done.wait, name="sigint-taker", daemon=True)
    taker.start()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        done.set()
