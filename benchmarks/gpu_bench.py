"""The GPU performance comparison in one run (see README "Performance").

Runs, side by side on this machine's GPUs:
  * Hugging Face ``BertForMaskedLM`` vs this trainer's BERT, eager and compiled, one process
    (benchmarks/trainer_vs_hf.py);
  * the built-in trainer under bare ``torchrun -m launcher.train`` and under ``launch`` (Ray +
    agents + metering), BERT-base DDP and FSDP on 1 and 2 GPUs, GPT small and base;
and prints one table plus the ratios the targets are stated in: ours/HF, DDP and FSDP
scaling efficiency (per-GPU tokens/s at 2 over 1), launch/torchrun throughput.

    python benchmarks/gpu_bench.py [--steps 200] [--only NAME,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per trainer run (30 are warm-up)")
    p.add_argument("--only", default="", help="comma-separated run names (default: all)")
    p.add_argument("--out", type=Path, default=None, help="folder for results.json and run directories")
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    only = {s for s in args.only.split(",") if s}
    gpus = _gpu_count()
    results: dict[str, dict] = {}

    for name, flags in PAIRS.items():
        if only and name not in only:
            continue
        cmd = [sys.executable, str(ROOT / "benchmarks/trainer_vs_hf.py"), "--device", "cuda", "--size", "base",
               "--seq", "512", "--micro-batch", "32", "--steps", "40", "--warmup", "15", "--json", *flags]
        res = _run(cmd, out / f"{name}.log")
        if res["ok"]:
            data = json.loads(res["stdout"].strip().splitlines()[-1])
            results[name] = {"ours_tokens_per_s": data["launcher"]["tokens_per_s"],
                             "hf_tokens_per_s": data["hf"]["tokens_per_s"], "ratio": data["ratio"],
                             "wall_s": res["wall_s"]}
        else:
            results[name] = {"error": res["tail"]}
        _print_progress(name, results[name])

    for name, (how, job, n, sets) in TRAINER_RUNS.items():
        if only and name not in only:
            continue
        if n > gpus:
            results[name] = {"skipped": f"needs {n} GPUs, this machine has {gpus}"}
            continue
        sets = [*sets, f"train.steps={args.steps}", "train.warmup_steps=30", "train.log_every=30"]
        results[name] = _trainer_run(how, job, n, sets, out / name)
        _print_progress(name, results[name])

    ratios = _ratios(results)
    (out / "results.json").write_text(json.dumps({"results": results, "ratios": ratios,
                                                  "env": _env()}, indent=2) + "\n")
    print(_table(results, ratios))
    print(f"\nresults: {out / 'results.json'}")


def _trainer_run(how: str, job: str, n: int, sets: list[str], folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    set_args = [a for s in sets for a in ("--set", s)]
    if how == "torchrun":
        metrics = folder / "metrics"
        metrics.mkdir(exist_ok=True)
        env = {**os.environ, "LAUNCHER_METRICS_FILE": str(metrics / "rank{rank}.jsonl")}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--standalone",
               "-m", "launcher.train", "--job", str(ROOT / job), *set_args]
        res = _run(cmd, folder / "torchrun.log", env=env)
        finals = []
        for path in sorted(metrics.glob("rank*.jsonl")):
            recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            finals += [r for r in recs if r.get("type") == "final"]
        if not res["ok"] or len(finals) != n:
            return {"error": res["tail"]}
        tps = sum(f["tokens_per_s"] for f in finals)
        mfus = [f["mfu"] for f in finals if f.get("mfu") is not None]
        return {"how": how, "gpus": n, "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / n,
                "mfu": sum(mfus) / len(mfus) if mfus else None,
                "step_ms_p50": max(f["step_time_ms_p50"] for f in finals), "wall_s": res["wall_s"]}
    run_dir = folder / "run"
    cmd = [sys.executable, "-m", "launcher", str(ROOT / job), "--run-dir", str(run_dir),
           "--set", f"resources.nproc_per_node={n}", *set_args]
    res = _run(cmd, folder / "launch.log")
    summary_path = run_dir / "summary.json"
    if not res["ok"] or not summary_path.exists():
        return {"error": res["tail"]}
    s = json.loads(summary_path.read_text())
    t = s["totals"]
    return {"how": how, "gpus": n, "tokens_per_s": t["tokens_per_s"],
            "tokens_per_s_per_gpu": t["tokens_per_s_per_gpu"], "mfu": t["mfu"],
            "step_ms_p50": max(r["step_time_ms_p50"] for r in s["ranks"]), "wall_s": res["wall_s"]}


def _ratios(r: dict) -> dict:
    def tps(name: str, key: str = "tokens_per_s_per_gpu") -> float | None:
        return r.get(name, {}).get(key)

    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    hf_eager = r.get("hf-vs-ours-eager", {}).get("hf_tokens_per_s")
    return {
        "launch_1gpu_over_hf_eager": div(tps("bert-ddp-launch-1", "tokens_per_s"), hf_eager),
        "ours_compiled_over_hf_eager": div(r.get("hf-vs-ours-compiled", {}).get("ours_tokens_per_s"), hf_eager),
        "ours_eager_over_hf_eager": r.get("hf-vs-ours-eager", {}).get("ratio"),
        "ddp_scaling_efficiency_2gpu": div(tps("bert-ddp-launch-2"), tps("bert-ddp-launch-1")),
        "fsdp_scaling_efficiency_2gpu": div(tps("bert-fsdp-launch-2"), tps("bert-fsdp-launch-1")),
        "launch_over_torchrun_1gpu": div(tps("bert-ddp-launch-1"), tps("bert-ddp-torchrun-1")),
        "launch_over_torchrun_2gpu": div(tps("bert-ddp-launch-2"), tps("bert-ddp-torchrun-2")),
    }


def _table(results: dict, ratios: dict) -> str:
    from tabulate import tabulate

    rows = []
    for name, r in results.items():
        if "ratio" in r:
            rows.append([name, "1", f"{r['ours_tokens_per_s']:,.0f} (HF {r['hf_tokens_per_s']:,.0f})", "", "", "", ""])
        elif "tokens_per_s" in r:
            rows.append([name, r["gpus"], f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s_per_gpu']:,.0f}",
                         f"{100 * r['mfu']:.1f}" if r.get("mfu") else "–", f"{r['step_ms_p50']:.1f}",
                         f"{r['wall_s']:.0f}"])
        else:
            rows.append([name, "", r.get("skipped") or "FAILED: " + r.get("error", "")[-200:], "", "", "", ""])
    table = tabulate(rows, headers=["run", "GPUs", "tokens/s", "tokens/s/GPU", "MFU %", "step ms p50", "wall s"])
    lines = [f"{k}: {v:.3f}" for k, v in ratios.items() if v is not None]
    return table + "\n\n" + "\n".join(lines)


def _run(cmd: list[str], log: Path, env: dict | None = None) -> dict:
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - start
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    return {"ok": proc.returncode == 0, "stdout": proc.stdout, "tail": tail, "wall_s": wall}


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _env() -> dict:
    import torch

    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "nccl": ".".join(map(str, torch.cuda.nccl.version()))
            if torch.cuda.is_available() else None, "gpus": names,
            "date": time.strftime("%Y-%m-%d", time.gmtime())}


def _print_progress(name: str, result: dict) -> None:
    brief = {k: (round(v, 1) if isinstance(v, float) else v) for k, v in result.items() if k != "error"}
    print(f"[{name}] {brief}" + (f"\n  error: {result['error'][-800:]}" if "error" in result else ""), flush=True)


if __name__ == "__main__":
    main()
