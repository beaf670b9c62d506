"""What the launcher adds to a job's wall time, against bare torchrun on the same job.

    python benchmarks/launch_overhead.py [--job jobs/quickstart.yaml] [--repeat 3]

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


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--job", default=str(ROOT / "jobs/quickstart.yaml"))
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="launch-overhead-"))
    job = yaml.safe_load(Path(args.job).read_text())
    nproc = job.get("resources", {}).get("nproc_per_node", 1)
    nproc = 1 if nproc == "auto" else nproc
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token"}

    port = 6500 + os.getpid() % 400
    ray_start = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}"]
    started = subprocess.run(
        [*ray_start, "--include-dashboard=false", "--disable-usage-stats"],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    if started.returncode != 0:
        sys.exit(f"could not start Ray for attach mode: {started.stderr[-500:]}")
    ip = subprocess.run(
        [sys.executable, "-c", "import ray._private.services as s; print(s.get_node_ip_address())"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    local = {"nodes": [{"name": "local", "host": "localhost"}]}
    attach = work / "attach-cluster.yaml"
    attach.write_text(yaml.safe_dump({**local, "ray": {"address": f"{ip}:{port}"}}))
    embedded = work / "cluster.yaml"
    embedded.write_text(yaml.safe_dump(local))

    def launch(cluster: Path, *extra: str) -> list[str]:
        return [sys.executable, "-m", "launcher", args.job, "--cluster", str(cluster), *extra]

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    ray_alone = (
        "import ray; ray.init(address='local', include_dashboard=False, log_to_driver=False)"
    )
    commands = {
        "bare torchrun": [*torchrun, str(nproc), "-m", "launcher.train", "--job", args.job],
        "launch, attach, --skip-parity": launch(attach, "--skip-parity"),
        "launch, attach": launch(attach),
        "launch, embedded, --skip-parity": launch(embedded, "--skip-parity"),
        "launch, embedded": launch(embedded),
        "Ray start+stop alone": [sys.executable, "-c", f"{ray_alone}; ray.shutdown()"],
    }
    times: dict[str, list[float]] = {k: [] for k in commands}
    try:
        for i in range(args.repeat):
            for name, cmd in commands.items():
                if cmd[:3] == [sys.executable, "-m", "launcher"]:
                    run_dir = work / f"{name.replace(' ', '_').replace(',', '')}-{i}"
                    cmd = [*cmd, "--run-dir", str(run_dir)]
                start = time.monotonic()
                proc = subprocess.run(
                    cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900
                )
                took = time.monotonic() - start
                if proc.returncode != 0:
                    sys.exit(
                        f"{name} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}"
                    )
                times[name].append(took)
                print(f"[{i + 1}/{args.repeat}] {name}: {took:.1f} s", flush=True)
    finally:
        for pid in _pids_with(str(port)):
            os.kill(pid, 9)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["bare torchrun"]
    print(
        f"\njob {args.job}, {nproc} worker(s), median of {args.repeat}; Ray start+stop alone: "
        f"{med['Ray start+stop alone']:.1f} s"
    )
    print(f"{'':34}{'wall s':>8}{'added s':>9}")
    for name, value in med.items():
        if name != "Ray start+stop alone":
            print(f"{name:34}{value:8.1f}{value - base:9.1f}")
    (work / "launch_overhead.json").write_text(
        json.dumps({"times": times, "median": med}, indent=2)
    )
    print(f"\nresults: {work / 'launch_overhead.json'}")


def _pids_with(text: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmd and ("ray" in cmd or "gcs_server" in cmd or "raylet" in cmd):
                out.append(int(entry))
    return out


if __name__ == "__main__":
    main()
