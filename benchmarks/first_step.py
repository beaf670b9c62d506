"""Time from the command to the first optimizer step, per stage, in several cache states.

    python benchmarks/first_step.py [--job jobs/gpt.yaml] [--scenarios cold,before,warm,node,head]
                                    [--set KEY=VALUE ...] [--out DIR]

Each scenario runs ``launch JOB --set train.steps=N`` once and reads the stages from what the
run recorded (docs/performance.md, "The first step"). Scenarios:

  cold    fresh inductor, Triton and launcher compile caches; Ray started for the run
  before  as the launcher ran before the compile cache and head reuse: inductor's on-disk cache
          warm, ``train.compile_cache: false``, Ray started for the run
  warm    inductor's and the launcher's caches warm, Ray started for the run
  node    a new node of the job: fresh inductor and Triton caches, the launcher's compile cache
          (a shared folder) filled; Ray started for the run
  head    warm caches, ``launch up`` beforehand: the run attaches to the running head
  attach  warm caches, a Ray head started beforehand (``ray start --head``; where the launcher's
          own head cannot run, e.g. without Ray's dashboard packages): the run attaches to it

Writes ``first_step.json`` in --out and prints one table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import launch_run, parser

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER_STAGES = ("start", "run dir", "preflight", "ray", "agents")


def run_once(
    job: str, run_dir: Path, env: dict[str, str], overrides: list[str], cluster: Path | None = None
) -> dict[str, Any]:
    extra = () if cluster is None else ("--cluster", str(cluster))
    cmd = launch_run(job, run_dir, overrides, *extra)
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    (run_dir.parent / f"{run_dir.name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}", "wall_s": wall}
    return stages(run_dir, t0) | {"wall_s": round(wall, 2)}


def stages(run_dir: Path, t0: float) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [
        json.loads(line) for line in (run_dir / "metrics/rank0.jsonl").read_text().splitlines()
    ]
    meta = next(r for r in records if r["type"] == "meta")
    first = next(r for r in records if r["type"] == "first_step")
    timings = summary.get("launcher_timings_s", {})
    out: dict[str, Any] = {f"launcher {k}": timings.get(k) for k in LAUNCHER_STAGES}
    launcher_s = sum(v or 0.0 for v in out.values())
    for key, wall in timings.items():
        if "+" in key:  # stages run side by side (``preflight+ray``): their wall counts once
            out[f"launcher {key}"] = wall
            launcher_s += wall - sum(timings.get(stage, 0.0) for stage in key.split("+"))
    startup = dict(meta["startup_s"])
    worker_started = meta["time"] - sum(startup.values())  # the worker process's own start
    out["torchrun start"] = round(worker_started - t0 - launcher_s, 2)
    for name, seconds in startup.items():
        out[f"worker {'imports' if name == 'process' else name}"] = seconds
    out["first step"] = round(first["time"] - meta["time"], 2)
    out["to first step"] = round(first["time"] - t0, 2)
    out["compile phases"] = first.get("compile_s")
    out["compile cache loaded"] = first.get("compile_cache_loaded")
    out["compile cache hits"] = first.get("compile_cache_hits")
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--job", default=str(ROOT / "jobs/gpt.yaml"))
    p.add_argument("--scenarios", default="cold,before,warm,node,head")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--out", type=Path, default=Path(f"runs/first-step-{int(time.time())}"))
    args = p.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    shared = out / "launcher-compile-cache"
    caches = {"n": 0}

    def fresh_node_caches() -> dict[str, str]:
        caches["n"] += 1
        base = out / f"node{caches['n']}"
        return {
            "TORCHINDUCTOR_CACHE_DIR": str(base / "inductor"),
            "TRITON_CACHE_DIR": str(base / "triton"),
        }

    node_env = fresh_node_caches()
    base_env = {**os.environ, "LAUNCHER_COMPILE_CACHE": str(shared), "RAY_USAGE_STATS_ENABLED": "0"}
    overrides = [f"train.steps={args.steps}", *args.overrides]
    results: dict[str, Any] = {}
    head_up = False
    ray_head: subprocess.Popen | None = None
    try:
        for name in args.scenarios.split(","):
            env = {**base_env, **node_env}
            extra: list[str] = []
            cluster = None
            if name == "attach":
                cluster = out / "attach-cluster.yaml"
                if ray_head is None:
                    ray_head, port = start_ray_head(out, env)
                    cluster.write_text(
                        "nodes: [{name: local, host: localhost}]\n"
                        f"ray: {{address: '127.0.0.1:{port}'}}\n"
                    )
            if name == "before":
                extra = ["train.compile_cache=false"]
            elif name == "node":
                env = {**base_env, **fresh_node_caches()}
            elif name == "head" and not head_up:
                subprocess.run([sys.executable, "-m", "launcher", "up"], env=base_env, check=True)
                head_up = True
            elif name not in ("cold", "warm", "head", "attach"):
                raise SystemExit(f"unknown scenario {name!r}")
            results[name] = run_once(args.job, out / name, env, overrides + extra, cluster)
            print(name, json.dumps(results[name]), flush=True)
            (out / "first_step.json").write_text(json.dumps(results, indent=2) + "\n")
    finally:
        if ray_head is not None:  # `ray start --block` stops what it started on SIGTERM
            ray_head.terminate()
            ray_head.wait(timeout=60)
        if head_up:
            subprocess.run([sys.executable, "-m", "launcher", "down", "--yes"], env=base_env)
    print_table(results)


def start_ray_head(out: Path, env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    """``ray start --head --block`` on a free port, waited for until it answers."""
    from launcher.util import free_port

    port = free_port()
    log = open(out / "ray-head.log", "wb")  # noqa: SIM115 - open for the head's lifetime
    env = {**env, "RAY_AUTH_MODE": "token"}
    ray_start = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block"]
    head = subprocess.Popen(
        [*ray_start, "--port", str(port), "--include-dashboard=false", "--disable-usage-stats"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    connect = f"import ray; ray.init(address='127.0.0.1:{port}'); ray.shutdown()"
    probe = [sys.executable, "-c", connect]
    while subprocess.run(probe, env=env, capture_output=True).returncode:
        if head.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"ray start --head failed; see {out / 'ray-head.log'}")
        time.sleep(1)
    return head, port


def print_table(results: dict[str, Any]) -> None:
    rows = list(
        dict.fromkeys(
            k
            for r in results.values()
            for k, v in r.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        )
    )
    names = list(results)
    print(f"{'stage (s)':28}" + "".join(f"{n:>10}" for n in names))
    for row in rows:
        cells = []
        for n in names:
            v = results[n].get(row)
            cells.append(f"{v:10.2f}" if isinstance(v, (int, float)) else f"{'-':>10}")
        print(f"{row:28}" + "".join(cells))


if __name__ == "__main__":
    main()
