"""GPT-2 124M: nanoGPT's own ``train.py`` against this trainer through ``launch``, one machine.

Both sides train the same shape on the same random tokens with the same batch, optimizer and
schedule; ``--ours NAME:KEY=VALUE,...`` adds a row with more overrides, ``--fp8`` the FP8 rows.

    python benchmarks/gpt_vs_nanogpt.py [--steps 200] [--fp8] [--out DIR]

Prints one table and writes ``results.json`` under ``--out``.
How it measures: docs/performance.md, under its name.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import add_sets, environment, fmt, parser, progress

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 50304  # the model's (GPT-2's 50257 rounded up to a multiple of 64)
GPT2_TOKENS = 50257  # ids in the file: GPT-2's vocabulary
SEQ = 1024
PEAK_TFLOPS = 989.0  # H100/H200 dense bf16
LOSS_WINDOW = 20
ITER_RE = re.compile(r"^iter (\d+): loss ([0-9.naif]+), time ([0-9.]+)ms")
# torchao's tensorwise recipe on the layers its size filter picks (qkv and fc at d = 768),
# and on every block linear; rowwise's filter picks none of this model's layers.
FP8_ROWS = {
    "fp8-tensorwise": ["precision.dtype=fp8"],
    "fp8-tensorwise-all": ["precision.dtype=fp8", "precision.fp8_layers=all"],
}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps on each side")
    p.add_argument(
        "--warmup", type=int, default=30, help="steps left out of the throughput (compilation)"
    )
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr-warmup", type=int, default=20, help="linear LR warm-up steps (both sides)")
    p.add_argument("--tokens", type=int, default=20_000_000, help="random tokens in the file")
    p.add_argument("--job", default=str(ROOT / "jobs/gpt.yaml"), help="our job file")
    p.add_argument(
        "--nanogpt",
        type=Path,
        default=Path(os.environ.get("NANOGPT_DIR", ROOT.parent / "shared/peers/nanogpt")),
        help="nanoGPT's folder (train.py, model.py, configurator.py)",
    )
    p.add_argument(
        "--ours",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="another row of ours with these job overrides (repeatable)",
    )
    p.add_argument("--fp8", action="store_true", help=f"add our FP8 rows: {', '.join(FP8_ROWS)}")
    p.add_argument(
        "--nanogpt-torchrun", action="store_true", help="run nanoGPT under torchrun (DDP on 1 GPU)"
    )
    p.add_argument(
        "--direct",
        action="store_true",
        help="run our rows as `python -m launcher.train` (no Ray, "
        "no preflight: quicker to start; the trainer and its meter are the same)",
    )
    p.add_argument("--skip-nanogpt", action="store_true", help="our rows only")
    p.add_argument(
        "--nanogpt-args",
        default="",
        help="extra --key=value arguments for nanoGPT (e.g. the "
        "CPU smoke test's --device=cpu --compile=False --n_layer=1)",
    )
    add_sets(p, "a job override for every row of ours (e.g. resources.device=cpu)")
    p.add_argument(
        "--out", type=Path, default=None, help="folder for results.json, logs and run directories"
    )
    args = p.parse_args()
    if args.steps <= args.warmup + LOSS_WINDOW // 2:
        p.error(f"--steps must exceed --warmup by at least {LOSS_WINDOW // 2}")
    out = args.out or Path(tempfile.mkdtemp(prefix="gpt-vs-nanogpt-"))
    out.mkdir(parents=True, exist_ok=True)
    tokens = out / "tokens.bin"
    write_random_tokens(tokens, args.tokens)

    rows: dict[str, list[str]] = {"ours": []}
    for spec in args.ours:
        name, _, sets = spec.partition(":")
        rows[f"ours-{name}"] = [s for s in sets.split(",") if s]
    if args.fp8:
        rows.update({f"ours-{k}": v for k, v in FP8_ROWS.items()})

    results: dict[str, dict] = {}
    env = environment()
    gpu = GpuSampler()

    def save() -> None:  # after every row: a bench cut short keeps what it measured
        doc = {
            "setup": vars(args) | {"out": str(out), "nanogpt": str(args.nanogpt), "job": args.job},
            "env": env,
            "results": results,
            "ratios": ratios(results),
        }
        (out / "results.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")

    if not args.skip_nanogpt:
        results["nanogpt"] = run_nanogpt(args, tokens, out / "nanogpt", gpu)
        progress("nanogpt", results["nanogpt"], 4)
        save()
    for name, sets in rows.items():
        results[name] = run_ours(args, tokens, out / name, [*args.sets, *sets], gpu)
        progress(name, results[name], 4)
        save()
    gpu.close()
    print(table(results))
    print(f"\nresults: {out / 'results.json'}")


def write_random_tokens(path: Path, count: int) -> None:
    """``count`` uniform GPT-2 token ids as raw uint16 (nanoGPT's ``train.bin`` layout)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, GPT2_TOKENS, (count,), generator=gen, dtype=torch.int32).to(torch.uint16)
    path.write_bytes(ids.numpy().tobytes())


def flops_per_token() -> float:
    """6·N + 6·L·d·S for the GPT-2 124M shape (model.flops_per_token's formula)."""
    from launcher.spec.job import ModelSpec
    from launcher.train.model import flops_per_token as fpt

    return fpt(ModelSpec(arch="gpt", size="base", vocab_size=VOCAB), seq_len=SEQ, mask_prob=0.15)


class GpuSampler:
    """The first visible GPU through NVML (``launcher.train.meter.GpuMonitor``), sampled every
    ``period`` seconds in a thread: wall time, energy counter, SM clock, clock limits."""

    def __init__(self, period: float = 0.05):
        import torch

        from launcher.train.meter import GpuMonitor

        self.samples: list[tuple[float, dict]] = []
        self._monitor = GpuMonitor(torch.device("cuda", 0)) if torch.cuda.is_available() else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        if self._monitor is not None:
            self._thread.start()

    def _run(self, period: float) -> None:
        while not self._stop.wait(period):
            self.samples.append((time.time(), self._monitor()))

    def close(self) -> None:
        self._stop.set()
        if self._monitor is not None:
            self._thread.join()
            self._monitor.close()

    def window(self, t0: float, t1: float) -> dict:
        """The GPU between wall times t0 and t1: mean SM clock, the share of samples at the
        power cap, and (from the energy counter, interpolated at both ends) energy and power."""
        inside = [g for t, g in self.samples if t0 <= t <= t1]
        clocks = [g["sm_clock_mhz"] for g in inside if g["sm_clock_mhz"] is not None]
        limits = [g["clock_limits"] for g in inside if g["clock_limits"] is not None]
        energy = None
        counter = [
            (t, g["energy_counter_j"]) for t, g in self.samples if g["energy_counter_j"] is not None
        ]
        if counter and counter[0][0] <= t0 and counter[-1][0] >= t1 and t1 > t0:
            energy = _interpolate(counter, t1) - _interpolate(counter, t0)
        return {
            "sm_clock_mhz": sum(clocks) / len(clocks) if clocks else None,
            "power_capped_pct": 100 * sum("power cap" in x for x in limits) / len(limits)
            if limits
            else None,
            "energy_j": energy,
            "power_w": None if energy is None else energy / (t1 - t0),
            "seconds": t1 - t0,
            "samples": len(inside),
        }


def _interpolate(points: list[tuple[float, float]], t: float) -> float:
    """Linear interpolation of the (time, value) points, ordered by time, at t inside them."""
    for (ta, va), (tb, vb) in itertools.pairwise(points):
        if ta <= t <= tb:
            return va if tb == ta else va + (vb - va) * (t - ta) / (tb - ta)
    return points[-1][1]


def with_energy(result: dict, gpu: GpuSampler, t0: float, t1: float, tokens: int) -> dict:
    """``result`` with the GPU's window over the timed steps and the energy per token."""
    window = gpu.window(t0, t1)
    energy = window["energy_j"]
    return result | {
        "gpu": window,
        "energy_mj_per_token": None if energy is None else 1e3 * energy / tokens,
    }


def run_nanogpt(args: argparse.Namespace, tokens: Path, folder: Path, gpu: GpuSampler) -> dict:
    """nanoGPT's train.py from a scratch copy of its folder; throughput from its printed times."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name in ("train.py", "model.py", "configurator.py"):
        shutil.copy(args.nanogpt / name, folder / name)
    data = folder / "data" / "random"
    data.mkdir(parents=True)
    for split in ("train.bin", "val.bin"):
        (data / split).symlink_to(tokens.resolve())
    last_iter = args.steps - 1  # nanoGPT's iterations 0..max_iters, one optimizer step each
    config = [
        "--dataset=random",
        f"--batch_size={args.micro_batch}",
        f"--gradient_accumulation_steps={args.grad_accum}",
        f"--block_size={SEQ}",
        f"--max_iters={last_iter}",
        f"--lr_decay_iters={last_iter}",
        f"--warmup_iters={args.lr_warmup}",
        "--learning_rate=6e-4",
        "--min_lr=6e-5",
        "--eval_interval=1000000000",
        "--eval_iters=1",
        "--always_save_checkpoint=False",
        "--log_interval=1",
        "--compile=True",
        "--out_dir=out",
        *args.nanogpt_args.split(),
    ]
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
        if args.nanogpt_torchrun
        else []
    )
    cmd = [sys.executable, *launcher, "train.py", *config]
    res = run(cmd, folder / "train.log", cwd=folder)
    iters, printed = {}, {}
    for at, line in res["lines"]:
        m = ITER_RE.match(line.strip())
        if m:
            iters[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
            printed[int(m.group(1))] = at  # it prints an iteration after reading its loss (a sync)
    if not res["ok"] or len(iters) < args.steps:
        return {"error": res["tail"], "cmd": cmd}
    timed = [iters[i][1] for i in range(args.warmup, args.steps)]
    step_tokens = args.micro_batch * args.grad_accum * SEQ
    tps = step_tokens * len(timed) / (sum(timed) / 1e3)
    losses = [iters[i][0] for i in range(args.steps - LOSS_WINDOW, args.steps)]
    result = {
        "tokens_per_s": tps,
        "mfu": tps * flops_per_token() / 1e12 / PEAK_TFLOPS,
        "step_ms_p50": sorted(timed)[len(timed) // 2],
        "loss": sum(losses) / len(losses),
        "steps": args.steps,
        "wall_s": res["wall_s"],
        "cmd": cmd,
    }
    return with_energy(
        result, gpu, printed[args.warmup - 1], printed[args.steps - 1], step_tokens * len(timed)
    )


def run_ours(
    args: argparse.Namespace, tokens: Path, folder: Path, sets: list[str], gpu: GpuSampler
) -> dict:
    """``launch JOB`` on the token file; throughput and loss from the run directory."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    run_dir = folder / "run"
    base = [
        "data.source=tokens",
        f"data.path={tokens.resolve()}",
        "data.token_dtype=uint16",
        f"data.seq_len={SEQ}",
        f"model.vocab_size={VOCAB}",
        f"train.steps={args.steps}",
        f"train.warmup_steps={args.warmup}",
        f"train.log_every={LOSS_WINDOW}",
        f"train.micro_batch={args.micro_batch}",
        f"train.grad_accum={args.grad_accum}",
        "train.lr=6e-4",
        f"train.lr_warmup_steps={args.lr_warmup}",
        "train.lr_schedule=cosine",
        "train.min_lr_ratio=0.1",
        "train.weight_decay=0.1",
        "train.grad_clip=1.0",
        "resources.nproc_per_node=1",
    ]
    overrides = [a for s in [*base, *sets] for a in ("--set", s)]
    metrics = run_dir / "metrics" / "rank0.jsonl"
    if args.direct:
        metrics.parent.mkdir(parents=True)
        cmd = [sys.executable, "-m", "launcher.train", "--job", args.job, *overrides]
        res = run(
            cmd,
            folder / "train.log",
            cwd=ROOT,
            env={
                "LAUNCHER_METRICS_FILE": str(metrics),
                "LAUNCHER_PROFILE_DIR": str(folder / "profile"),
            },
        )
    else:
        cmd = [sys.executable, "-m", "launcher", args.job, "--run-dir", str(run_dir), *overrides]
        res = run(cmd, folder / "launch.log", cwd=ROOT)
    if not res["ok"] or not metrics.exists():
        return {"error": res["tail"], "sets": sets}
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    final = next(r for r in records if r.get("type") == "final")
    meta = next(r for r in records if r.get("type") == "meta")
    # launch's summary.json totals add the ranks' final records: one rank, the same number.
    tps = final["tokens_per_s"]
    # the timed steps' window: from the warm-up's last record (read as the device passed it)
    # to the final record (written after a device sync)
    start = next(r for r in records if r.get("type") == "step" and r["step"] == args.warmup)
    result = {
        "tokens_per_s": tps,
        "mfu": tps * flops_per_token() / 1e12 / PEAK_TFLOPS,
        "step_ms_p50": final["step_time_ms_p50"],
        "loss": final["loss"],
        "steps": final["steps"],
        "peak_mem_gib": final["peak_mem_gib"],
        "precision": meta["precision"],
        "sets": sets,
        "wall_s": res["wall_s"],
    }
    tokens_timed = final["measured_steps"] * args.micro_batch * args.grad_accum * SEQ
    return with_energy(result, gpu, start["time"], final["time"], tokens_timed)


def ratios(results: dict) -> dict:
    """Each row's tokens/s and loss over nanoGPT's."""
    ref = results.get("nanogpt", {})
    out = {}
    for name, r in results.items():
        if name == "nanogpt" or "tokens_per_s" not in r or "tokens_per_s" not in ref:
            continue
        mj, ref_mj = r.get("energy_mj_per_token"), ref.get("energy_mj_per_token")
        out[name] = {
            "speed": r["tokens_per_s"] / ref["tokens_per_s"],
            "per_joule": ref_mj / mj if mj and ref_mj else None,
            "loss_rel_diff": (r["loss"] - ref["loss"]) / ref["loss"],
        }
    return out


def table(results: dict) -> str:
    rel = ratios(results)
    lines = [
        f"{'run':<24}{'tokens/s':>12}{'vs nanoGPT':>12}{'MFU %':>8}{'step ms p50':>13}{'loss':>9}{'Δloss %':>9}"
        f"{'SM MHz':>8}{'capped %':>10}{'W':>6}{'mJ/token':>10}{'per J':>8}"
    ]
    for name, r in results.items():
        if "tokens_per_s" not in r:
            lines.append(f"{name:<24}FAILED: {r.get('error', '')[-300:]}")
            continue
        q = rel.get(name)
        speed = f"{q['speed']:.3f}x" if q else ("1.000x" if name == "nanogpt" else "")
        dloss = f"{100 * q['loss_rel_diff']:+.2f}" if q else ""
        g = r.get("gpu") or {}
        if q and q["per_joule"]:
            per_joule = f"{q['per_joule']:.3f}x"
        else:
            per_joule = "1.000x" if name == "nanogpt" and r.get("energy_mj_per_token") else ""
        lines.append(
            f"{name:<24}{r['tokens_per_s']:>12,.0f}{speed:>12}{100 * r['mfu']:>8.1f}"
            f"{r['step_ms_p50']:>13.2f}{r['loss']:>9.4f}{dloss:>9}"
            f"{fmt(g.get('sm_clock_mhz'), '.0f'):>8}{fmt(g.get('power_capped_pct'), '.0f'):>10}"
            f"{fmt(g.get('power_w'), '.0f'):>6}{fmt(r.get('energy_mj_per_token'), '.3f'):>10}{per_joule:>8}"
        )
    return "\n".join(lines)


def run(
    cmd: list[str],
    log: Path,
    *,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = 1200,
) -> dict:
    """Run ``cmd``; its stdout lines with the wall time each arrived (``lines``), stderr after
    them in ``log``; killed after ``timeout`` seconds."""
    start = time.monotonic()
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "PYTHONPATH": path, **(env or {})},
        )
        killer = threading.Timer(timeout, proc.kill)
        killer.start()
        try:
            assert proc.stdout is not None
            lines = [(time.time(), line.rstrip("\n")) for line in proc.stdout]
            proc.wait()
        finally:
            killer.cancel()
        err.seek(0)
        stderr = err.read()
    stdout = "\n".join(line for _, line in lines)
    log.write_text(stdout + "\n--- stderr ---\n" + stderr)
    tail = "\n".join((stdout + "\n" + stderr).strip().splitlines()[-20:])
    return {
        "ok": proc.returncode == 0,
        "lines": lines,
        "tail": tail,
        "wall_s": time.monotonic() - start,
    }


if __name__ == "__main__":
    main()
