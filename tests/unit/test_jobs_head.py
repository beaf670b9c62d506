"""The local head's record (``$LAUNCHER_STATE_DIR/local/head.json``) when it no longer tells
the truth: the job commands answer at once and never signal a process that is not the head."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fixtures.launching import ROOT
from fixtures.launching import launch as run_launcher

from launcher.jobs import head as heads
from launcher.jobs import records
from launcher.util import free_port

pytestmark = pytest.mark.processes  # starts processes: not in `just test-fast`


def launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LAUNCHER_STATE_DIR": str(tmp_path / "state"), "PYTHONPATH": str(ROOT)}
    return run_launcher(*args, cwd=tmp_path, env=env, timeout=120)


def write_record(tmp_path: Path, pid: int) -> Path:
    folder = tmp_path / "state/local"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "auth_token").write_text("0" * 64 + "\n")
    ports = {f"{name}_port": free_port() for name in ("gcs", "dashboard", "agent")}
    temp_dir, token_file = str(tmp_path / "launcher-ray-gone"), str(folder / "auth_token")
    record = folder / "head.json"
    record.write_text(
        json.dumps({"pid": pid, **ports, "temp_dir": temp_dir, "token_file": token_file})
    )
    return record


@pytest.fixture
def unrelated():
    """A process in a session of its own, as the head's `ray start` was: the pid a stale record
    names after a reboot."""
    proc = subprocess.Popen(["setsid", "sleep", "300"])
    try:
        time.sleep(0.1)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_reused_pid_is_not_the_head(tmp_path, unrelated):
    record = write_record(tmp_path, unrelated.pid)
    started = time.monotonic()
    status = launch(tmp_path, "status")
    assert status.returncode == 0 and "no jobs" in status.stdout, status.stderr[-2000:]
    assert time.monotonic() - started < 20  # no wait for an answer that cannot come
    assert not record.exists()

    write_record(tmp_path, unrelated.pid)
    down = launch(tmp_path, "down", "--yes")
    assert down.returncode == 0, down.stderr[-2000:]
    time.sleep(0.5)
    assert unrelated.poll() is None, "launch down signalled a process that was not the head"


@pytest.fixture
def head_process(tmp_path, monkeypatch):
    """A process whose command line names the head's temp dir, as each of the head's does."""
    monkeypatch.setenv(records.STATE_ENV, str(tmp_path / "state"))
    temp_dir = heads._new_temp_dir(records.local_folder())  # recorded, as a head's start does
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)", temp_dir], start_new_session=True
    )
    try:
        yield proc, temp_dir
    finally:
        proc.kill()
        proc.wait()


def test_a_corrupt_head_record_is_exit_3_and_down_yes_clears_it(tmp_path, head_process):
    proc, _ = head_process
    record = tmp_path / "state/local/head.json"
    record.write_text('{"pid": 12')  # cut off mid-write
    for args in (("status",), ("logs", "x"), ("down",)):
        result = launch(tmp_path, *args)
        assert result.returncode == 3, (args, result.stderr[-2000:])
        assert f"record {record} cannot be read" in result.stderr
        assert "launch down --yes" in result.stderr
        assert "Traceback" not in result.stderr
    down = launch(tmp_path, "down", "--yes")
    assert down.returncode == 0, down.stderr[-2000:]
    assert not record.exists()
    proc.wait(timeout=10)  # what ran under the head's temp dir is stopped


def test_a_lost_token_file_is_exit_3_and_down_yes_stops_the_head(tmp_path, head_process):
    proc, temp_dir = head_process
    record = write_record(tmp_path, proc.pid)
    data = json.loads(record.read_text())
    record.write_text(json.dumps({**data, "temp_dir": temp_dir}))
    Path(data["token_file"]).unlink()
    status = launch(tmp_path, "status")
    assert status.returncode == 3 and "lost its token file" in status.stderr, status.stderr[-2000:]
    assert "Traceback" not in status.stderr
    down = launch(tmp_path, "down", "--yes")
    assert down.returncode == 0 and not record.exists(), down.stderr[-2000:]
    assert "Stopping the launcher's Ray head on this machine ..." in down.stdout
    proc.wait(timeout=30)


def test_a_corrupt_cluster_record_is_exit_3_and_down_yes_forgets_it(tmp_path):
    nodes = [{"name": "node0", "host": "198.18.250.10"}]
    ssh = {"key": str(tmp_path / "no-key"), "connect_timeout_s": 1}
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"nodes": nodes, "ssh": ssh}))
    folder = tmp_path / "state/clusters"
    folder.mkdir(parents=True)
    record = folder / "198.18.250.10-6379.json"
    record.write_text(json.dumps({"nodes": nodes, "from": "v0"}))  # not a spec of this version
    status = launch(tmp_path, "status", "--cluster", str(cluster))
    said = status.stderr[-2000:]
    assert status.returncode == 3 and f"record {record} cannot be read" in status.stderr, said
    assert "Traceback" not in status.stderr
    down = launch(tmp_path, "down", "--yes", "--cluster", str(cluster))
    assert not record.exists()
    # node0 cannot be reached (no such key): down says Ray may still run there, exit 3
    unreached = "could not reach node0: Ray may still run there"
    assert down.returncode == 3 and unreached in down.stderr, down.stderr
    assert "Stopped" not in down.stdout
