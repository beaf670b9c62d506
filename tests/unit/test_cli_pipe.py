"""`launch ... | head`: stdout's reader gone is no error of any command (exit 0, nothing on
stderr: no traceback, no "Exception ignored ... BrokenPipeError" at exit)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import cli

ROOT = Path(__file__).resolve().parents[2]


def launch(args: list[str], cwd: Path, stdout) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "LAUNCHER_STATE_DIR": str(cwd / "state"), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "launcher", *args], stdout=stdout, stderr=subprocess.PIPE,
                          cwd=cwd, env=env, timeout=120)


@pytest.mark.parametrize("args", [
    ["--help"],
    ["schema", "job"],                                                  # 33 kB of JSON
    ["plan", str(ROOT / "jobs/quickstart.yaml"), "--skip-parity"],
    ["list"],                                                           # no launcher Ray here: one line
])
def test_a_pipe_closed_before_the_output_ends_every_command_quietly(args, tmp_path):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write, as `| head -c 1` that has exited
    try:
        closed = launch(args, tmp_path, stdout=write)
    finally:
        os.close(write)
    # the same command with a stdout that reads everything: what it says on stderr anyway
    # (`--skip-parity`'s warning); the closed pipe adds nothing to it
    reference = launch(args, tmp_path, stdout=subprocess.DEVNULL)
    assert reference.returncode == 0, reference.stderr.decode()
    assert closed.returncode == 0, closed.stderr.decode()
    assert closed.stderr == reference.stderr
    if args[0] != "plan":
        assert closed.stderr == b""


def test_head_c_1_of_a_long_output(tmp_path):
    """`launch schema job | head -c 1` through a shell, as a user types it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    shell = subprocess.run(["bash", "-c", f"set -o pipefail; {sys.executable} -m launcher schema job "
                            f"2>{tmp_path / 'err'} | head -c 1"], capture_output=True, env=env, timeout=120)
    assert shell.returncode == 0 and shell.stdout == b"{"
    assert (tmp_path / "err").read_bytes() == b""


def test_a_broken_pipe_that_is_not_stdout_is_not_hidden(monkeypatch):
    """A BrokenPipeError of another pipe or socket (SSH, Ray) is a real failure: not exit 0."""
    def command(argv):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "_main", command)
    monkeypatch.setattr(cli, "_stdout_closed", lambda: False)  # stdout reads on
    with pytest.raises(BrokenPipeError):
        cli.main(["schema", "job"])
