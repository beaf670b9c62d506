"""launcher.signals: an interrupt is remembered even where Python drops its exception (real
signals sent to this process; the test's own handlers are put back afterwards)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from fixtures.launching import wait_for

from launcher import signals
from launcher.orchestrate import ray_cluster


@pytest.fixture
def installed():
    with signals.installed():  # puts back this process's handlers and hook after the test
        yield


def test_a_signal_raises_and_is_remembered(installed):
    assert signals.pending() is None
    signals.check()  # nothing pending: no raise
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0)  # a bytecode boundary or two for the handler to run
    assert signals.pending() == signal.SIGTERM
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        signals.check()


def test_an_interrupt_python_dropped_is_raised_at_the_next_check(installed, monkeypatch):
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)  # Python's "Exception ignored in"

    class Finalised:
        def __del__(self):  # an exception raised in here is printed and dropped by Python
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(100):
                pass

    Finalised()  # collected at once: the handler runs inside __del__
    assert [d.exc_type for d in dropped] == [KeyboardInterrupt]
    assert signals.pending() == signal.SIGINT
    with pytest.raises(KeyboardInterrupt, match="SIGINT"):
        signals.check()


@pytest.mark.processes
def test_a_dropped_interrupt_prints_no_traceback_but_other_dropped_errors_still_do():
    # A fresh interpreter, so its stderr is exactly what a user of `launch` would see.
    child = textwrap.dedent("""
        import os, signal, sys
        from launcher import signals

        class Finalised:
            def __init__(self, act):
                self.act = act

            def __del__(self):
                self.act()

        def fail():
            raise ValueError("an unrelated error in a finaliser")

        def stop():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):
                pass

        signals.install()
        signals.install()  # installing twice does not stack hooks
        Finalised(fail)  # not ours: printed as Python always does
        Finalised(stop)  # the handler runs inside __del__; Python drops its exception
        print("pending", signals.pending(), flush=True)
        signals.check()
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == f"pending {int(signal.SIGTERM)}", proc.stderr
    assert proc.returncode == -signal.SIGINT  # check() raised it again; Python exits "by SIGINT"
    dropped = [line for line in proc.stderr.splitlines() if line.startswith("Exception ignored in")]
    assert len(dropped) == 1 and "ValueError: an unrelated error" in proc.stderr, proc.stderr
    assert "KeyboardInterrupt: signal SIGTERM" in proc.stderr.splitlines()[-1]  # check()'s own


def test_keep_handlers_refuses_replacements_only_while_ours_are_installed(installed):
    def other(signum, frame):  # pragma: no cover - never called
        pass

    with signals.keep_handlers():
        previous = signal.signal(signal.SIGTERM, other)  # what ray.init does
        signal.signal(signal.SIGUSR1, other)  # other signals are left alone
    assert previous is signals._interrupt
    assert signal.getsignal(signal.SIGTERM) is signals._interrupt
    assert signal.getsignal(signal.SIGUSR1) is other
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # not ours any more: no guard
    with signals.keep_handlers():
        signal.signal(signal.SIGTERM, other)
    assert signal.getsignal(signal.SIGTERM) is other


def test_a_session_made_while_a_dropped_interrupt_waited_is_closed_not_lost(installed, monkeypatch):
    """open_session raises the interrupt once the session exists: that session must be closed
    (a bootstrapped Ray on every node), since the caller never gets it."""
    closed = []

    class Session:
        def close(self, *, keep_ray: bool = False) -> None:
            closed.append(keep_ray)

    def bootstrap(cluster, nodes, runtime_env):
        signals._pending = signal.SIGINT  # the handler ran where Python dropped its exception
        return Session()

    monkeypatch.setattr(ray_cluster, "_open", bootstrap)
    monkeypatch.setattr(ray_cluster, "_shutdown", lambda: None)
    with pytest.raises(KeyboardInterrupt, match="SIGINT"):
        ray_cluster.open_session(cluster=None, nodes=[])
    assert closed == [False]


@pytest.mark.processes
def test_ctrl_c_spared_blocks_sigint_in_children_but_this_process_still_gets_it():
    """Ray's processes started within keep a terminal's Ctrl-C blocked; the launcher takes it
    at once all the same (its helper thread), not only once the block ends."""
    got: list[int] = []
    blocked = "import signal as s; print(s.SIGINT in s.pthread_sigmask(s.SIG_BLOCK, []))"
    previous = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        with signals.ctrl_c_spared():
            child = subprocess.run(
                [sys.executable, "-c", blocked], capture_output=True, text=True, timeout=60
            )
            os.kill(os.getpid(), signal.SIGINT)
            wait_for(lambda: got, timeout=5, what="the handler", poll=0.01)
            assert got == [signal.SIGINT]  # handled inside the block
        assert child.stdout.strip() == "True"
        assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    finally:
        signal.signal(signal.SIGINT, previous)
