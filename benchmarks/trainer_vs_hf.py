"""This trainer's BERT step vs Hugging Face ``BertForMaskedLM``, side by side, one process.

    pip install -e '.[bench]'
    python benchmarks/trainer_vs_hf.py --size base --seq 512 --micro-batch 32 --compile   # H200
    python benchmarks/trainer_vs_hf.py --device cpu --size tiny --seq 128 --micro-batch 8 --steps 10

How it measures: docs/performance.md, under its name.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch

from launcher.spec.job import SIZE_PRESETS, ModelSpec
from launcher.train.data import SyntheticBatches
from launcher.train.model import build_model, count_params
from launcher.train.parallel import apply_compile


def build_hf(spec: ModelSpec, dropout: float) -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    d = spec.dims()
    config = BertConfig(
        vocab_size=d["vocab_size"],
        hidden_size=d["d_model"],
        num_hidden_layers=d["n_layers"],
        num_attention_heads=d["n_heads"],
        intermediate_size=d["d_ff"],
        max_position_embeddings=d["max_positions"],
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        attn_implementation="sdpa",
    )
    return BertForMaskedLM(config)


def bert_batches(
    spec: ModelSpec, args: argparse.Namespace, device: torch.device, rank: int = 0, world: int = 1
) -> list[dict]:
    """Four synthetic batches, made up front so data generation is not timed, each with HF's
    labels too (``hf_labels``: the masked tokens in place, -100 elsewhere)."""
    data = SyntheticBatches(
        arch="bert",
        vocab_size=spec.dims()["vocab_size"],
        seq_len=args.seq,
        micro_batch=args.micro_batch,
        grad_accum=1,
        mask_prob=args.mask_prob,
        seed=0,
        rank=rank,
        world_size=world,
        device=device,
    )
    batches = [data.batch(i + 1) for i in range(4)]
    data.close()  # no more chunks: the one being made ahead ends in the untimed warm-up
    for b in batches:
        b["hf_labels"] = torch.full_like(b["input_ids"], -100).scatter(
            1, b["mask_pos"], b["labels"]
        )
    return batches


def time_steps(
    step: Callable[[int], None], *, warmup: int, steps: int, device: torch.device
) -> float:
    """Seconds for ``steps`` steps after ``warmup`` untimed ones (synchronised at both ends)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(warmup):
        step(i)
    sync()
    began = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    sync()
    return time.perf_counter() - began


def make_step(
    model: torch.nn.Module,
    loss_fn: Callable[[dict], torch.Tensor],
    device: torch.device,
    autocast_dtype: torch.dtype | None,
) -> Callable[[dict], None]:
    """One optimizer step of ``model`` on a batch (AdamW, fused on CUDA; autocast if asked)."""
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
    amp = (
        (lambda: torch.autocast(device.type, dtype=autocast_dtype))
        if autocast_dtype
        else nullcontext
    )

    def step(batch: dict) -> None:
        with amp():
            loss = loss_fn(batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="base", choices=list(SIZE_PRESETS))
    p.add_argument("--seq", type=int, default=512, help="sequence length")
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument(
        "--warmup", type=int, default=10, help="untimed steps first (compilation, allocator)"
    )
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"]
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile this trainer's model (per block, as the trainer does)",
    )
    p.add_argument(
        "--compile-hf", action="store_true", help="also torch.compile the Hugging Face model"
    )
    p.add_argument(
        "--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on cuda, fp32 on cpu"
    )
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--mask-prob", type=float, default=0.15)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    autocast_dtype = torch.bfloat16 if dtype == "bf16" else None
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    spec = ModelSpec(arch="bert", size=args.size, dropout=args.dropout)
    batches = bert_batches(spec, args, device)
    tokens = args.steps * args.micro_batch * args.seq
    results: dict[str, dict] = {}

    def measure(model: torch.nn.Module, loss_fn: Callable[[dict], torch.Tensor]) -> dict:
        model.train()
        step = make_step(model, loss_fn, device, autocast_dtype)
        seconds = time_steps(
            lambda i: step(batches[i % len(batches)]),
            warmup=args.warmup,
            steps=args.steps,
            device=device,
        )
        return {"params": count_params(model), "seconds": seconds, "tokens_per_s": tokens / seconds}

    def measure_ours() -> dict:  # a function, so the model is freed before HF is built
        torch.manual_seed(0)
        with torch.device(device):
            ours = build_model(spec)
        if args.compile:
            apply_compile(ours)
        return measure(ours, lambda b: ours(b["input_ids"], b["labels"], b["mask_pos"]))

    results["launcher"] = measure_ours()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    torch.manual_seed(0)
    hf = build_hf(spec, args.dropout).to(device)
    hf_step = torch.compile(hf) if args.compile_hf else hf
    results["hf"] = measure(
        hf, lambda b: hf_step(input_ids=b["input_ids"], labels=b["hf_labels"]).loss
    )

    ratio = results["launcher"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
    setup = {
        "size": args.size,
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "device": str(device),
        "dtype": dtype,
        "compile": args.compile,
        "compile_hf": args.compile_hf,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    if args.json:
        print(json.dumps({**setup, **results, "ratio": ratio}))
        return
    print(" ".join(f"{k}={v}" for k, v in setup.items()))
    print(f"{'model':<24}{'params':>14}{'tokens/s':>14}{'ms/step':>10}")
    for name, label in (("launcher", "launcher.train BERT"), ("hf", "HF BertForMaskedLM")):
        r = results[name]
        print(
            f"{label:<24}{r['params']:>14,}{r['tokens_per_s']:>14,.0f}{1e3 * r['seconds'] / args.steps:>10.1f}"
        )
    print(f"ratio (launcher / HF): {ratio:.2f}x")


if __name__ == "__main__":
    main()
