"""GPU check of diagnosis: GPU telemetry's cost on throughput, and `launch doctor` on a real run.

    python benchmarks/doctor_gpu.py [--job jobs/gpt.yaml] [--repeat 3] [--out runs/doctor-gpu]

Needs a CUDA GPU and nvidia-ml-py (the gpu extra). How it measures: docs/performance.md, under
its name.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import launch_run


def launch(job: str, run_dir: Path, telemetry_s: str, steps: int) -> float:
    sets = ["resources.nproc_per_node=1", f"train.steps={steps}"]
    sets.append(f"launch.env.LAUNCHER_TELEMETRY_S={telemetry_s}")
    subprocess.run(launch_run(job, run_dir, sets), check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    return float(summary["totals"]["tokens_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default="jobs/gpt.yaml")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--on-every", default="5", help="seconds between samples with telemetry on (default 5)"
    )
    parser.add_argument("--out", type=Path, default=Path(f"runs/doctor-gpu-{int(time.time())}"))
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"off": [], "on": []}
    last_on = None
    for i in range(args.repeat):
        for name, every in (("off", "0"), ("on", args.on_every)):
            run_dir = args.out / f"{name}-{i}"
            rate = launch(args.job, run_dir, every, args.steps)
            rates[name].append(rate)
            print(f"round {i} telemetry {name:3}: {rate:,.0f} tokens/s  ({run_dir})", flush=True)
            if name == "on":
                last_on = run_dir
    ratios = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
    overhead = 100 * (1 - statistics.median(ratios))
    print(
        f"telemetry overhead: {overhead:+.2f}% of tokens/s (median of {len(ratios)} paired "
        f"rounds; ratios {', '.join(f'{r:.4f}' for r in ratios)}); target < 0.5%"
    )
    assert last_on is not None
    samples = sum(1 for _ in (last_on / "telemetry").glob("*.jsonl"))
    print(f"telemetry files in {last_on}: {samples}")
    subprocess.run([sys.executable, "-m", "launcher", "doctor", str(last_on)], check=True)


if __name__ == "__main__":
    main()
