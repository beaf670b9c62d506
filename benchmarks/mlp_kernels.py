"""The MLP's bias + GELU on the GPU: the launcher's Triton kernels against inductor's.

    python benchmarks/mlp_kernels.py [--sweep] [--out results.json]

How it measures: docs/performance.md, under its name.
"""

import torch
from common import event_ms, kernel_bench_args, write_json
from tabulate import tabulate

from launcher.train import fused

SHAPES = {  # name: (rows, d_ff, approximate, bias)
    "bert-base": (128 * 512, 3072, "none", True),
    "gpt2-124m": (16 * 1024, 3072, "tanh", False),
}
SWEEP_FWD = [
    {"BLOCK_M": 4, "BLOCK_N": 1024, "num_warps": 4},
    {"BLOCK_M": 8, "BLOCK_N": 512, "num_warps": 4},
    {"BLOCK_M": 16, "BLOCK_N": 256, "num_warps": 4},
    {"BLOCK_M": 32, "BLOCK_N": 256, "num_warps": 8},
]
SWEEP_BWD = [
    {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4},
    {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8},
    {"BLOCK_M": 32, "BLOCK_N": 256, "num_warps": 8},
]


def replayed_ms(fn, rounds: int = 7, replays: int = 20) -> float:
    """Median GPU ms of ``fn`` captured as a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compilation, autotuning) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return event_ms(graph.replay, rounds, replays)


def measure(rows: int, d_ff: int, approximate: str, bias: bool, sweep: bool) -> dict:
    y = torch.randn(rows, d_ff, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(d_ff, device="cuda", requires_grad=True) if bias else None
    g = torch.randn_like(y)
    inputs = [y] if b is None else [y, b]
    inductor = torch.compile(fused._reference)
    out = {"bytes_fwd": 2 * y.numel() * 2, "bytes_bwd": 3 * y.numel() * 2}
    for name, fn in (
        ("inductor", lambda: inductor(y, b, approximate)),
        ("triton", lambda: fused.bias_gelu(y, b, approximate)),
    ):
        with torch.no_grad():
            fwd = replayed_ms(fn)
        both = replayed_ms(lambda fn=fn: torch.autograd.grad(fn(), inputs, g))
        out[name] = {"fwd_ms": fwd, "fwd_bwd_ms": both, "bwd_ms": both - fwd}
    if sweep:
        tanh, yd, bd = approximate == "tanh", y.detach(), None if b is None else b.detach()
        chosen = fused.FWD, fused.BWD
        out["sweep"] = []
        for fwd_cfg in SWEEP_FWD:
            fused.FWD = fwd_cfg
            out["sweep"].append(
                {
                    "kernel": "fwd",
                    **fwd_cfg,
                    "ms": replayed_ms(lambda: fused._launch_fwd(yd, bd, tanh)),
                }
            )
        for bwd_cfg in SWEEP_BWD:
            fused.BWD = bwd_cfg
            out["sweep"].append(
                {
                    "kernel": "bwd",
                    **bwd_cfg,
                    "ms": replayed_ms(lambda: fused._launch_bwd(g, yd, bd, tanh)),
                }
            )
        fused.FWD, fused.BWD = chosen
    return out


def main() -> None:
    args = kernel_bench_args(__doc__, "also time the kernels' tile configurations")
    results, table = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}, []
    for name, shape in SHAPES.items():
        r = results[name] = measure(*shape, sweep=args.sweep)
        for impl in ("inductor", "triton"):
            t = r[impl]
            table.append(
                [
                    name,
                    impl,
                    f"{t['fwd_ms']:.3f}",
                    f"{r['bytes_fwd'] / t['fwd_ms'] / 1e6:.0f}",
                    f"{t['bwd_ms']:.3f}",
                    f"{r['bytes_bwd'] / t['bwd_ms'] / 1e6:.0f}",
                ]
            )
        for s in r.get("sweep", []):
            print(
                f"{name} {s['kernel']} BLOCK_M={s['BLOCK_M']} BLOCK_N={s['BLOCK_N']} "
                f"num_warps={s['num_warps']}: {s['ms']:.4f} ms"
            )
    print(
        tabulate(
            table, headers=["shape", "bias + GELU", "fwd ms", "fwd GB/s", "bwd ms", "bwd GB/s"]
        )
    )
    write_json(args.out, results)


if __name__ == "__main__":
    main()
