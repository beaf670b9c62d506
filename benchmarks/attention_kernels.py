"""The models' attention on the GPU, forward and backward, by kernel.

    python benchmarks/attention_kernels.py [--out results.json]
    python benchmarks/attention_kernels.py --fa4-bwd-tiles [--out results.json]

How it measures: docs/performance.md, under its name.
"""

import argparse
import json
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from common import parser, write_json
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


def measure(
    batch: int, seq: int, heads: int, dim: int, causal: bool, backend: SDPBackend | None
) -> dict:
    """One kernel at one shape, and its output and gradient (to compare with the others').
    ``backend`` None: the trainer's ``cudnn-fa4`` pair (``launcher.train.attention``)."""
    torch.manual_seed(0)
    qkv = torch.randn(
        batch, seq, 3, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True
    )
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
    row = {
        "fwd_ms": fwd,
        "bwd_ms": both - fwd,
        "fwd_tflops": flop / fwd / 1e9,
        "bwd_tflops": 2.5 * flop / (both - fwd) / 1e9,
    }
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


def fa4_bwd_tilings(head_dim: int = 64) -> dict[str, dict | None]:
    """Hopper backward configurations to try: FA4's pick (None) and, per tile shape, the first
    of its config search's feasible ones (a variant of the pick's shape where that one is the pick)."""
    from flash_attn.cute import sm90_config_search

    fields = {
        "tile_m": "m_block_size",
        "tile_n": "n_block_size",
        "Q_stage": "num_stages_Q",
        "dO_stage": "num_stages_dO",
        "PdS_stage": "num_stages_PdS",
        "SdP_swapAB": "SdP_swapAB",
        "dKV_swapAB": "dKV_swapAB",
        "dQ_swapAB": "dQ_swapAB",
        "AtomLayoutMSdP": "AtomLayoutMSdP",
        "AtomLayoutNdKV": "AtomLayoutNdKV",
        "AtomLayoutMdQ": "AtomLayoutMdQ",
        "num_wg": "num_wg",
    }
    out: dict[str, dict | None] = {"FA4's pick": None}
    for found in sm90_config_search.find_feasible_bwd_configs(head_dim, head_dim):
        cfg = {ours: found[theirs] for theirs, ours in fields.items()}
        name = f"{cfg['m_block_size']}x{cfg['n_block_size']}"
        if name == "128x128" and not cfg["dQ_swapAB"]:
            continue  # the pick's shape: FA4's own pick stands for it, try the dQ-swapped variant
        out.setdefault(name, cfg)
    return out


def fa4_bwd_tiling(name: str) -> dict:
    """The pair's backward at GPT-2's shape under one tiling of ``fa4_bwd_tilings``, its
    gradient compared with cuDNN's."""
    import time

    from flash_attn.cute import interface

    cfg = fa4_bwd_tilings()[name]
    if cfg is not None:
        interface._tile_size_bwd_sm90 = lambda *a, **k: interface.BwdConfig(**cfg)
    t0 = time.monotonic()
    row, (_, dqkv) = measure(*SHAPES["gpt2-124m"], backend=None)
    first = time.monotonic() - t0
    _, (_, ref) = measure(*SHAPES["gpt2-124m"], backend=SDPBackend.CUDNN_ATTENTION)
    return {
        **row,
        "config": cfg,
        "grad_max_diff_vs_cudnn": float((dqkv - ref).abs().max()),
        "first_call_s": first,
    }


def _failure(proc) -> str:
    """A failed child's exit (a signal by name) and its last line of stderr that is not a warning."""
    import signal

    code = proc.returncode
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
    lines = [
        ln
        for ln in proc.stderr.splitlines()
        if ln.strip() and "Warning" not in ln and "exe_args" not in ln
    ]
    return f"{how}: {lines[-1].strip()[:300]}" if lines else how


def fa4_bwd_tiles(budget_s: float) -> dict:
    """Each tiling in a process of its own (a tiling that does not compile may abort the
    process), until ``budget_s`` runs out; prints a row as each one ends."""
    import subprocess
    import sys
    import tempfile
    import time

    results, start = {}, time.monotonic()
    print(
        f"{'tiling (m x n)':>16} {'bwd ms':>8} {'TFLOP/s':>8} {'grad diff':>10} {'s':>5}",
        flush=True,
    )
    for name in fa4_bwd_tilings():
        left = budget_s - (time.monotonic() - start)
        if left < 20:
            results[name] = {"skipped": "time budget"}
            continue
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            try:
                proc = subprocess.run(
                    [sys.executable, __file__, "--fa4-bwd-tiling", name, "--out", f.name],
                    capture_output=True,
                    text=True,
                    timeout=left,
                )
                row = (
                    json.loads(Path(f.name).read_text())
                    if proc.returncode == 0
                    else {"error": _failure(proc)}
                )
            except subprocess.TimeoutExpired:
                row = {"error": "time budget ran out while it ran"}
        results[name] = row
        if "error" in row:
            print(f"{name:>16} {row['error']}", flush=True)
        else:
            print(
                f"{name:>16} {row['bwd_ms']:8.4f} {row['bwd_tflops']:8.0f} {row['grad_max_diff_vs_cudnn']:10.1e} "
                f"{row['first_call_s']:5.0f}",
                flush=True,
            )
    return results


def kernels_by_shape() -> dict:
    """Every kernel at every shape, printed as one table; the figures as a dict."""
    from torch.nn import attention

    # FA4 comes last: once activated, torch's flash kernels stay routed to it
    backends = {
        "cudnn": (SDPBackend.CUDNN_ATTENTION, None),
        "flash (FA2)": (SDPBackend.FLASH_ATTENTION, None),
    }
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "impls": getattr(attention, "list_flash_attention_impls", list)(),
    }
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
            row.update(
                out_max_diff=float((y - ref[0]).abs().max()),
                grad_max_diff=float((dqkv - ref[1]).abs().max()),
            )
            results.setdefault(name, {})[impl] = row
            table.append(
                [
                    name,
                    impl,
                    f"{row['fwd_ms']:.3f}",
                    f"{row['fwd_tflops']:.0f}",
                    f"{row['bwd_ms']:.3f}",
                    f"{row['bwd_tflops']:.0f}",
                    f"{row['out_max_diff']:.1e}",
                    f"{row['grad_max_diff']:.1e}",
                ]
            )
    headers = ["shape", "kernel", "fwd ms", "TFLOP/s", "bwd ms", "TFLOP/s", "out diff", "grad diff"]
    print(tabulate(sorted(table, key=lambda r: r[0], reverse=True), headers=headers))
    return results


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--out", help="write the figures as JSON here")
    p.add_argument(
        "--fa4-bwd-tiles",
        action="store_true",
        help="only: the pair's backward under FA4's Hopper tilings",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=300.0,
        help="seconds for --fa4-bwd-tiles (compilation included)",
    )
    # one tiling, in the sweep's child process
    p.add_argument("--fa4-bwd-tiling", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.fa4_bwd_tiling:
        Path(args.out).write_text(json.dumps(fa4_bwd_tiling(args.fa4_bwd_tiling)))
        return
    if args.fa4_bwd_tiles:
        results = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "fa4_bwd_tiles": fa4_bwd_tiles(args.budget),
        }
    else:
        results = kernels_by_shape()
    write_json(args.out, results)


if __name__ == "__main__":
    main()
