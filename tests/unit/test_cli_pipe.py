"""`launch ... | head`: a command that only shows something ends quietly (exit 0, nothing on
stderr); one that acts (`launch run`) runs to its end, dropping only what goes to the stream
whose reader went. Another pipe's BrokenPipeError is an error; `2>&-` changes no exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.launching import ROOT

from launcher import cli, console

pytestmark = pytest.mark.processes  # starts processes: not in `just test-fast`


def env_for(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "LAUNCHER_STATE_DIR": str(tmp_path / "state"), "PYTHONPATH": str(ROOT)}


def launch(args: list[str], cwd: Path, stdout) -> subprocess.CompletedProcess[bytes]:
    argv = [sys.executable, "-m", "launcher", *args]
    return subprocess.run(
        argv, stdout=stdout, stderr=subprocess.PIPE, cwd=cwd, env=env_for(cwd), timeout=120
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["schema", "job"],  # 33 kB of JSON
        ["plan", str(ROOT / "jobs/quickstart.yaml"), "--skip-parity"],
        ["list"],  # no launcher Ray here: one line
    ],
)
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


def _raise_broken_pipe(args):
    raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize(
    ("command", "reader_gone"),
    [("schema", False), ("schema", True), *((c, True) for c in sorted(cli.WORKING_COMMANDS))],
)
def test_a_broken_pipe_is_hidden_only_when_a_command_that_shows_lost_its_reader(
    monkeypatch, command, reader_gone
):
    """A BrokenPipeError of another pipe or socket (SSH, Ray, a child's stdin) is a real failure,
    not exit 0. A command that acts never meets its console's (ReaderMayGo): one out of it is
    another's, even when stdout's reader happens to have gone as well."""
    monkeypatch.setattr(cli, f"cmd_{command}", _raise_broken_pipe)
    monkeypatch.setattr(console, "stdout_reader_gone", lambda: reader_gone)
    monkeypatch.setattr(console, "to_devnull", lambda stream: None)  # pytest's stdout stays
    monkeypatch.setattr(cli, "setup_logging", lambda debug: None)
    monkeypatch.setattr(cli.signals, "install", lambda: None)
    special = {"schema": ["schema", "job"], "export": ["export", "x", "--out", "y"]}
    argv = special.get(command, [command] if command in ("down", "up") else [command, "x"])
    if command == "schema" and reader_gone:
        assert cli.main(argv) == 0
    else:
        with pytest.raises(BrokenPipeError):
            cli.main(argv)


# -- a command that does something: `launch run job.yaml | head -3` -------------------------------

QUICKSTART = str(ROOT / "jobs/quickstart.yaml")

# `launch` with Launch's stages replaced (no Ray, no torchrun): a preflight that logs a line (on
# stderr) and prints more than a pipe holds, through RunLog.show as the rank-0 lines do (and as
# many to stderr with FAKE_RUN_STDERR=1), then the outcome asked for. "fetch-foreign-pipe": a
# `launch fetch` that prints a line, and once stdout's reader has gone meets a broken pipe that is
# not its console's.
FAKE_RUN = """
import errno, logging, os, select, sys, time
from launcher import cli
from launcher.orchestrate import run
from launcher.orchestrate.records import Failure, FailureKind, Outcome, Status

outcome = sys.argv.pop(1)
LINES = [f"[local/rank0] step {i} " + "x" * 60 for i in range(2000)]  # 140 kB: the writer still
                                                                     # writes when its reader has gone
def preflight(self):
    logging.getLogger("launcher.fake").info("preflight: one node")
    for line in LINES:
        self.log.show(line)
        if os.environ.get("FAKE_RUN_STDERR") == "1":
            print(line, file=sys.stderr)
    return {}

def run_attempts(self, agents):
    self._workers_started = True
    self.log.start_progress(3)  # as the real stage does: asks sys.stderr.isatty()
    self.log.stop_progress()
    self.log.show("the last line of the run")
    if outcome == "foreign-pipe":  # an agent's SSH or Ray connection, not the console
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")
    if outcome == "failed":
        return Outcome(Status.FAILED, self.run_dir.root,
                       Failure(FailureKind.LAUNCHER, "rank 1 on node local raised ValueError: boom"))
    return Outcome(Status.SUCCEEDED, self.run_dir.root)

def full_disk(run_dir, data):
    raise OSError(errno.ENOSPC, "No space left on device", str(run_dir / "summary.json"))

def fetch(args):
    print("copying job-1's run directory", flush=True)
    poller = select.poll()
    poller.register(sys.stdout.fileno(), select.POLLOUT)
    for _ in range(6000):  # until stdout's reader has gone (nothing written since: not dropped yet)
        if any(events & select.POLLERR for _, events in poller.poll(0)):
            break
        time.sleep(0.01)
    raise BrokenPipeError(errno.EPIPE, "Broken pipe")  # the head's SSH connection, say

run.Launch.preflight = preflight
run.Launch.connect_ray = lambda self: None
run.Launch.place_agents = lambda self: None
run.Launch.run_attempts = run_attempts
if outcome == "full-disk":
    run.write_summary = full_disk
if outcome == "fetch-foreign-pipe":
    cli.cmd_fetch = fetch
sys.exit(cli.main(sys.argv[1:]))
"""


def fake_launch(
    tmp_path: Path, outcome: str, argv: list[str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """The command line of FAKE_RUN (`launch run quickstart.yaml --run-dir RUN` unless `argv`), its env."""
    script = tmp_path / "fake_run.py"
    script.write_text(FAKE_RUN)
    argv = argv or ["run", QUICKSTART, "--run-dir", str(tmp_path / "run")]
    return [sys.executable, str(script), outcome, *argv], env_for(tmp_path)


class Closed:
    """What a command whose reader went early did: its exit code, the line the reader read before
    going, and what it wrote into the stream (stdout, stderr) that kept a reader: a file."""

    def __init__(self, code: int, first: bytes, out: bytes, err: bytes):
        self.code, self.first, self.out, self.err = code, first, out, err


def run_closed_early(
    tmp_path: Path,
    outcome: str,
    *,
    reader: str = "stdout",
    argv: list[str] | None = None,
    stderr_too: bool = False,
) -> Closed:
    """FAKE_RUN whose `reader` reads one line and goes, as `| head -1`: "stdout" (stderr into a
    file), "stderr" (stdout into a file) or "both" (one pipe for both, `2>&1`). The stream that
    keeps a reader goes to a file, never a second pipe: one the test does not read while the
    child writes more than a pipe holds into it would block the child."""
    cmd, env = fake_launch(tmp_path, outcome, argv)
    if stderr_too:
        env["FAKE_RUN_STDERR"] = "1"
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        stdout, stderr = {
            "stdout": (subprocess.PIPE, err),
            "stderr": (out, subprocess.PIPE),
            "both": (subprocess.PIPE, subprocess.STDOUT),
        }[reader]
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, cwd=tmp_path, env=env)
        pipe = proc.stderr if reader == "stderr" else proc.stdout
        assert pipe is not None
        first = pipe.readline()  # one line, then the reader is gone
        pipe.close()
        code = proc.wait(timeout=120)
    return Closed(code, first, out_path.read_bytes(), err_path.read_bytes())


def test_a_run_whose_stdout_reader_goes_runs_to_its_end_with_exit_0(tmp_path):
    """Not exit 3 or 4 and "could not write the summary": the run goes on, writes its run directory
    in full, exits as it would have; what it prints from then on is dropped. stderr, read on, has
    its one log line and nothing more: no traceback, no "Exception ignored"."""
    closed = run_closed_early(tmp_path, "succeeded")
    assert closed.code == 0, closed.err.decode()
    assert closed.first.startswith(b"[local/rank0] step 0 ")
    assert closed.err == b"preflight: one node\n"
    assert_complete(tmp_path / "run")


def test_a_run_whose_stderr_reader_goes_drops_stderr_only(tmp_path):
    """Only the stream whose reader went is dropped: stdout, read on, has the whole run."""
    closed = run_closed_early(tmp_path, "succeeded", reader="stderr", stderr_too=True)
    assert closed.code == 0, closed.out.decode()[-2000:]
    assert closed.first == b"preflight: one node\n"
    lines = closed.out.decode().splitlines()
    assert lines[:2000] == [f"[local/rank0] step {i} " + "x" * 60 for i in range(2000)]
    assert "the last line of the run" in lines and f"Run directory: {tmp_path / 'run'}" in lines
    assert_complete(tmp_path / "run")


def test_a_run_whose_one_console_pipe_2_to_1_loses_its_reader_runs_to_its_end(tmp_path):
    """`launch run job.yaml 2>&1 | head -1`: what either stream writes after the reader went is
    lost, to this test as to the user; the exit code and the run directory show the run went on."""
    closed = run_closed_early(tmp_path, "succeeded", reader="both", stderr_too=True)
    assert closed.code == 0
    assert closed.first == b"preflight: one node\n"
    assert closed.out == closed.err == b""  # both streams went into the pipe, none into the files
    assert_complete(tmp_path / "run")


def assert_complete(run_dir: Path) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded"
    for name in ("summary.csv", "summary.txt", "job.yaml", "cluster.yaml"):
        assert (run_dir / name).is_file(), name


def test_a_failed_run_whose_stdout_reader_goes_exits_4_with_its_own_failure(tmp_path):
    closed = run_closed_early(tmp_path, "failed")
    assert closed.code == 4, closed.err.decode()
    failed = "job 'quickstart' failed: rank 1 on node local raised ValueError: boom"
    assert failed in closed.err.decode()
    assert b"Broken pipe" not in closed.err and b"Traceback" not in closed.err
    assert json.loads((tmp_path / "run/summary.json").read_text())["status"] == "failed"


def test_a_summary_that_cannot_be_written_still_says_so_when_stdout_is_closed(tmp_path):
    """A real OSError writing summary.json is no closed pipe: its message names the run dir and the error."""
    closed = run_closed_early(tmp_path, "full-disk")
    run_dir = tmp_path / "run"
    said = f"could not write the summary into {run_dir}: [Errno 28] No space left on device"
    assert said.encode() in closed.err
    assert b"Broken pipe" not in closed.err and b"Traceback" not in closed.err
    # the run itself succeeded: the summary's failure is reported, not its outcome
    assert closed.code == 0
    assert not (run_dir / "summary.json").exists()


def test_a_broken_pipe_not_of_the_console_fails_the_run_as_any_oserror_when_stdout_is_closed(
    tmp_path,
):
    """Ray's or SSH's pipe breaking mid-run is the launcher failing (exit 4 once workers started,
    3 before), as any other OSError there, whatever became of stdout's reader."""
    closed = run_closed_early(tmp_path, "foreign-pipe")
    assert closed.code == 4, closed.err.decode()
    assert b"the launcher could not go on: BrokenPipeError: [Errno 32] Broken pipe" in closed.err
    assert b"Traceback" not in closed.err


def test_a_broken_pipe_not_of_the_console_out_of_a_command_that_acts_is_no_exit_0(tmp_path):
    """`launch fetch JOB | head -1` whose SSH pipe breaks: not taken for stdout's reader that
    went; an unexpected error as any other, its traceback, exit 1."""
    closed = run_closed_early(tmp_path, "fetch-foreign-pipe", argv=["fetch", "job-1"])
    assert closed.first == b"copying job-1's run directory\n"
    assert closed.code == 1, closed.err.decode()
    assert b"Traceback" in closed.err and b"BrokenPipeError: [Errno 32] Broken pipe" in closed.err


# -- a stdout or stderr closed from the start: `launch run job.yaml 2>&-` -----------------------------


def closed_from_the_start(
    tmp_path: Path, redirect: str, cmd: list[str], env: dict[str, str]
) -> Closed:
    """`cmd` with the shell's `redirect` (`2>&-`: Python's sys.stderr is then None; a
    subprocess.DEVNULL is no closed stream); what it wrote to the others, into files."""
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        code = subprocess.run(
            ["sh", "-c", f'exec "$@" {redirect}', "sh", *cmd],
            stdout=out,
            stderr=err,
            cwd=tmp_path,
            env=env,
            timeout=120,
        ).returncode
    return Closed(code, b"", out_path.read_bytes(), err_path.read_bytes())


@pytest.mark.parametrize(
    ("args", "redirect", "expected"),
    [
        (["run", "/nonexistent.yaml"], "2>&-", 2),
        (["run", "/nonexistent.yaml"], ">&-", 2),
        (["run", "/nonexistent.yaml"], ">&- 2>&-", 2),
        (["schema", "job"], ">&-", 0),
    ],
)
def test_a_console_closed_from_the_start_keeps_the_exit_code(tmp_path, args, redirect, expected):
    cmd = [sys.executable, "-m", "launcher", *args]
    closed = closed_from_the_start(tmp_path, redirect, cmd, env_for(tmp_path))
    assert closed.code == expected, closed.err.decode()
    assert b"Traceback" not in closed.err and b"Exception ignored" not in closed.err
    if redirect == ">&-":
        assert closed.err == (
            b"error: /nonexistent.yaml: file not found; check the path\n" if expected else b""
        )
    else:
        assert closed.out == b""


@pytest.mark.parametrize("redirect", ["2>&-", ">&-"])
def test_a_run_with_a_console_closed_from_the_start_runs_to_its_end(tmp_path, redirect):
    """It logs, prints and asks stderr isatty() (the progress bar) into the closed stream as
    into /dev/null; the stream still open has all of its own."""
    closed = closed_from_the_start(tmp_path, redirect, *fake_launch(tmp_path, "succeeded"))
    assert closed.code == 0, closed.err.decode()
    if redirect == "2>&-":
        assert b"the last line of the run" in closed.out and b"Run directory: " in closed.out
    else:
        assert closed.err == b"preflight: one node\n"
    assert_complete(tmp_path / "run")


def test_reader_may_go_drops_what_comes_after_the_reader_and_points_the_fd_at_devnull():
    read, write = os.pipe()
    stream = open(write, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    guarded = console.ReaderMayGo(stream)
    try:
        guarded.write("seen\n")
        guarded.flush()
        assert os.read(read, 100) == b"seen\n"
        os.close(read)
        assert guarded.write("dropped\n") == len("dropped\n")
        guarded.flush()  # EPIPE here: no error, the descriptor now writes to /dev/null
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
    monkeypatch.setattr(cli, "setup_logging", lambda debug: None)
    monkeypatch.setattr(cli.signals, "install", lambda: None)
    assert cli.main(["export", "somewhere", "--out", "elsewhere"]) == 0
    assert all(isinstance(s, console.ReaderMayGo) for s in seen[0])
    assert (sys.stdout, sys.stderr) == before
