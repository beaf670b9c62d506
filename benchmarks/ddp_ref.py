"""A minimal DDP training loop under torchrun: the reference the trainer's scaling is judged by.

    torchrun --standalone --nproc-per-node 2 benchmarks/ddp_ref.py --model hf
    torchrun --standalone --nproc-per-node 2 benchmarks/ddp_ref.py --model ours --compile

Rank 0 prints one JSON line. How it measures: docs/performance.md, under its name.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from trainer_vs_hf import bert_batches, build_hf

from launcher.spec.job import SIZE_PRESETS, ModelSpec
from launcher.train.meter import CudaTimer, HostTimer
from launcher.train.model import build_model
from launcher.train.parallel import apply_compile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["hf", "ours"], default="hf")
    p.add_argument("--size", default="base", choices=list(SIZE_PRESETS))
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=100, help="timed steps")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    p.add_argument(
        "--compile", action="store_true", help="torch.compile the model (ours: per block)"
    )
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--static-graph", action="store_true")
    p.add_argument("--mask-prob", type=float, default=0.15)
    args = p.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()  # the CPU path (gloo, fp32) is for a smoke run only
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = ModelSpec(arch="bert", size=args.size)
    torch.manual_seed(0)
    if args.model == "ours":
        with torch.device(device):
            model = build_model(spec)
        if args.compile:
            apply_compile(model)
    else:
        model = build_hf(spec, dropout=0.0).to(device)
        if args.compile:
            model = torch.compile(model)
    model.train()
    ddp = DDP(
        model,
        device_ids=[local_rank] if cuda else None,
        bucket_cap_mb=args.bucket_cap_mb,
        static_graph=args.static_graph,
        gradient_as_bucket_view=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)

    batches = bert_batches(spec, args, device, rank, world)

    def loss_of(b: dict) -> torch.Tensor:
        if args.model == "ours":
            return ddp(b["input_ids"], b["labels"], b["mask_pos"])
        return ddp(input_ids=b["input_ids"], labels=b["hf_labels"]).loss

    def step(i: int) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = loss_of(batches[i % len(batches)])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(args.warmup):
        step(i)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    timer = CudaTimer() if cuda else HostTimer()
    sync()
    dist.barrier()
    began = time.perf_counter()
    marks = [timer.mark()]
    for i in range(args.steps):
        step(args.warmup + i)
        marks.append(timer.mark())
    sync()
    seconds = time.perf_counter() - began
    times = [timer.elapsed_ms(a, b) for a, b in itertools.pairwise(marks)]
    mine = {
        "rank": rank,
        "tokens_per_s": args.steps * args.micro_batch * args.seq / seconds,
        "p50_ms": statistics.median(times),
        "mean_ms": statistics.fmean(times),
        "max_ms": max(times),
    }
    every: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(every, mine)
    if rank == 0:
        line = {
            "model": args.model,
            "compile": args.compile,
            "gpus": world,
            "tokens_per_s_per_gpu": min(r["tokens_per_s"] for r in every),
            "ranks": every,
        }
        print(json.dumps(line))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
