"""The models' attention on the GPU, forward and backward, by kernel.

    python benchmarks/attention_kernels.py [--out results.json]

Two shapes, one micro-batch each, bf16, q, k and v as the models make them (views of one
(batch, seq, 3, heads, 64) projection): GPT-2 124M's (16 × 1024, 12 heads, causal) and
BERT-base's (128 × 512, 12 heads). Kernels: cuDNN's fused attention (torch's choice on an
H200), torch's own flash attention (FA2), and where the ``flash_attn.cute`` package is
installed, the trainer's ``cudnn-fa4`` pair (cuDNN's forward, FA4's backward written into the
packed gradient: ``launcher.train.attention``) and FlashAttention-4's CuTe kernels both ways
(``torch.nn.attention.activate_flash_attention_impl`` routes torch's flash kernels to them).
Times are the kernels' own, from the profiler over 20 calls (not the host's launch costs,
which differ between the kernels' glue); the backward's include the copy that stacks dq, dk
and dv into the projection's gradient, as in training (the pair has none: its gradient is the
packed tensor). The outputs and gradients are compared with cuDNN's.
"""

import argparse
import json
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch.nn.attention import SDPBackend, sdpa_kernel

from launcher.train.attention import fa4_import_error, packed_attention

SHAPES = {  # name: (batch, seq, heads, head dim, causal)
    "gpt2-124m": (16, 1024, 12, 64, True),
    "bert-base": (128, 512, 12, 64, False),
}


def kernel_ms(fn, rounds: int = 20) -> float:
    """GPU kernel time of one ``fn()``, from the profiler: the kernels' own time, whatever the
    host spends launching them (FA4's Python glue costs more host time than cuDNN's)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / rounds


def measure(batch: int, seq: int, heads: int, dim: int, causal: bool, backend: SDPBackend | None) -> dict:
    """One kernel at one shape, and its output and gradient (to compare with the others').
    ``backend`` None: the trainer's ``cudnn-fa4`` pair (``launcher.train.attention``)."""
    torch.manual_seed(0)
    qkv = torch.randn(batch, seq, 3, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16)

    def attend():
        if backend is None:  # (batch, seq, heads, dim) out: SDPA's tensor, transposed
            return packed_attention(qkv, causal).transpose(1, 2)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    flop = 4 * batch * heads * seq * seq * dim * (0.5 if causal else 1.0)  # forward; backward 2.5×
    with sdpa_kernel(backend) if backend is not None else nullcontext():
        y = attend()
        (dqkv,) = torch.autograd.grad(y, qkv, grad)
        with torch.no_grad():
            fwd = kernel_ms(attend)
        both = kernel_ms(lambda: torch.autograd.grad(attend(), qkv, grad))
    row = {"fwd_ms": fwd, "bwd_ms": both - fwd, "fwd_tflops": flop / fwd / 1e9,
           "bwd_tflops": 2.5 * flop / (both - fwd) / 1e9}
    return row, (y.detach(), dqkv)


def fa4_activator():
    """A function that routes torch's flash kernels to FlashAttention-4's CuTe kernels.

    torch's FA4 glue unpacks two values from ``_flash_attn_fwd``, which newer ``flash_attn.cute``
    releases extend (out, lse, and more): a shim module keeps the first two."""
    import sys
    import types

    from flash_attn.cute import interface
    from torch.nn.attention import _fa4

    shim = types.ModuleType("launcher_fa4_shim")
    shim._flash_attn_fwd = lambda *a, **k: interface._flash_attn_fwd(*a, **k)[:2]
    shim._flash_attn_bwd = lambda *a, **k: interface._flash_attn_bwd(*a, **k)[:3]
    sys.modules[shim.__name__] = shim
    handles = []
    return lambda: handles or handles.append(_fa4.register_flash_attention_fa4(shim.__name__))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args()
    from torch.nn import attention

    # FA4 comes last: once activated, torch's flash kernels stay routed to it
    backends = {"cudnn": (SDPBackend.CUDNN_ATTENTION, None), "flash (FA2)": (SDPBackend.FLASH_ATTENTION, None)}
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "impls": getattr(attention, "list_flash_attention_impls", list)()}
    if fa4_import_error() is None:
        backends["cudnn-fa4 (packed)"] = (None, None)
    try:
        backends["FA4"] = (SDPBackend.FLASH_ATTENTION, fa4_activator())
    except Exception as e:  # noqa: BLE001
        results["fa4_error"] = f"{type(e).__name__}: {e}"[:500]
        print("FA4:", results["fa4_error"])
    refs, table = {}, []
    for impl, (backend, activate) in backends.items():
        if activate is not None:
            activate()
        for name, shape in SHAPES.items():
            row, (y, dqkv) = measure(*shape, backend=backend)
            ref = refs.setdefault(name, (y, dqkv))  # the first kernel's (cuDNN's)
            row.update(out_max_diff=float((y - ref[0]).abs().max()), grad_max_diff=float((dqkv - ref[1]).abs().max()))
            results.setdefault(name, {})[impl] = row
            table.append([name, impl, f"{row['fwd_ms']:.3f}", f"{row['fwd_tflops']:.0f}", f"{row['bwd_ms']:.3f}",
                          f"{row['bwd_tflops']:.0f}", f"{row['out_max_diff']:.1e}", f"{row['grad_max_diff']:.1e}"])
    print(tabulate(sorted(table, key=lambda r: r[0], reverse=True),
                   headers=["shape", "kernel", "fwd ms", "TFLOP/s", "bwd ms", "TFLOP/s", "out diff", "grad diff"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
