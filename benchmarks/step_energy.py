"""Where the GPT step's energy goes: each kind of work in it, alone, at the power cap.

    python benchmarks/step_energy.py [--seconds 3] [--only gemm,attention,...] [--step-metrics F] [--out F]

How it measures: docs/performance.md, under its name.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from common import fmt, parser

from launcher.metrics import read_records

TOKENS, SEQ, D, LAYERS, VOCAB, CLASSES = 16 * 1024, 1024, 768, 12, 50304, 50257
HEADS = 12
# the model's linear layers: name -> (in, out, per step)
LINEARS = {
    "qkv": (D, 3 * D, LAYERS),
    "proj": (D, D, LAYERS),
    "fc": (D, 4 * D, LAYERS),
    "fc2": (4 * D, D, LAYERS),
    "head": (D, VOCAB, 1),
}
GROUPS = ("gemm", "attention", "gelu", "layernorm", "loss", "embedding", "optimizer")


@dataclasses.dataclass(frozen=True)
class Part:
    """One kind of work: ``count`` calls a step, each ``flops`` (0 where not counted)."""

    name: str
    group: str
    count: int
    flops: float = 0.0


def plan(only: set[str] | None = None) -> list[Part]:
    """The parts of one GPT-2 124M training step, in the order they are measured."""
    parts = []
    for name, (k, n, count) in LINEARS.items():
        flops = 2.0 * TOKENS * k * n
        parts += [
            Part(f"{name} forward", "gemm", count, flops),
            Part(f"{name} input grad", "gemm", count, flops),
            Part(f"{name} weight grad", "gemm", count, flops),
        ]
    # QKᵀ and PV, causal (half the square), forward and backward as MFU counts model FLOPs
    # (the backward twice the forward; the kernel also recomputes QKᵀ)
    attn = 3 * 4.0 * TOKENS * SEQ * D / 2
    parts += [
        Part("attention forward + backward", "attention", LAYERS, attn),
        Part("GELU forward + backward", "gelu", LAYERS),
        Part("LayerNorm forward + backward", "layernorm", 2 * LAYERS + 1),
        Part("loss and logits' gradient", "loss", 1),
        Part("embeddings forward + backward", "embedding", 1),
        Part("gradient norm and AdamW", "optimizer", 1),
    ]
    return [p for p in parts if not only or p.group in only]


def per_step(part: Part, measured: dict) -> dict:
    """A part's measurement per call, and per step (``count`` calls)."""
    out = {
        "ms_per_step": measured["ms"] * part.count,
        "j_per_step": measured["mj"] * part.count / 1e3,
    }
    if part.flops:
        out["tflops"] = part.flops / (measured["ms"] / 1e3) / 1e12
        out["pj_per_flop"] = measured["mj"] / 1e3 / part.flops * 1e12
    return out


def by_group(rows: list[dict]) -> dict[str, dict[str, float]]:
    """ms and J a step for each group, and its share of the summed joules."""
    total = sum(r["j_per_step"] for r in rows) or 1.0
    groups: dict[str, dict[str, float]] = {}
    for r in rows:
        g = groups.setdefault(r["group"], {"ms_per_step": 0.0, "j_per_step": 0.0})
        g["ms_per_step"] += r["ms_per_step"]
        g["j_per_step"] += r["j_per_step"]
    for g in groups.values():
        g["share"] = g["j_per_step"] / total
    return groups


def whole_step(metrics: Path) -> dict:
    """The trainer's step from its metrics file's ``final`` record: mean ms (from tokens/s), the
    joules (from its energy per token), W and the SM clock."""
    final = next((r for r in reversed(read_records(metrics)) if r.get("type") == "final"), None)
    if final is None or final.get("energy_mj_per_token") is None:
        raise SystemExit(
            f"{metrics}: no final record with energy_mj_per_token (a GPU run with NVML)"
        )
    return {
        "ms_per_step": TOKENS / final["tokens_per_s"] * 1e3,
        "j_per_step": final["energy_mj_per_token"] * TOKENS / 1e3,
        "power_w": final.get("power_w"),
        "sm_clock_mhz": final.get("sm_clock_mhz"),
        "tokens_per_s": final.get("tokens_per_s"),
    }


# -- on the GPU ---------------------------------------------------------------------------------


