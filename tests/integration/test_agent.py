"""The node agent on its own (no Ray): real torchrun, each rank's output read from its files,
the structured error files of workers wrapped in torchelastic's ``@record``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.launching import kill, wait_for

from launcher.orchestrate.agent import REAPER_GRACE_S, WORKER_SCAN_S, NodeAgent
from launcher.orchestrate.plan import NODE_DIR
from launcher.orchestrate.reaper import alive

SCRIPT = """
import os
import pathlib
import time

from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    print("about to fail", flush=True)
    said = pathlib.Path(os.environ["SAID_DIR"])
    (said / os.environ["LOCAL_RANK"]).touch()
    if os.environ["LOCAL_RANK"] == "1":
        # Fail once rank 0 has printed too: torchrun stops rank 0 when rank 1 fails, and a
        # slow start (a fresh venv's first imports) could otherwise stop it before its line.
        deadline = time.monotonic() + 60
        while not (said / "0").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        raise ValueError("bad batch at step 3")
    time.sleep(60)  # torchrun stops this one when rank 1 fails

main()
"""


@pytest.fixture
def agent() -> Iterator[NodeAgent]:
    agent = NodeAgent("local")
    try:
        yield agent
    finally:
        agent.stop(1.0)
        agent.cleanup()


def start(agent: NodeAgent, cwd: Path, argv: list[str], env=None, files=None) -> None:
    """``agent`` starts ``argv`` in ``cwd`` as a launch's node would."""
    plan = {"run_id": "t-0a1b2c", "cwd": str(cwd), "argv": argv, "env": env or {}}
    agent.start(plan, files or {})


def run_to_exit(agent: NodeAgent, timeout_s: float = 120) -> list:
    updates, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        update = agent.poll(0.5)
        updates.append(update)
        if update.exit is not None:
            return updates
    raise AssertionError("torchrun did not exit")


def test_the_agent_reads_the_error_file_of_a_recorded_worker(agent, tmp_path):
    script = tmp_path / "boom.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    argv += ["--max-restarts", "0", "--redirects", "3", "--log-dir", f"{NODE_DIR}/torchrun"]
    env = {"PYTHONUNBUFFERED": "1", "SAID_DIR": str(tmp_path)}
    start(agent, tmp_path, [*argv, str(script)], env, {"job.yaml": "name: x\n"})
    updates = run_to_exit(agent)
    assert updates[-1].exit.exit_code != 0 and not updates[-1].exit.stopped
    lines = [line for update in updates for line in update.lines]
    assert (0, "out", "about to fail") in lines and (1, "out", "about to fail") in lines
    assert any(
        rank == 1 and stream == "err" and "ValueError" in text for rank, stream, text in lines
    )
    [error] = agent.errors()
    assert (error.local_rank, error.message) == (1, "ValueError: bad batch at step 3")
    assert "boom.py" in error.traceback and error.timestamp > 0
    assert any("Root Cause" in line for line in agent.tail(None, 200))
    node_dir = Path(agent.node_dir())
    assert (node_dir / "job.yaml").stat().st_mode & 0o777 == 0o600
    # the node's folder: private to this user, named after the run, made by mkdtemp
    assert node_dir.name.startswith("launcher-t-0a1b2c-local-")
    assert node_dir.stat().st_mode & 0o777 == 0o700 and node_dir.stat().st_uid == os.getuid()
    # A restart's tails are its own: the first attempt's report must not blame the second.
    start(agent, tmp_path, [sys.executable, "-c", "print('again')"])
    assert run_to_exit(agent)[-1].exit.exit_code == 0
    assert agent.tail(None, 200) == ["again"] and agent.tail(1) == []
    assert agent.node_dir() == str(node_dir)  # every attempt of the run: one folder
    agent.cleanup()
    assert not node_dir.exists()


HUNG_TORCHRUN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a torchrun that hangs in its SIGTERM handling
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"],
    start_new_session=True)  # a worker, in a session of its own as torchrun's are
