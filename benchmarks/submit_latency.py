"""How long `launch submit` takes to hand back a job id, and to the job's first training step,
against a foreground `launch` of the same job, both on an already-running Ray.

    python benchmarks/submit_latency.py [--job jobs/quickstart.yaml] [--repeat 3]

How it measures: docs/performance.md, under its name.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import parser

ROOT = Path(__file__).resolve().parents[1]
FIRST_STEP = "/rank0] step "
SETS = ("train.steps=4", "train.warmup_steps=1", "train.log_every=1", "train.lr_warmup_steps=1")
OVERRIDES = tuple(a for s in SETS for a in ("--set", s))


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--job", default=str(ROOT / "jobs/quickstart.yaml"))
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="submit-latency-"))
    env = {
        **os.environ,
        "LAUNCHER_STATE_DIR": str(work / "state"),
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x),
    }
    os.environ.update({k: env[k] for k in ("LAUNCHER_STATE_DIR", "RAY_USAGE_STATS_ENABLED")})
    sys.path.insert(0, str(ROOT))
    from ray.job_submission import JobSubmissionClient

    from launcher.jobs.head import local_head, stop_local_head

    head = local_head(start=True)
    client = JobSubmissionClient(head.jobs_url, headers={"Authorization": f"Bearer {head.token()}"})
    local = {"nodes": [{"name": "local", "host": "localhost"}]}
    attach = work / "attach-cluster.yaml"
    attach.write_text(yaml.safe_dump({**local, "ray": {"address": f"127.0.0.1:{head.gcs_port}"}}))
    fg_env = {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": head.token_file}

    rows: dict[str, list[float]] = {}
    try:
        for i in range(args.repeat):
            for flags, label in (((), "with preflight"), (("--skip-parity",), "--skip-parity")):
                to_id, to_step = submit_once(args.job, flags, env, work, client)
                fg_step = foreground_once(args.job, flags, fg_env, work, attach, i)
                for name, value in (
                    (f"submit → job id ({label})", to_id),
                    (f"submit → first step ({label})", to_step),
                    (f"foreground launch → first step ({label})", fg_step),
                ):
                    rows.setdefault(name, []).append(value)
                print(
                    f"[{i + 1}/{args.repeat}] {label}: id {to_id:.2f} s, first step {to_step:.2f} s; "
                    f"foreground first step {fg_step:.2f} s",
                    flush=True,
                )
    finally:
        stop_local_head(head)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(
        f"\n{args.job}, {os.cpu_count()} CPU(s), load average {os.getloadavg()[0]:.1f}, "
        f"median of {args.repeat}"
    )
    for name, value in med.items():
        print(f"{name:48}{value:7.2f} s")
    (work / "submit_latency.json").write_text(json.dumps({"times": rows, "median": med}, indent=2))
    print(f"\nresults: {work / 'submit_latency.json'}")


def submit_once(
    job: str, flags: tuple[str, ...], env: dict[str, str], work: Path, client
) -> tuple[float, float]:  # noqa: ANN001 - a JobSubmissionClient
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "launcher", "submit", job, "--json", *flags, *OVERRIDES],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    to_id = time.monotonic() - start
    if proc.returncode != 0:
        sys.exit(
            f"launch submit failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}"
        )
    job_id = json.loads(proc.stdout.strip().splitlines()[-1])["job_id"]
    while (status := client.get_job_status(job_id)).value == "PENDING" or (
        FIRST_STEP not in client.get_job_logs(job_id)
    ):
        if status.is_terminal():
            sys.exit(
                f"job {job_id} ended before its first step:\n{client.get_job_logs(job_id)[-2000:]}"
            )
        time.sleep(0.2)
    to_step = time.monotonic() - start
    while not client.get_job_status(job_id).is_terminal():  # one job at a time
        time.sleep(0.5)
    return to_id, to_step


def foreground_once(
    job: str, flags: tuple[str, ...], env: dict[str, str], work: Path, cluster: Path, i: int
) -> float:
    start = time.monotonic()
    run_dir = work / f"foreground-{i}-{len(flags)}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher", job, "--cluster", str(cluster), *flags, *OVERRIDES]
        + ["--run-dir", str(run_dir)],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    first = None
    for line in proc.stdout:
        if first is None and FIRST_STEP in line:
            first = time.monotonic() - start
    if proc.wait() != 0 or first is None:
        sys.exit(f"foreground launch failed ({proc.returncode}); see {run_dir}")
    return first


if __name__ == "__main__":
    main()
