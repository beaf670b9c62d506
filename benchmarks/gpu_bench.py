"""The GPU performance comparison in one run: Hugging Face's BERT against ours, a bare DDP
loop, and the trainer under ``torchrun`` and under ``launch``, with the ratios the targets
are stated in.

    python benchmarks/gpu_bench.py [--steps 200] [--only NAME,...] [--repeat 3] [--out DIR]

How it measures: docs/performance.md, under its name.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import add_sets, environment, parser, progress

ROOT = Path(__file__).resolve().parents[1]
BERT_DDP, BERT_FSDP, GPT_FSDP = "jobs/bert_ddp.yaml", "jobs/bert_fsdp.yaml", "jobs/gpt_fsdp.yaml"

# name -> (how, job, gpus, extra --set)
TRAINER_RUNS: dict[str, tuple[str, str, int, list[str]]] = {
    "bert-ddp-torchrun-1": ("torchrun", BERT_DDP, 1, []),
    "bert-ddp-launch-1": ("launch", BERT_DDP, 1, []),
    "bert-ddp-torchrun-2": ("torchrun", BERT_DDP, 2, []),
    "bert-ddp-launch-2": ("launch", BERT_DDP, 2, []),
    "bert-fsdp-launch-1": ("launch", BERT_FSDP, 1, []),
    "bert-fsdp-launch-2": ("launch", BERT_FSDP, 2, []),
    "gpt-small-fsdp-launch-1": ("launch", GPT_FSDP, 1, ["model.size=small"]),
    "gpt-base-fsdp-launch-1": ("launch", GPT_FSDP, 1, ["model.size=base"]),
}
PAIRS = {"hf-vs-ours-eager": [], "hf-vs-ours-compiled": ["--compile"]}
# name -> (gpus, benchmarks/ddp_ref.py arguments): a bare DDP loop, the scaling reference
REF_RUNS: dict[str, tuple[int, list[str]]] = {
    "hf-ddp-ref-1": (1, ["--model", "hf"]),
    "hf-ddp-ref-2": (2, ["--model", "hf"]),
    "ours-ddp-ref-1": (1, ["--model", "ours", "--compile"]),
    "ours-ddp-ref-2": (2, ["--model", "ours", "--compile"]),
}
ALL_RUNS = [*PAIRS, *REF_RUNS, *TRAINER_RUNS]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]


def main() -> None:
    p = parser(__doc__)
    p.add_argument(
        "--steps", type=int, default=200, help="optimizer steps per trainer run (30 are warm-up)"
    )
    p.add_argument(
        "--only", default="", help=f"comma-separated run names (default: all): {','.join(ALL_RUNS)}"
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of all runs, interleaved (every other round in reverse order); each run "
        "reports its median round and the range",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="folder for results.json and run directories"
    )
    add_sets(
        p,
        "a job override for every trainer run, e.g. train.profile.start_step=100 "
        "(traces land in each run's folder: run/profile/ or profile/)",
    )
    args = p.parse_args()
    if args.repeat < 1 or args.steps <= 30:
        p.error("--repeat must be at least 1 and --steps above 30 (the warm-up)")
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    only = {s for s in args.only.split(",") if s}
    unknown = only - set(ALL_RUNS)
    if unknown:
        p.error(f"unknown run names {sorted(unknown)}; known: {', '.join(ALL_RUNS)}")
    names = [n for n in ALL_RUNS if not only or n in only]
    rounds: dict[str, list[dict]] = {n: [] for n in names}
    env, planned = environment(), len(names) * args.repeat
    gpus = len(env["gpus"])
    for r in range(args.repeat):
        for name in names if r % 2 == 0 else names[::-1]:
            folder = out / (name if args.repeat == 1 else f"{name}.{r}")
            result = _one(name, args.steps, gpus, folder, args.sets)
            rounds[name].append(result)
            progress(name if args.repeat == 1 else f"{name} (round {r + 1})", result, 1)
            # Rewritten after every run: a bench stopped part-way keeps what it measured.
            summary = _summary(rounds, planned, env)
            (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(_table(summary["results"], summary["ratios"], summary["ratios_by_round"]))
    print(f"\nresults: {out / 'results.json'}")


def _summary(rounds: dict[str, list[dict]], planned: int, env: dict) -> dict:
    """results.json: each run's median round, the ratios, the ratios by round, and how many of
    the planned runs are in it (runs not yet made are left out)."""
    done = {name: runs for name, runs in rounds.items() if runs}
    results = {name: _median_round(runs) for name, runs in done.items()}
    runs = sum(len(r) for r in done.values())
    return {
        "results": results,
        "ratios": _ratios(results),
        "ratios_by_round": _ratios_by_round(done),
        "runs": runs,
        "runs_planned": planned,
        "complete": runs == planned,
        "env": env,
    }


def _one(name: str, steps: int, gpus: int, folder: Path, extra_sets: list[str]) -> dict:
    """One run of ``name``; a dict with its throughput, or ``error`` / ``skipped``."""
    if name in PAIRS:
        pair = "--device cuda --size base --seq 512 --micro-batch 32 --steps 40 --warmup 15 --json"
        cmd = [
            sys.executable,
            str(ROOT / "benchmarks/trainer_vs_hf.py"),
            *pair.split(),
            *PAIRS[name],
        ]
        res, data = _run_json(cmd, Path(f"{folder}.log"))
        if data is None:
            return {"error": res["tail"]}
        return {
            "ours_tokens_per_s": data["launcher"]["tokens_per_s"],
            "hf_tokens_per_s": data["hf"]["tokens_per_s"],
            "ratio": data["ratio"],
            "wall_s": res["wall_s"],
        }
    n = REF_RUNS[name][0] if name in REF_RUNS else TRAINER_RUNS[name][2]
    if n > gpus:
        return {"skipped": f"needs {n} GPUs, this machine has {gpus}"}
    if name in REF_RUNS:
        cmd = [*TORCHRUN, str(n), str(ROOT / "benchmarks/ddp_ref.py"), *REF_RUNS[name][1]]
        res, data = _run_json(cmd, Path(f"{folder}.log"))
        if data is None:
            return {"error": res["tail"]}
        per_gpu = data["tokens_per_s_per_gpu"]
        return {
            "how": "ddp_ref",
            "gpus": n,
            "tokens_per_s": per_gpu * n,
            "tokens_per_s_per_gpu": per_gpu,
            "mfu": None,
            "step_ms_p50": max(r["p50_ms"] for r in data["ranks"]),
            "wall_s": res["wall_s"],
        }
    how, job, n, sets = TRAINER_RUNS[name]
    sets = [
        *sets,
        f"train.steps={steps}",
        "train.warmup_steps=30",
        "train.log_every=30",
        *extra_sets,
    ]
    return _trainer_run(how, job, n, sets, folder)


def _median_round(runs: list[dict]) -> dict:
    """The round with the median throughput (the lower middle of an even count), plus every
    round's throughput; an error in any round is the result."""
    failed = [r for r in runs if "tokens_per_s" not in r and "ratio" not in r]
    if failed:
        return failed[0]
    key = "ratio" if "ratio" in runs[0] else "tokens_per_s"
    ordered = sorted(runs, key=lambda r: r[key])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    if len(runs) > 1:
        chosen["rounds"] = [round(r[key], 3 if key == "ratio" else 0) for r in runs]
    return chosen