print(f"pids {os.getpid()} {child.pid}", flush=True)
time.sleep(600)
"""

AGENT = """
import sys, time
from launcher.orchestrate.agent import NodeAgent
agent = NodeAgent("local")
argv = [sys.executable, sys.argv[1]]
agent.start({"run_id": "t-0a1b2c", "cwd": sys.argv[2], "argv": argv, "env": {}}, {})
print("dir", agent.node_dir(), flush=True)
while True:
    for *_, line in agent.poll(0.5).lines:
        print(line, flush=True)
"""


def test_a_dead_agents_torchrun_is_killed_even_when_it_ignores_sigterm(tmp_path):
    """The agent is SIGKILLed (as Ray kills it when the driver dies); its torchrun ignores the
    SIGTERM of its death signal, and so does its worker: the reaper SIGKILLs both."""
    (tmp_path / "torchrun.py").write_text(HUNG_TORCHRUN)
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(tmp_path / "torchrun.py"), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    pids: list[int] = []
    try:
        node_dir = Path(agent.stdout.readline().split()[1])
        assert node_dir.is_dir()
        line = agent.stdout.readline()
        assert line.startswith("pids "), line
        pids = [int(p) for p in line.split()[1:]]
        assert all(alive(p) for p in pids)
        agent.kill()
        agent.wait(timeout=10)
        time.sleep(2)
        assert all(alive(p) for p in pids), "the grace period: torchrun may still shut down itself"
        what = "the reaper to kill torchrun and its worker"
        wait_for(lambda: not any(alive(p) for p in pids), timeout=REAPER_GRACE_S + 10, what=what)
        time.sleep(1)
        assert not node_dir.exists(), "the reaper removes the node folder the agent cannot"
    finally:
        agent.kill()
        kill(pids)


def test_the_workers_of_a_torchrun_killed_by_sigkill_are_ended_before_its_exit_is_reported(
    agent, tmp_path
):
    """torchrun dies first (the OOM killer, kill -9); its worker, in a session of its own and
    ignoring SIGTERM, would go on holding the GPU into the next attempt."""
    (tmp_path / "torchrun.py").write_text(HUNG_TORCHRUN)
    pids: list[int] = []
    try:
        start(agent, tmp_path, [sys.executable, str(tmp_path / "torchrun.py")])
        deadline = time.monotonic() + 60
        while not pids and time.monotonic() < deadline:
            pids = [
                int(p)
                for *_, line in agent.poll(0.5).lines
                if line.startswith("pids ")
                for p in line.split()[1:]
            ]
        torchrun, worker = pids
        time.sleep(WORKER_SCAN_S + 1)  # the agent has noted the worker
        os.kill(torchrun, signal.SIGKILL)
        updates = run_to_exit(agent, timeout_s=60)
        assert updates[-1].exit.signal == "SIGKILL"
        assert not alive(worker), "the exit was reported with torchrun's worker still running"
    finally:
        kill(pids)


FLOOD = """
import sys
out = sys.stdout
out.write("x" * (1 << 20) + "\\n")  # one line of 1 MiB
for i in range(60000):
    out.write(f"line {i}\\n")
out.flush()
"""


def test_a_rank_that_floods_its_output_is_cut_and_dropped_with_a_note(agent, tmp_path):
    """Nobody polls while a process writes a 1 MiB line and 60,000 more: the agent keeps at most
    PENDING_LINES_MAX of them (and a note of how many it dropped), the long line cut."""
    from launcher.orchestrate.agent import LINE_MAX_BYTES, PENDING_LINES_MAX

    (tmp_path / "flood.py").write_text(FLOOD)
    start(agent, tmp_path, [sys.executable, str(tmp_path / "flood.py")])
    wait_for(agent._drained, timeout=60, what="the flood's end and its readers'")
    lines = [text for *_, text in agent.poll(0).lines]
    assert len(lines) == PENDING_LINES_MAX + 1
    assert lines[0].endswith(f"[line cut at {LINE_MAX_BYTES} bytes]")
    assert len(lines[0]) < LINE_MAX_BYTES + 100
    assert lines[1] == "line 0"
    dropped = 60001 - PENDING_LINES_MAX
    assert lines[-1].startswith(f"[launcher: {dropped} line(s) of output dropped on node local")
