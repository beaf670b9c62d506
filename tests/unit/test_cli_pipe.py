"""`launch ... | head`: stdout's reader gone is no error of any command (nothing on stderr: no
traceback, no "Exception ignored ... BrokenPipeError" at exit). A command that only shows
something ends quietly, exit 0; one that does something (`launch run`) does it whole, exit
code its own."""

from __future__ import annotations

import json
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


# -- a command that does something: `launch run job.yaml | head -3` -------------------------------

# `launch` with Launch's stages replaced (no Ray, no torchrun): a preflight that prints more than a
# pipe holds, through RunLog.show as the rank-0 lines do, then the outcome asked for.
FAKE_RUN = """
import errno, sys
from launcher import cli
from launcher.orchestrate import run
from launcher.orchestrate.records import Failure, FailureKind, Outcome, Status
from launcher.results import summary

outcome = sys.argv.pop(1)

def preflight(self):
    for i in range(2000):  # 140 kB: the writer still writes when its reader has gone
        self.log.show(f"[local/rank0] step {i} " + "x" * 60)
    return {}

def run_attempts(self, agents):
    self.log.show("the last line of the run")
    if outcome == "failed":
        return Outcome(Status.FAILED, self.run_dir.root,
                       Failure(FailureKind.LAUNCHER, "rank 1 on node local raised ValueError: boom"))
    return Outcome(Status.SUCCEEDED, self.run_dir.root)

def full_disk(run_dir, data):
    raise OSError(errno.ENOSPC, "No space left on device", str(run_dir / "summary.json"))

run.Launch.preflight = preflight
run.Launch.connect_ray = lambda self: None
run.Launch.place_agents = lambda self: None
run.Launch.run_attempts = run_attempts
if outcome == "full-disk":
    summary.write_summary = full_disk
sys.exit(cli.main(sys.argv[1:]))
"""


def run_closed_early(tmp_path: Path, outcome: str, *, stderr=subprocess.PIPE) -> tuple[int, bytes, Path]:
    """`launch run quickstart.yaml` (faked stages) whose stdout's reader reads one line and goes."""
    script = tmp_path / "fake_run.py"
    script.write_text(FAKE_RUN)
    run_dir = tmp_path / "run"
    env = {**os.environ, "LAUNCHER_STATE_DIR": str(tmp_path / "state"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(script), outcome, "run", str(ROOT / "jobs/quickstart.yaml"),
                             "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=stderr, cwd=tmp_path,
                            env=env)
    assert proc.stdout is not None
    assert proc.stdout.readline()  # as `| head -1`: one line, then the reader is gone
    proc.stdout.close()
    err = proc.stderr.read() if proc.stderr else b""
    return proc.wait(timeout=120), err, run_dir


@pytest.mark.parametrize("stderr", ["separate", "same pipe (2>&1)"])
def test_a_run_whose_stdout_reader_goes_runs_to_its_end_with_exit_0(tmp_path, stderr):
    """Not exit 3 or 4 and "could not write the summary": the run goes on, writes its run directory
    in full, exits as it would have; what it prints from then on is dropped."""
    code, err, run_dir = run_closed_early(tmp_path, "succeeded",
                                          stderr=subprocess.STDOUT if stderr != "separate" else subprocess.PIPE)
    assert code == 0, err.decode()
    assert err == b""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded"
    for name in ("summary.csv", "summary.txt", "job.yaml", "cluster.yaml"):
        assert (run_dir / name).is_file(), name


def test_a_failed_run_whose_stdout_reader_goes_exits_4_with_its_own_failure(tmp_path):
    code, err, run_dir = run_closed_early(tmp_path, "failed")
    assert code == 4, err.decode()
    assert "job 'quickstart' failed: rank 1 on node local raised ValueError: boom" in err.decode()
    assert b"Broken pipe" not in err and b"Traceback" not in err
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"


def test_a_summary_that_cannot_be_written_still_says_so_when_stdout_is_closed(tmp_path):
    """A real OSError writing summary.json is no closed pipe: its message names the run dir and the error."""
    code, err, run_dir = run_closed_early(tmp_path, "full-disk")
    assert f"could not write the summary into {run_dir}: [Errno 28] No space left on device".encode() in err
    assert b"Broken pipe" not in err and b"Traceback" not in err
    assert code == 0  # the run itself succeeded: the summary's failure is reported, not its outcome
    assert not (run_dir / "summary.json").exists()


def test_reader_may_go_drops_what_comes_after_the_reader_and_points_the_fd_at_devnull():
    read, write = os.pipe()
    stream = open(write, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    guarded = cli.ReaderMayGo(stream)
    try:
        guarded.write("seen\n")
        guarded.flush()
        assert os.read(read, 100) == b"seen\n"
        os.close(read)
        assert guarded.write("dropped\n") == len("dropped\n")
        guarded.flush()  # EPIPE here: no error, the descriptor now writes to /dev/null
        assert guarded.reader_gone
        assert os.path.samestat(os.fstat(write), os.stat(os.devnull))
        print("and so is all that follows", file=guarded, flush=True)
        guarded.writelines(["a\n", "b\n"])
        assert guarded.fileno() == write and not guarded.isatty()
    finally:
        stream.close()


def test_the_console_is_given_back_after_a_command(monkeypatch):
    before = sys.stdout, sys.stderr
    seen = []
    monkeypatch.setattr(cli, "cmd_export", lambda args: seen.append((sys.stdout, sys.stderr)) or 0)
    monkeypatch.setattr(cli, "_setup_logging", lambda debug: None)
    monkeypatch.setattr(cli.signals, "install", lambda: None)
    assert cli.main(["export", "somewhere", "--out", "elsewhere"]) == 0
    assert all(isinstance(s, cli.ReaderMayGo) for s in seen[0])
    assert (sys.stdout, sys.stderr) == before
