"""BERT-base's products one by one, and the operand layouts they could run in (one GPU).

    python benchmarks/linear_layouts.py [--out results.json]

Micro-batch 128 × 512 rows (GPT-2's 16 × 1024 in the second part), bf16, each variant
captured as a CUDA graph and replayed (``mlp_kernels.replayed_ms``), so the times are the
GPU's.

1. ``operands``: for each linear (qkv, proj, fc, fc2, and the MLM decoder on its masked rows),
   the forward (with and without the bias in the product's epilogue), the input gradient
   ``dy @ w`` and the weight gradient as ``dyᵀ @ x`` or ``(xᵀ @ dy)ᵀ``, through cuBLAS and
   through cuBLASLt (``torch.backends.cuda.preferred_blas_library``).
2. ``compiled``: forward + backward of each linear as training runs it (compiled, bf16
   autocast over an fp32 weight, the casts included): ``F.linear(x, w)`` against
   ``x @ w.t().contiguous()``, whose products take the other layouts.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mlp_kernels import replayed_ms  # noqa: E402

LINEARS = {
    "qkv": (2304, 768),
    "proj": (768, 768),
    "fc": (3072, 768),
    "fc2": (768, 3072),
    "decoder": (30528, 768),
}
BERT_ROWS, MASKED_ROWS, GPT_ROWS = 128 * 512, 128 * 77, 16 * 1024


def operand_cases(x, w, b, dy) -> dict:
    return {
        "forward": lambda: F.linear(x, w),
        "forward + bias": lambda: F.linear(x, w, b),
        "input grad dy·w": lambda: dy @ w,
        "weight grad dyᵀ·x": lambda: dy.t() @ x,
        "weight grad (xᵀ·dy)ᵀ": lambda: x.t() @ dy,
    }


def forward_backward(fn, x, w, g):
    """``fn(x, w)`` compiled, under bf16 autocast, and its gradients for x and w."""
    compiled_fn = torch.compile(fn)

    def both():
        with torch.autocast("cuda", torch.bfloat16):
            y = compiled_fn(x, w)
        return torch.autograd.grad(y, (x, w), g)

    return both


def operands() -> list[dict]:
    rows = []
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for name, (n_out, n_in) in LINEARS.items():
            m = MASKED_ROWS if name == "decoder" else BERT_ROWS
            x = torch.randn(m, n_in, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n_out, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn(m, n_out, device="cuda", dtype=torch.bfloat16)
            gflop = 2 * m * n_in * n_out / 1e9
            for case, fn in operand_cases(x, w, b, dy).items():
                ms = replayed_ms(fn)
                rows.append(
                    {
                        "blas": lib,
                        "linear": name,
                        "case": case,
                        "ms": round(ms, 4),
                        "tflops": round(gflop / ms, 1),
                    }
                )
    torch.backends.cuda.preferred_blas_library("cublas")
    return rows


def _transposed_copy(x, w):
    return x @ w.t().contiguous()


def compiled() -> list[dict]:
    rows = []
    for model, m in (("bert", BERT_ROWS), ("gpt", GPT_ROWS)):
        for name, (n_out, n_in) in LINEARS.items():
            if name == "decoder":
                continue
            x = torch.randn(m, n_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            w = torch.randn(n_out, n_in, device="cuda", requires_grad=True)
            g = torch.randn(m, n_out, device="cuda", dtype=torch.bfloat16)
            row = {"model": model, "linear": name}
            for variant, fn in (
                ("F.linear", F.linear),
                ("x @ w.t().contiguous()", _transposed_copy),
            ):
                row[variant] = round(replayed_ms(forward_backward(fn, x, w, g)), 4)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "operands": operands(),
        "compiled": compiled(),
    }
    print(
        tabulate(
            [list(r.values()) for r in result["operands"]],
            headers=["blas", "linear", "case", "ms", "TFLOP/s"],
        )
    )
    print()
    print(
        tabulate(
            [list(r.values()) for r in result["compiled"]],
            headers=["model", "linear", "F.linear fwd+bwd ms", "x @ w.t().contiguous() fwd+bwd ms"],
        )
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
