"""Secrets and exposure on a real local launch: masked env values, private run records, no
secret on any command line, workers still get the real value, Ray's dashboard not exposed;
nothing another user could write or read; nothing left running after ``kill -9``. (SSH host
keys: test_preflight_ssh.py and test_remote_ssh.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml
from fixtures.launching import (
    FIXTURES,
    ROOT,
    Launcher,
    env_of,
    launch,
    node_dirs,
    ours,
    processes,
    wait_for,
    what_nobody_can_touch,
    write_job,
)


def _listening() -> list[tuple[str, int, str]]:
    """(local address, port, `users:` column) of every listening TCP socket (``ss -ltnpH``)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=30).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 5:
            continue
        addr, _, port = parts[3].rpartition(":")
        rows.append((addr.strip("[]"), int(port) if port.isdigit() else -1, " ".join(parts[5:])))
    return rows


def test_secrets_masked_everywhere_yet_workers_get_them(tmp_path):
    secret = f"tok-{uuid.uuid4().hex}"
    password = f"pw-{uuid.uuid4().hex}"
    env = {
        "MY_API_TOKEN": secret,
        "DB_PASSWORD": password,
        "DB_PASSWD": password,
        "AWS_CREDENTIALS": password,
        "DATABASE_URL": f"postgres://user:{password}@db/x",
        "PLAIN_SETTING": "visible-1",
    }
    args = ["--steps", "60", "--step-sleep", "0.1", "--secret-env", "MY_API_TOKEN"]
    entry = {"script": str(FIXTURES / "fault_train.py"), "args": args}
    job_file = write_job(tmp_path, entry, launch={"env": env})
    job_file.chmod(0o600)

    # `launch plan`: the env table shows the names, masks the values
    planned = launch("plan", str(job_file), "--skip-parity", cwd=tmp_path, timeout=120)
    assert planned.returncode == 0, planned.stderr
    assert secret not in planned.stdout + planned.stderr and password not in planned.stdout
    assert all(shown in planned.stdout for shown in ("MY_API_TOKEN", "****", "visible-1"))

    run_dir = tmp_path / f"sec-{tmp_path.name}"
    with Launcher(str(job_file), "--skip-parity", run_dir=run_dir, cwd=tmp_path) as run:
        run.wait_file("metrics/rank1.jsonl")
        workers = wait_for(
            lambda: run.workers() if len(run.workers()) == 2 else None,
            timeout=30,
            what="both workers",
        )
        # mid-run: the real value is in the workers' environment, on no process's command line
        assert all(w.get("MY_API_TOKEN") == secret for w in workers.values())
        leaked = {pid: cmd for pid, cmd in processes().items() if secret in cmd or password in cmd}
        assert not leaked, f"secret on a command line: {leaked}"
        # Ray's own auth token (in its processes' environment, if any) is on no command line either
        tokens = {env_of(pid).get("RAY_AUTH_TOKEN") for pid in ours(run.mark)} - {None, ""}
        commands = " ".join(processes().values())
        assert not [t for t in tokens if t in commands], "Ray token on a command line"
        # The embedded Ray serves no dashboard (ray.dashboard defaults to false): the dashboard
        # process Ray keeps (usage stats) runs without its web frontend, and nothing of this
        # launch serves HTTP on the dashboard port. (That process's gRPC port binds 0.0.0.0: a
        # Ray internal, token-authenticated like every Ray port; see RELIABILITY_TABLE.md.)
        ray_pids = ours(run.mark)
        dashboards = [cmd for cmd in ray_pids.values() if "dashboard/dashboard.py" in cmd]
        assert all("--disable-frontend" in cmd for cmd in dashboards), dashboards
        ours_listening = [
            (a, p, u) for a, p, u in _listening() if any(f"pid={pid}," in u for pid in ray_pids)
        ]
        assert ours_listening, "expected Ray's own listening sockets"
        assert not [r for r in ours_listening if r[1] == 8265], ours_listening
        assert run.wait(timeout=180) == 0, run.output[-3000:]
        out = run.output
        run.assert_nothing_left()

    assert secret not in out and password not in out
    # every file of the run directory: no secret, anywhere
    for path in run_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            for value in (secret, password, *tokens):
                assert value.encode() not in data, f"a secret or Ray's token in {path}"
    # ... yet the worker had the real value: it logged the value's hash
    digest = hashlib.sha256(secret.encode()).hexdigest()
    assert f"secret sha256 {digest}" in (run_dir / "logs/local/rank0.log").read_text()
    plan = json.loads((run_dir / "plan.json").read_text())
    masked = dict.fromkeys(env, "****")
    masked.update(DATABASE_URL="postgres://user:****@db/x", PLAIN_SETTING="visible-1")
    assert {k: plan["nodes"][0]["env"][k] for k in masked} == masked
    assert "postgres://user:****@db/x" in planned.stdout
    recorded = yaml.safe_load((run_dir / "job.yaml").read_text())
    assert recorded["launch"]["env"] == masked
    # files that hold (masked) env are private to their owner
    for name in ("job.yaml", "cluster.yaml", "plan.json"):
        mode = (run_dir / name).stat().st_mode & 0o777
        assert mode == 0o600, f"{name} is {oct(mode)}"
    assert not (ROOT / "runs" / run_dir.name).exists()


