"""What checkpoints cost a run: training's wait per checkpoint, synchronous against background.

    python benchmarks/checkpoint_cost.py [--job jobs/gpt.yaml] [--steps 100] [--every 10]
                                         [--modes none,sync,async] [--out DIR]

Runs ``launch JOB`` once per mode (no checkpoints; ``train.checkpoint.async: false``; ``true``)
with a checkpoint every ``--every`` steps into a fresh folder, and prints from each run's
``summary.json``: the wait per checkpoint (mean, max; the slowest rank per checkpoint), how many
completed, tokens/s over the measured steps and the p50 step time (the steps without a
checkpoint: their throughput must not fall).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--job", default=str(ROOT / "jobs/gpt.yaml"))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--modes", default="none,sync,async")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--out", type=Path, default=Path(f"runs/checkpoint-cost-{int(time.time())}"))
    args = p.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for mode in args.modes.split(","):
        ckpt = out / f"ckpt-{mode}"
        sets = [f"train.steps={args.steps}", *args.overrides]
        if mode != "none":
            sets += [
                f"train.checkpoint.dir={ckpt}",
                f"train.checkpoint.every_steps={args.every}",
                f"train.checkpoint.async={'true' if mode == 'async' else 'false'}",
            ]
        cmd = [sys.executable, "-m", "launcher", "run", args.job, "--run-dir", str(out / mode)]
        for item in sets:
            cmd += ["--set", item]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        (out / f"{mode}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            results[mode] = {"error": proc.stderr.strip()[-600:]}
            print(mode, results[mode], flush=True)
            continue
        summary = json.loads((out / mode / "summary.json").read_text())
        rank0 = summary["ranks"][0]
        results[mode] = {
            "checkpoints": summary.get("checkpoints"),
            "tokens_per_s": summary["totals"]["tokens_per_s"],
            "step_time_ms_p50": rank0["step_time_ms_p50"],
            "step_time_ms_p95": rank0["step_time_ms_p95"],
            "checkpoint_gib": round(_size(ckpt) / 2**30 / max(1, args.steps // args.every), 2)
            if ckpt.exists()
            else None,
        }
        print(mode, json.dumps(results[mode]), flush=True)
        shutil.rmtree(ckpt, ignore_errors=True)
    (out / "checkpoint_cost.json").write_text(json.dumps(results, indent=2) + "\n")


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


if __name__ == "__main__":
    main()
