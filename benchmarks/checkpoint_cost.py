"""What checkpoints cost a run: training's wait per checkpoint, synchronous against background,
at one or more intervals and writer thread counts, and what each wait went to.

    python benchmarks/checkpoint_cost.py [--job jobs/gpt.yaml] [--steps 150] [--every 10,50]
                                         [--modes none,async,sync] [--threads 4]
                                         [--set KEY=VALUE ...] [--out DIR]

How it measures: docs/performance.md, under its name.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from common import launch_run, parser

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--job", default=str(ROOT / "jobs/gpt.yaml"))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--every", default="10,50", help="checkpoint intervals, comma-separated")
    p.add_argument("--modes", default="none,async,sync")
    p.add_argument("--threads", default="4", help="write_threads values, comma-separated")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--out", type=Path, default=Path(f"runs/checkpoint-cost-{int(time.time())}"))
    args = p.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    modes = args.modes.split(",")
    runs: list[tuple[str, int | None, int | None]] = (
        [("none", None, None)] if "none" in modes else []
    )
    for mode in (m for m in modes if m != "none"):  # in the order given: the first ones first
        for every in (int(e) for e in args.every.split(",")):
            runs += [(mode, every, int(t)) for t in args.threads.split(",")]
    results: dict[str, Any] = {}
    for mode, every, threads in runs:
        name = mode if every is None else f"{mode}-every{every}-threads{threads}"
        results[name] = {"mode": mode, "every": every, "threads": threads}
        results[name].update(_run(args, out, name, mode, every, threads))
        print(name, json.dumps(results[name]), flush=True)
        (out / "checkpoint_cost.json").write_text(json.dumps(results, indent=2) + "\n")
    print()
    print(table(results))


def _run(
    args: argparse.Namespace,
    out: Path,
    name: str,
    mode: str,
    every: int | None,
    threads: int | None,
) -> dict[str, Any]:
    ckpt = out / f"ckpt-{name}"
    sets = [f"train.steps={args.steps}", *args.overrides]
    if every is not None:
        sets += [
            f"train.checkpoint.dir={ckpt}",
            f"train.checkpoint.every_steps={every}",
            f"train.checkpoint.async={'true' if mode == 'async' else 'false'}",
            f"train.checkpoint.write_threads={threads}",
        ]
    proc = subprocess.run(launch_run(args.job, out / name, sets), capture_output=True, text=True)
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    try:
        if proc.returncode != 0:
            return {"error": proc.stderr.strip()[-600:]}
        summary = json.loads((out / name / "summary.json").read_text())
        rank0 = summary["ranks"][0]
        saves = max(1, args.steps // every) if every else 1
        return {
            "checkpoints": summary.get("checkpoints"),
            "tokens_per_s": summary["totals"]["tokens_per_s"],
            "step_time_ms_p50": rank0["step_time_ms_p50"],
            "step_time_ms_p95": rank0["step_time_ms_p95"],
            "checkpoint_gib": round(_size(ckpt) / 2**30 / saves, 2) if ckpt.exists() else None,
        }
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)


def table(results: dict[str, Any]) -> str:
    """The runs as a Markdown table (seconds; the parts are means over the checkpoints)."""
    head = (
        "| run | wait mean (max) | first | wait for previous | state | setup | copy | write "
        "| other | save completes | tokens/s | p50 step |"
    )
    lines = [head, "|" + "---|" * 12]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][-80:]!r} |" + " |" * 10)
            continue
        c = r.get("checkpoints") or {}
        parts = c.get("blocking_parts_s_mean") or {}

        def s(value: Any) -> str:
            return "–" if value is None else f"{value:.2f}"

        wait = f"{s(c.get('blocking_s_mean'))} ({s(c.get('blocking_s_max'))})" if c else "–"
        cells = [
            name,
            wait,
            s(c.get("first_blocking_s")),
            *(s(parts.get(k)) for k in ("wait", "state", "setup", "stage", "write", "other")),
            s(c.get("save_s_mean")),
            f"{r['tokens_per_s']:,.0f}",
            f"{r['step_time_ms_p50']:.2f} ms",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


if __name__ == "__main__":
    main()