def _trainer_run(how: str, job: str, n: int, sets: list[str], folder: Path) -> dict:
    # a fresh folder: metrics files append, and `launch` refuses a --run-dir that holds a run
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    set_args = [a for s in sets for a in ("--set", s)]
    if how == "torchrun":
        metrics = folder / "metrics"
        metrics.mkdir(exist_ok=True)
        env = {
            **os.environ,
            "LAUNCHER_METRICS_FILE": str(metrics / "rank{rank}.jsonl"),
            "LAUNCHER_PROFILE_DIR": str(folder / "profile"),
        }
        cmd = [*TORCHRUN, str(n), "-m", "launcher.train", "--job", str(ROOT / job), *set_args]
        res = _run(cmd, folder / "torchrun.log", env=env)
        finals = []
        for path in sorted(metrics.glob("rank*.jsonl")):
            recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            finals += [r for r in recs if r.get("type") == "final"]
        if not res["ok"] or len(finals) != n:
            return {"error": res["tail"]}
        tps = sum(f["tokens_per_s"] for f in finals)
        mfus = [f["mfu"] for f in finals if f.get("mfu") is not None]
        return {
            "how": how,
            "gpus": n,
            "tokens_per_s": tps,
            "tokens_per_s_per_gpu": tps / n,
            "mfu": sum(mfus) / len(mfus) if mfus else None,
            "step_ms_p50": max(f["step_time_ms_p50"] for f in finals),
            "wall_s": res["wall_s"],
        }
    run_dir = folder / "run"
    cmd = [sys.executable, "-m", "launcher", str(ROOT / job), "--run-dir", str(run_dir)]
    cmd += ["--set", f"resources.nproc_per_node={n}", *set_args]
    res = _run(cmd, folder / "launch.log")
    summary_path = run_dir / "summary.json"
    if not res["ok"] or not summary_path.exists():
        return {"error": res["tail"]}
    s = json.loads(summary_path.read_text())
    t = s["totals"]
    return {
        "how": how,
        "gpus": n,
        "tokens_per_s": t["tokens_per_s"],
        "tokens_per_s_per_gpu": t["tokens_per_s_per_gpu"],
        "mfu": t["mfu"],
        "step_ms_p50": max(r["step_time_ms_p50"] for r in s["ranks"]),
        "wall_s": res["wall_s"],
    }


