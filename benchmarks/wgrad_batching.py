"""Weight gradients of GPT-2 124M's block linears: one product per layer, or one batched
product over the 12 layers (as a backward that deferred them to its end would run them).

    python benchmarks/wgrad_batching.py [--seconds 3] [--out F]

How it measures: docs/performance.md, under its name.
"""

from __future__ import annotations

import json
from pathlib import Path

from common import parser
from step_energy import LAYERS, LINEARS, TOKENS, measure

from launcher.train import wgrad

WAYS = ("per layer", "batched", "stacked", "pointers")


def _ways(torch, x, dy, dw) -> dict:
    """The ways to write every layer's dYᵀ·X into ``dw``."""
    xs, dys = [t.clone() for t in x], [t.clone() for t in dy]
    return {
        "per layer": lambda: [torch.mm(dy[i].t(), x[i], out=dw[i]) for i in range(LAYERS)],
        "batched": lambda: torch.bmm(dy.transpose(1, 2), x, out=dw),
        # each layer's tensors apart, as a backward makes them: stacked first (two copies)
        "stacked": lambda: torch.bmm(torch.stack(dys).transpose(1, 2), torch.stack(xs), out=dw),
        # apart, and read where they lie (the trainer's op, launcher/train/wgrad.py)
        "pointers": lambda: _check(wgrad._cublas_batched(dys, xs, dw)),
    }


def _check(ran: bool) -> None:
    if not ran:
        raise RuntimeError("cuBLAS's pointer-array batched product did not take these tensors")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    import torch

    from launcher.train.meter import GpuMonitor

    device = torch.device("cuda", torch.cuda.current_device())
    gpu = GpuMonitor(device)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    rows = []
    for name, (k, n, count) in LINEARS.items():
        if count != LAYERS:
            continue
        x, dy = torch.randn(LAYERS, TOKENS, k, **bf16), torch.randn(LAYERS, TOKENS, n, **bf16)
        dw = torch.empty(LAYERS, n, k, **bf16)
        flops = 2.0 * TOKENS * k * n * LAYERS
        ways = _ways(torch, x, dy, dw)
        ref = None
        for way, fn in ways.items():
            m = measure(fn, args.seconds, gpu)
            fn()
            torch.cuda.synchronize()
            ref = dw.clone() if ref is None else ref
            same = torch.equal(ref, dw) if way != "per layer" else True
            close = (dw.float() - ref.float()).abs().max().item()
            row = {
                "linear": name,
                "way": way,
                "ms_per_step": m["ms"],
                "j_per_step": m["mj"] / 1e3,
                "tflops": flops / m["ms"] / 1e9,
                "pj_per_flop": m["mj"] * 1e9 / flops,
                "power_w": m["power_w"],
                "sm_clock_mhz": m["sm_clock_mhz"],
                "graph": m["graph"],
                "bitwise_equal_to_per_layer": same,
                "max_abs_diff_to_per_layer": close,
            }
            rows.append(row)
            print(
                f"{name:5} {way:9} {row['ms_per_step']:.3f} ms  {row['j_per_step']:.3f} J  "
                f"{row['tflops']:.0f} TFLOP/s  {row['pj_per_flop']:.3f} pJ/FLOP  {row['power_w']:.0f} W  "
                f"{row['sm_clock_mhz']:.0f} MHz  equal={same} max diff {close:.2e}",
                flush=True,
            )
        del x, dy, dw, ref
        torch.cuda.empty_cache()
    total = {way: sum(r["j_per_step"] for r in rows if r["way"] == way) for way in WAYS}
    print(
        f"\nall four linears, J a step: {total['per layer']:.3f} per layer, {total['batched']:.3f} batched, "
        f"{total['stacked']:.3f} stacked then batched, {total['pointers']:.3f} batched by pointers"
    )
    if args.out:
        doc = {
            "gpu": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "rows": rows,
            "j_per_step": total,
        }
        args.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
