"""Secrets and exposure on a real local launch: masked env values, private run records, no
secret on any command line, workers still get the real value, Ray's dashboard not exposed.

SSH host-key verification is covered by tests/integration/test_preflight_ssh.py and
test_preflight_netns.py (unknown or changed host keys are refused by default)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid

import yaml
from fixtures.launching import FIXTURES, ROOT, Launcher, env_of, ours, wait_for


def _cmdlines() -> dict[int, bytes]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    out[int(entry)] = fh.read()
            except OSError:
                continue
    return out


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
    job = {
        "name": "sec",
        "resources": {"nproc_per_node": 2, "device": "cpu"},
        "precision": {"dtype": "fp32"},
        "launch": {
            "env": {"MY_API_TOKEN": secret, "DB_PASSWORD": password, "PLAIN_SETTING": "visible-1"}
        },
        "entrypoint": {
            "script": str(FIXTURES / "fault_train.py"),
            "args": ["--steps", "60", "--step-sleep", "0.1", "--secret-env", "MY_API_TOKEN"],
        },
    }
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    job_file.chmod(0o600)

    # `launch plan`: the env table shows the names, masks the values
    planned = subprocess.run(
        [sys.executable, "-m", "launcher", "plan", str(job_file), "--skip-parity"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert planned.returncode == 0, planned.stderr
    assert secret not in planned.stdout + planned.stderr and password not in planned.stdout
    assert (
        "MY_API_TOKEN" in planned.stdout
        and "****" in planned.stdout
        and "visible-1" in planned.stdout
    )

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
        leaked = {
            pid: cmd
            for pid, cmd in _cmdlines().items()
            if secret.encode() in cmd or password.encode() in cmd
        }
        assert not leaked, f"secret on a command line: {leaked}"
        # Ray's own auth token (in its processes' environment, if any) is on no command line either
        tokens = {env_of(pid).get("RAY_AUTH_TOKEN") for pid in ours(run.mark)} - {None, ""}
        for token in tokens:
            assert not any(token.encode() in cmd for cmd in _cmdlines().values()), (
                "Ray token on a command line"
            )
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
            assert secret.encode() not in data and password.encode() not in data, (
                f"secret in {path}"
            )
            for token in tokens:
                assert token.encode() not in data, f"Ray token in {path}"
    # ... yet the worker had the real value: it logged the value's hash
    digest = hashlib.sha256(secret.encode()).hexdigest()
    assert f"secret sha256 {digest}" in (run_dir / "logs/local/rank0.log").read_text()
    plan = json.loads((run_dir / "plan.json").read_text())
    env = plan["nodes"][0]["env"]
    assert (
        env["MY_API_TOKEN"] == "****"
        and env["DB_PASSWORD"] == "****"
        and env["PLAIN_SETTING"] == "visible-1"
    )
    recorded = yaml.safe_load((run_dir / "job.yaml").read_text())
    assert recorded["launch"]["env"] == {
        "MY_API_TOKEN": "****",
        "DB_PASSWORD": "****",
        "PLAIN_SETTING": "visible-1",
    }
    # files that hold (masked) env are private to their owner
    for name in ("job.yaml", "cluster.yaml", "plan.json"):
        mode = (run_dir / name).stat().st_mode & 0o777
        assert mode == 0o600, f"{name} is {oct(mode)}"
    assert not (ROOT / "runs" / run_dir.name).exists()