def _ratios(r: dict) -> dict:
    def tps(name: str, key: str = "tokens_per_s_per_gpu") -> float | None:
        return r.get(name, {}).get(key)

    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    hf_eager = r.get("hf-vs-ours-eager", {}).get("hf_tokens_per_s")
    return {
        "launch_1gpu_over_hf_eager": div(tps("bert-ddp-launch-1", "tokens_per_s"), hf_eager),
        "ours_compiled_over_hf_eager": div(
            r.get("hf-vs-ours-compiled", {}).get("ours_tokens_per_s"), hf_eager
        ),
        "ours_eager_over_hf_eager": r.get("hf-vs-ours-eager", {}).get("ratio"),
        "ddp_scaling_efficiency_2gpu": div(tps("bert-ddp-launch-2"), tps("bert-ddp-launch-1")),
        "fsdp_scaling_efficiency_2gpu": div(tps("bert-fsdp-launch-2"), tps("bert-fsdp-launch-1")),
        "launch_over_torchrun_1gpu": div(tps("bert-ddp-launch-1"), tps("bert-ddp-torchrun-1")),
        "launch_over_torchrun_2gpu": div(tps("bert-ddp-launch-2"), tps("bert-ddp-torchrun-2")),
        "ddp_scaling_efficiency_2gpu_torchrun": div(
            tps("bert-ddp-torchrun-2"), tps("bert-ddp-torchrun-1")
        ),
        "hf_ddp_ref_scaling_efficiency_2gpu": div(tps("hf-ddp-ref-2"), tps("hf-ddp-ref-1")),
        "ours_ddp_ref_scaling_efficiency_2gpu": div(tps("ours-ddp-ref-2"), tps("ours-ddp-ref-1")),
    }


def _ratios_by_round(rounds: dict[str, list[dict]]) -> list[dict]:
    """The ratios within each round. A round's runs ran back to back, so these compare like
    with like; the median rounds of two runs may come from different rounds (one stalled run
    then skews a ratio that no round shows). A round cut short gives the ratios of the runs it
    made (None for the others)."""
    count = max((len(runs) for runs in rounds.values()), default=0)
    return [
        _ratios({name: runs[i] for name, runs in rounds.items() if i < len(runs)})
        for i in range(count)
    ]


def _table(results: dict, ratios: dict, by_round: list[dict] | None = None) -> str:
    from tabulate import tabulate

    by_round = by_round or []
    rows = []
    for name, r in results.items():
        if "ratio" in r:
            tps = f"{r['ours_tokens_per_s']:,.0f} (HF {r['hf_tokens_per_s']:,.0f})"
            rows.append([name, "1", tps, "", "", "", "", _span(r)])
        elif "tokens_per_s" in r:
            rows.append(
                [
                    name,
                    r["gpus"],
                    f"{r['tokens_per_s']:,.0f}",
                    f"{r['tokens_per_s_per_gpu']:,.0f}",
                    f"{100 * r['mfu']:.1f}" if r.get("mfu") else "–",
                    f"{r['step_ms_p50']:.1f}",
                    f"{r['wall_s']:.0f}",
                    _span(r),
                ]
            )
        else:
            failed = r.get("skipped") or "FAILED: " + r.get("error", "")[-200:]
            rows.append([name, "", failed, "", "", "", "", ""])
    headers = [
        "run",
        "GPUs",
        "tokens/s",
        "tokens/s/GPU",
        "MFU %",
        "step ms p50",
        "wall s",
        "rounds (min-max)",
    ]
    table = tabulate(rows, headers=headers)
    lines = []
    for k, v in ratios.items():
        if v is None:
            continue
        per_round = ", ".join(f"{r[k]:.3f}" for r in by_round if r.get(k) is not None)
        lines.append(f"{k}: {v:.3f}" + (f" (by round: {per_round})" if len(by_round) > 1 else ""))
    return table + "\n\n" + "\n".join(lines)


def _span(r: dict) -> str:
    rounds = r.get("rounds")
    if not rounds:
        return ""
    fmt = "{:.2f}" if "ratio" in r else "{:,.0f}"
    return f"{fmt.format(min(rounds))}-{fmt.format(max(rounds))}"


def _run_json(cmd: list[str], log: Path) -> tuple[dict, dict | None]:
    """``_run``, and the JSON document the command printed last (None if it failed)."""
    res = _run(cmd, log)
    return res, json.loads(res["stdout"].strip().splitlines()[-1]) if res["ok"] else None


def _run(cmd: list[str], log: Path, env: dict | None = None) -> dict:
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - start
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    return {"ok": proc.returncode == 0, "stdout": proc.stdout, "tail": tail, "wall_s": wall}


if __name__ == "__main__":
    main()
