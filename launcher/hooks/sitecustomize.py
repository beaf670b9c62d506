"""Loaded by every Python process the launcher's torchrun starts: in a worker, a fault handler
that dumps every thread's stack on a signal (docs/diagnosis.md, "Hangs"). Standard library only."""

import os
import sys


def _install() -> None:
    folder = os.environ.get("LAUNCHER_STACKS_DIR")
    # torchrun's workers have LOCAL_RANK, torchrun itself has not; a worker's own children
    # (DataLoader workers, compile workers) inherit the marker and are left alone.
    if not folder or "LOCAL_RANK" not in os.environ or "LAUNCHER_STACKS_PID" in os.environ:
        return
    import faulthandler
    import signal
    import threading

    os.environ["LAUNCHER_STACKS_PID"] = str(os.getpid())
    rank = os.environ.get("RANK", "0")
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(
            os.path.join(folder, f"rank{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600
        )
    except OSError:
        return
    # A real-time signal nobody else uses (SIGUSR1 is a requeue signal to some frameworks).
    dump = signal.SIGRTMIN + 7
    # The header tells the agent whom to signal, with what, and which thread is the main one.
    main = threading.main_thread().ident or 0
    os.write(fd, f"pid {os.getpid()} signal {int(dump)} main 0x{main:016x}\n".encode())
    stream = os.fdopen(fd, "w")  # faulthandler keeps it (and so the file) open
    faulthandler.register(dump, file=stream, all_threads=True, chain=False)
    faulthandler.register(signal.SIGTERM, file=stream, all_threads=True, chain=True)


def _chain() -> None:
    """Load the ``sitecustomize`` this one shadows, if any."""
    here = os.path.dirname(os.path.abspath(__file__))
    me = sys.modules.pop(__name__)  # importlib expects this module back once it has run
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401
    except ModuleNotFoundError as err:
        if err.name != "sitecustomize":
            raise
    finally:
        sys.path[:] = saved
        sys.modules[__name__] = me


_install()
_chain()