def _slow_job(tmp_path) -> Path:
    args = ["--steps", "2000", "--step-sleep", "0.1"]
    return write_job(tmp_path, {"script": str(FIXTURES / "fault_train.py"), "args": args})


def _arg(pids, prefix: str) -> set[str]:
    """The values of ``prefix``-led arguments (``--session_dir=``) on these processes' lines."""
    return {a[len(prefix) :] for cmd in pids.values() for a in cmd.split() if a.startswith(prefix)}


@pytest.mark.parametrize("victim", ["launch", "agent"])
def test_kill_9_leaves_nothing_running_within_15_s(tmp_path, victim):
    """SIGKILL to a foreground ``launch`` (embedded Ray) mid-run, or to its node's agent: no
    worker, torchrun, agent or raylet of the run within 15 s, Ray's temp dir (its session,
    sockets and logs) and the node's folder removed. Before, user nobody (when we are root) can
    create no file anywhere under them, nor read one."""
    run_dir = tmp_path / f"priv-{uuid.uuid4().hex[:8]}"
    with Launcher(str(_slow_job(tmp_path)), "--skip-parity", run_dir=run_dir, cwd=tmp_path) as run:
        run.wait_file("metrics/rank1.jsonl")
        pids = ours(run.mark, run.run_id)
        assert [p for p, cmd in pids.items() if "raylet" in cmd], pids
        assert len(_workers(run.run_id)) >= 3, pids  # torchrun and its two workers
        [session] = _arg(pids, "--session_dir=")
        [node_dir] = node_dirs(pids)
        temp_dir = Path(session).parent.parent  # Ray's own (0777) is in there
        assert temp_dir.stat().st_mode & 0o777 == 0o700 and temp_dir.name.startswith("launcher-ray")
        assert node_dir.stat().st_mode & 0o777 == 0o700
        assert not str(node_dir).startswith("/tmp/launcher/")
        if os.getuid() == 0:  # switching to user nobody needs root
            touched = what_nobody_can_touch([temp_dir, node_dir])
            assert touched == [], touched
        if victim == "launch":
            run.proc.kill()
            what = lambda: ours(run.mark, run.run_id)  # noqa: E731
        else:
            [agent] = [p for p, cmd in pids.items() if "NodeAgent" in cmd]
            os.kill(agent, 9)
            what = lambda: _workers(run.run_id)  # noqa: E731 - the launcher then stops Ray
        killed = time.monotonic()
        while (left := what()) and (time.monotonic() < killed + 15):
            time.sleep(0.5)
        assert not left, f"left running 15 s after kill -9 of the {victim}: {left}"
        if victim == "agent":
            assert run.wait(timeout=120) == 4, run.output[-3000:]
        run.assert_nothing_left()
    assert not temp_dir.exists() and not node_dir.exists(), "removed at the end of the run"


def _workers(run_id: str) -> dict[int, str]:
    """torchrun and the workers of a run (their environment names the run)."""
    return {
        pid: cmd for pid, cmd in processes().items() if env_of(pid).get("LAUNCHER_RUN_ID") == run_id
    }
