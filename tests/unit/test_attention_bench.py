"""benchmarks/attention_kernels.py's report of a tiling whose process failed."""

from __future__ import annotations

import subprocess
import sys

import attention_kernels as bench
import pytest

pytestmark = pytest.mark.processes  # starts processes: not in `just test-fast`


def _failed(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_a_signal_is_named_and_warnings_are_not_the_message():
    proc = _failed(
        "import os, signal, sys; print('bad tile', file=sys.stderr); "
        "print('UserWarning: noise', file=sys.stderr); sys.stderr.flush(); os.kill(os.getpid(), signal.SIGABRT)"
    )
    assert bench._failure(proc) == "killed by SIGABRT: bad tile"


def test_an_exit_code_keeps_the_last_line_of_stderr():
    proc = _failed("import sys; sys.exit('error: unable to partition input')")
    assert bench._failure(proc) == "exit 1: error: unable to partition input"


def test_a_silent_failure_gives_the_exit_alone():
    assert bench._failure(_failed("raise SystemExit(3)")) == "exit 3"