def measure(fn: Callable[[], object], seconds: float, gpu, settle: float = 1.0) -> dict:
    """``fn``'s time and energy per call, replayed (as a CUDA graph where it captures) for
    ``seconds`` after ``settle`` seconds; with the mean SM clock and power over the window."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    reps = max(1, round(0.025 / ((time.perf_counter() - t) / 5)))  # one replay ≈ 25 ms
    graph = _capture(fn, reps)
    run = graph.replay if graph is not None else (lambda: [fn() for _ in range(reps)])
    deadline = time.perf_counter() + settle
    while time.perf_counter() < deadline:
        run()
        torch.cuda.synchronize()
    clocks = []
    e0, t0, n = gpu()["energy_counter_j"], time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        run()
        n += 1
        if n % 2 == 0:  # keep the queue short, and read the clock on the way
            torch.cuda.synchronize()
            clocks.append(gpu()["sm_clock_mhz"])
    torch.cuda.synchronize()
    t1, e1 = time.perf_counter(), gpu()["energy_counter_j"]
    calls = n * reps
    clocks = [c for c in clocks if c is not None]
    return {
        "ms": (t1 - t0) / calls * 1e3,
        "mj": (e1 - e0) / calls * 1e3 if e0 is not None else None,
        "power_w": (e1 - e0) / (t1 - t0) if e0 is not None else None,
        "sm_clock_mhz": statistics.fmean(clocks) if clocks else None,
        "graph": graph is not None,
    }


def _capture(fn: Callable[[], object], reps: int):
    import torch

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            fn()  # warm on the side stream, as capture asks
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
    except Exception as err:  # noqa: BLE001 - a part that does not capture runs eagerly
        print(f"  (not captured: {type(err).__name__}: {str(err).splitlines()[0][:120]})")
        torch.cuda.synchronize()
        return None
    return graph


def builders(device) -> dict[str, Callable[[], Callable[[], object]]]:
    """Each part's name -> a function that allocates its inputs and returns the call to time."""
    import torch
    import torch.nn.functional as F

    from launcher.train import attention, fused

    bf16 = dict(device=device, dtype=torch.bfloat16)
    out: dict[str, Callable[[], Callable[[], object]]] = {}

    def gemm(k: int, n: int, which: str):
        def build():
            x, dy = torch.randn(TOKENS, k, **bf16), torch.randn(TOKENS, n, **bf16)
            w = torch.randn(n, k, **bf16) * 0.02
            if which == "forward":
                a, b = x, w.t()
            elif which == "input grad":
                a, b = dy, w
            else:
                a, b = dy.t(), x
            c = torch.empty(a.shape[0], b.shape[1], **bf16)
            return lambda: torch.mm(a, b, out=c)

        return build

    for name, (k, n, _) in LINEARS.items():
        for which in ("forward", "input grad", "weight grad"):
            out[f"{name} {which}"] = gemm(k, n, which)

    packed = attention.fa4_import_error() is None

    # Autograd runs a backward on the stream of its forward, so a part with a backward runs
    # its forward in the same call: both are then captured on the capture's stream.
    def attn():
        qkv = torch.randn(TOKENS // SEQ, SEQ, 3, HEADS, D // HEADS, **bf16).requires_grad_()
        dy = torch.randn(TOKENS // SEQ, SEQ, HEADS, D // HEADS, **bf16)
        fn = attention.packed_attention if packed else attention.sdpa_attention
        return lambda: torch.autograd.grad(fn(qkv, True), qkv, dy)

    out["attention forward + backward"] = attn

    def gelu():
        y = torch.randn(TOKENS, 4 * D, **bf16).requires_grad_()
        dh = torch.randn_like(y)
        return lambda: torch.autograd.grad(fused.bias_gelu(y, None, "tanh"), y, dh)

    out["GELU forward + backward"] = gelu

    def layernorm():
        x = torch.randn(TOKENS, D, **bf16).requires_grad_()
        w = torch.ones(D, **bf16).requires_grad_()  # bf16, as the trainer's bf16 weights
        dy = torch.randn(TOKENS, D, **bf16)
        norm = torch.compile(lambda x, w: F.layer_norm(x, (D,), w, None, 1e-5).to(x.dtype))

        def step():
            return torch.autograd.grad(norm(x, w), (x, w), dy)

        return step

    out["LayerNorm forward + backward"] = layernorm

    def loss():
        logits = torch.randn(TOKENS, VOCAB, **bf16)
        labels = torch.randint(0, CLASSES, (TOKENS,), device=device)
        return lambda: fused.softmax_xent_(logits, labels, CLASSES)

    out["loss and logits' gradient"] = loss

    def embedding():
        wte = (torch.randn(VOCAB, D, device=device) * 0.02).to(torch.bfloat16).requires_grad_()
        wpe = (torch.randn(SEQ, D, device=device) * 0.02).to(torch.bfloat16).requires_grad_()
        idx = torch.randint(0, CLASSES, (TOKENS // SEQ, SEQ), device=device)
        pos = torch.arange(SEQ, device=device)
        dy = torch.randn(TOKENS // SEQ, SEQ, D, **bf16)
        return lambda: torch.autograd.grad(
            F.embedding(idx, wte) + F.embedding(pos, wpe), (wte, wpe), dy
        )

    out["embeddings forward + backward"] = embedding

    def optimizer():
        # the step of benchmarks/optimizer_step.py, which times it alone
        from optimizer_step import gpt2_model, master_adamw_step

        return master_adamw_step(gpt2_model())

    out["gradient norm and AdamW"] = optimizer
    return out


def table(rows: list[dict], groups: dict, whole: dict | None) -> str:
    from tabulate import tabulate

    body = [
        [
            r["name"],
            r["count"],
            f"{r['ms']:.4f}",
            fmt(r.get("tflops"), ".0f"),
            fmt(r.get("sm_clock_mhz"), ".0f"),
            fmt(r.get("power_w"), ".0f"),
            fmt(r.get("mj"), ".3f"),
            fmt(r.get("pj_per_flop"), ".3f"),
            f"{r['ms_per_step']:.3f}",
            f"{r['j_per_step']:.3f}",
        ]
        for r in rows
    ]
    headers = [
        "part",
        "a step",
        "ms a call",
        "TFLOP/s",
        "SM MHz",
        "W",
        "mJ a call",
        "pJ/FLOP",
        "ms a step",
        "J a step",
    ]
    parts = tabulate(body, headers=headers, disable_numparse=True)
    summed = {
        "ms_per_step": sum(g["ms_per_step"] for g in groups.values()),
        "j_per_step": sum(g["j_per_step"] for g in groups.values()),
    }

    def kind(name: str, g: dict, share: str, watts: str) -> list[str]:
        return [name, f"{g['ms_per_step']:.2f}", f"{g['j_per_step']:.2f}", share, watts]

    kinds = [
        kind(
            name,
            g,
            f"{100 * g['share']:.1f}%",
            f"{g['j_per_step'] / (g['ms_per_step'] / 1e3):.0f}" if g["ms_per_step"] else "",
        )
        for name, g in sorted(groups.items(), key=lambda kv: -kv[1]["j_per_step"])
    ]
    watts = summed["j_per_step"] / (summed["ms_per_step"] / 1e3)
    kinds.append(kind("sum of the parts", summed, "100%", f"{watts:.0f}"))
    if whole:
        kinds.append(kind("the trainer's step", whole, "", fmt(whole.get("power_w"), ".0f")))
    headers = ["kind", "ms a step", "J a step", "share of J", "W"]
    return parts + "\n\n" + tabulate(kinds, headers=headers, disable_numparse=True)


def main() -> None:
    p = parser(__doc__)
    p.add_argument(
        "--seconds", type=float, default=3.0, help="measured seconds a part (after 1 s settling)"
    )
    p.add_argument("--only", default="", help=f"comma-separated groups: {','.join(GROUPS)}")
    p.add_argument(
        "--step-metrics",
        type=Path,
        default=None,
        help="a trainer run's metrics file, for the whole step",
    )
    p.add_argument("--out", type=Path, default=None, help="results JSON")
    args = p.parse_args()
    only = {s for s in args.only.split(",") if s}
    if only - set(GROUPS):
        p.error(f"unknown groups {sorted(only - set(GROUPS))}; known: {', '.join(GROUPS)}")

    import torch

    from launcher.train.attention import fa4_import_error
    from launcher.train.meter import GpuMonitor

    if not torch.cuda.is_available():
        raise SystemExit("step_energy.py measures a GPU: no CUDA device here")
    device = torch.device("cuda", torch.cuda.current_device())
    gpu = GpuMonitor(device)
    if gpu()["energy_counter_j"] is None:
        raise SystemExit(
            "NVML's energy counter does not answer on this GPU (nvidia-ml-py installed?)"
        )
    whole = whole_step(args.step_metrics) if args.step_metrics else None
    build = builders(device)
    rows: list[dict] = []
    broken = ""  # a capture that failed part-way leaves the process's CUDA state unusable
    failed: dict[str, str] = {}
    for part in plan(only):
        if broken:
            failed[part.name] = f"not run: {broken}"
            continue
        try:
            fn = build[part.name]()
            m = measure(fn, args.seconds, gpu)
        except Exception as err:  # noqa: BLE001 - one part failing leaves the others to measure
            failed[part.name] = f"{type(err).__name__}: {err}"
            print(f"{part.name}: FAILED {failed[part.name][:300]}", flush=True)
            continue
        finally:
            fn = None
            torch.cuda.empty_cache()
        if not m["graph"]:
            broken = f"the capture of {part.name!r} failed"
        rows.append({"name": part.name, "group": part.group, "count": part.count, **m})
        rows[-1].update(per_step(part, m))
        print(
            f"{part.name}: {m['ms']:.4f} ms, {m['mj']:.3f} mJ a call at {m['power_w']:.0f} W, "
            f"{m['sm_clock_mhz']:.0f} MHz{'' if m['graph'] else ' (eager)'}",
            flush=True,
        )
    groups = by_group(rows)
    print()
    print(table(rows, groups, whole))
    if failed:
        print(f"\nnot measured (the sums leave them out): {', '.join(failed)}")
    result = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "attention": "cudnn-fa4" if fa4_import_error() is None else "torch sdpa",
        "seconds": args.seconds,
        "parts": rows,
        "groups": groups,
        "whole_step": whole,
        "failed": failed,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nresults: {args.out}")


if __name__ == "__main__":
    main()
