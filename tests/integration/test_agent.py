"""The node agent on its own (no Ray): real torchrun, its output split by rank, the structured
error files of workers wrapped in torchelastic's ``@record``."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from launcher.orchestrate.agent import NodeAgent

SCRIPT = '''
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
'''


def run_to_exit(agent: NodeAgent, timeout_s: float = 120) -> list:
    updates, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        update = agent.poll(0.5)
        updates.append(update)
        if update.exit is not None:
            return updates
    raise AssertionError("torchrun did not exit")


def test_the_agent_reads_the_error_file_of_a_recorded_worker(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text(SCRIPT)
    node_dir = tmp_path / "node"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "0", "--tee", "3", "--log-dir", f"{node_dir}/torchrun", str(script)]
    agent = NodeAgent("local")
    try:
        agent.start({"node_dir": str(node_dir), "cwd": str(tmp_path), "argv": argv,
                     "env": {"PYTHONUNBUFFERED": "1", "SAID_DIR": str(tmp_path)}}, {"job.yaml": "name: x\n"})
        updates = run_to_exit(agent)
        assert updates[-1].exit.exit_code != 0 and not updates[-1].exit.stopped
        lines = [line for update in updates for line in update.lines]
        assert (0, "about to fail") in lines and (1, "about to fail") in lines
        [error] = agent.errors()
        assert (error.local_rank, error.message) == (1, "ValueError: bad batch at step 3")
        assert "boom.py" in error.traceback and error.timestamp > 0
        assert any("Root Cause" in line for line in agent.tail(None, 200))
        assert (Path(node_dir) / "job.yaml").stat().st_mode & 0o777 == 0o600
    finally:
        agent.stop(1.0)
        agent.cleanup()
    assert not node_dir.exists()
