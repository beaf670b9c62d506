"""The optimizer step on the GPU: bf16 weights with fp32 masters against fp32 weights.

    python benchmarks/optimizer_step.py [--sweep] [--out results.json]

How it measures: docs/performance.md, under its name.
"""

import torch
from common import event_ms, kernel_bench_args, write_json
from tabulate import tabulate

from launcher.spec.job import ModelSpec
from launcher.train import optim, parallel
from launcher.train.loop import param_groups
from launcher.train.model import build_model


def timed_ms(fn, rounds: int = 5, steps: int = 50) -> float:
    for _ in range(5):
        fn()
    return event_ms(fn, rounds, steps)


def gpt2_model() -> torch.nn.Module:
    with torch.device("cuda"):
        return build_model(ModelSpec(arch="gpt", size="base", bias=False))


def fill_grads(params, dtype) -> None:
    for p in params:
        p.grad = (torch.randn_like(p, dtype=torch.float32) * 1e-3).to(dtype)


def fp32_step(model) -> tuple[float, int]:
    params = list(model.parameters())
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.95), fused=True)
    fill_grads(params, torch.float32)
    matrices = [p for p in params if p.ndim >= 2]
    bf16_grads = [torch.empty_like(p, dtype=torch.bfloat16) for p in matrices]

    def step():
        for p in matrices:  # autocast's forward cast of each weight
            p.to(torch.bfloat16)
        for p, g in zip(matrices, bf16_grads, strict=True):  # the backward's cast of each gradient
            p.grad.copy_(g)
        parallel.clip_in_fused_optimizer(opt, params, 1.0)
        opt.step()

    n = sum(p.numel() for p in params)
    m = sum(p.numel() for p in matrices)
    return timed_ms(step), 28 * n + 4 * n + 12 * m  # AdamW's 28 B, the norm's 4, the casts' 6 + 6


def master_adamw_step(model):
    """The trainer's step on bf16 weights: fp32 masters, the gradients' norm, then MasterAdamW
    (clipping at 1.0), over gradients filled once; returns the step as a function."""
    params = list(model.parameters())
    opt = optim.MasterAdamW(
        param_groups(model, 0.1), optim.MasterWeights(params), lr=6e-4, betas=(0.9, 0.95)
    )
    fill_grads(params, torch.bfloat16)

    def step():
        opt.clip_grad_norm_(1.0)
        opt.step()

    return step


def bf16_step(model, block: int | None = None, warps: int | None = None) -> tuple[float, int]:
    saved = optim.BLOCK, optim.NUM_WARPS
    optim.BLOCK, optim.NUM_WARPS = block or saved[0], warps or saved[1]
    try:
        ms = timed_ms(master_adamw_step(model))
    finally:
        optim.BLOCK, optim.NUM_WARPS = saved
    n = sum(p.numel() for p in model.parameters())
    # AdamW's 28 B (bf16 gradient and fp32 state in, fp32 state and bf16 weight out), the norm's 2
    return ms, 28 * n + 2 * n


def main() -> None:
    args = kernel_bench_args(__doc__, "also time the update's block sizes and warps")
    rows, out = [], {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, fn in (
        ("fp32 weights (fused AdamW + casts)", fp32_step),
        ("bf16 weights (MasterAdamW)", bf16_step),
    ):
        ms, nbytes = fn(gpt2_model())
        out[name] = {"ms": ms, "bytes": nbytes}
        rows.append([name, f"{ms:.3f}", f"{nbytes / ms / 1e9:.2f}"])
    if args.sweep:
        out["sweep"] = []
        for block in (512, 1024, 2048, 4096):
            for warps in (2, 4, 8):
                ms, nbytes = bf16_step(gpt2_model(), block, warps)
                out["sweep"].append({"BLOCK": block, "num_warps": warps, "ms": ms})
                label = f"  MasterAdamW BLOCK={block} warps={warps}"
                rows.append([label, f"{ms:.3f}", f"{nbytes / ms / 1e9:.2f}"])
    print(tabulate(rows, headers=["GPT-2 124M optimizer step", "ms", "TB/s"]))
    write_json(args.out, out)


if __name__ == "__main__":
    main()
