"""The LM head's loss on the GPU: the launcher's Triton kernel against inductor's.

    python benchmarks/loss_kernels.py [--sweep] [--out results.json]

How it measures: docs/performance.md, under its name.
"""

import torch
from common import kernel_bench_args, write_json
from mlp_kernels import replayed_ms
from tabulate import tabulate

from launcher.train import fused
from launcher.train.loss import linear_cross_entropy, loss_and_dlogits

SHAPES = {  # name: (rows, columns, classes, d_model)
    "gpt2-124m": (16 * 1024, 50304, 50304, 768),
    "bert-base": (128 * 77, 30528, 30522, 768),
}
SWEEP = [{"BLOCK": None, "num_warps": w} for w in (16, 32)] + [
    {"BLOCK": b, "num_warps": w, "L2": l2}
    for b in (2048, 4096, 8192)
    for w in (4, 8, 16)
    for l2 in (False, True)
]


def measure(rows: int, cols: int, classes: int, d: int, sweep: bool) -> dict:
    z = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 4
    labels = torch.randint(0, classes, (rows,), device="cuda")
    limit = classes if classes < cols else None
    inductor = torch.compile(loss_and_dlogits)
    work = z.clone()
    out = {"bytes": 2 * z.numel() * 2}
    with torch.no_grad():
        out["inductor_ms"] = replayed_ms(lambda: inductor(z, labels, limit))
        out["triton_ms"] = replayed_ms(lambda: fused.softmax_xent_(work, labels, classes))
        ref_loss, ref_dz = loss_and_dlogits(z, labels, limit)
        work.copy_(z)
        loss = fused.softmax_xent_(work, labels, classes).mean()
        out["loss_diff"] = abs(float(loss - ref_loss))
        out["dlogits_max_diff"] = float((work.float() - ref_dz.float()).abs().max())
        out["dlogits_differing"] = float((work != ref_dz).float().mean())
    if sweep:
        out["sweep"] = []
        for cfg in SWEEP:
            with torch.no_grad():
                ms = replayed_ms(
                    lambda cfg=cfg: fused._launch_xent(work, labels, classes, work, cfg)
                )
                ms_new = replayed_ms(
                    lambda cfg=cfg: fused._launch_xent(z, labels, classes, torch.empty_like(z), cfg)
                )
            out["sweep"].append({**cfg, "in_place_ms": ms, "new_tensor_ms": ms_new})
    x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(classes, d, device="cuda") * 0.02).requires_grad_()
    for kernels in (False, True):
        step = torch.compile(
            lambda kernels=kernels: linear_cross_entropy(x, w, None, labels, kernels)
        )

        def fwd_bwd(step=step):
            with torch.autocast("cuda", torch.bfloat16):
                loss = step()
            return torch.autograd.grad(loss, (x, w))

        out[f"head_step_ms_kernels_{kernels}"] = replayed_ms(fwd_bwd)
        out[f"head_peak_gib_kernels_{kernels}"] = peak_gib(fwd_bwd)
    return out


def peak_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    args = kernel_bench_args(__doc__, "also time the kernel's configurations")
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "config": dict(fused.XENT),
    }
    table = []
    for name, shape in SHAPES.items():
        r = results[name] = measure(*shape, sweep=args.sweep)
        for s in r.get("sweep", []):
            print(
                f"{name} BLOCK={s['BLOCK']} num_warps={s['num_warps']} L2={s.get('L2')}: "
                f"in place {s['in_place_ms']:.4f} ms, "
                f"new tensor {s['new_tensor_ms']:.4f} ms"
            )
        table.append(
            [
                name,
                f"{r['inductor_ms']:.3f}",
                f"{r['bytes'] / r['inductor_ms'] / 1e6:.0f}",
                f"{r['triton_ms']:.3f}",
                f"{r['bytes'] / r['triton_ms'] / 1e6:.0f}",
                f"{r['head_step_ms_kernels_False']:.3f}",
                f"{r['head_step_ms_kernels_True']:.3f}",
                f"{r['head_peak_gib_kernels_False']:.2f} / {r['head_peak_gib_kernels_True']:.2f}",
                f"{r['loss_diff']:.1e}",
                f"{r['dlogits_max_diff']:.1e}",
            ]
        )
    headers = [
        "shape",
        "inductor ms",
        "GB/s",
        "triton ms",
        "GB/s",
        "head step ms (inductor)",
        "head step ms (triton)",
        "head peak GiB",
        "loss diff",
        "dlogits max diff",
    ]
    print(tabulate(table, headers=headers))
    write_json(args.out, results)


if __name__ == "__main__":
    main()
