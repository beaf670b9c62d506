"""All-reduce bandwidth between this node's GPUs (NCCL), the way nccl-tests reports it.

    torchrun --standalone --nproc-per-node 2 benchmarks/allreduce_bw.py [--sizes-mb 1,25,100,400]
    NCCL_PROTO=Simple torchrun --standalone --nproc-per-node 2 benchmarks/allreduce_bw.py

Rank 0 prints one JSON line per size. How it measures: docs/performance.md, under its name.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--sizes-mb", default="1,25,100,400", help="comma-separated message sizes in MiB"
    )
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    for size_mb in (float(s) for s in args.sizes_mb.split(",") if s):
        n = int(size_mb * 2**20) // dtype.itemsize
        x = torch.ones(n, dtype=dtype, device=device)
        for _ in range(args.warmup):
            dist.all_reduce(x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            dist.all_reduce(x)
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / args.iters
        algbw = n * dtype.itemsize / seconds / 1e9
        if rank == 0:
            line = {
                "size_mib": size_mb,
                "dtype": args.dtype,
                "ranks": world,
                "time_us": round(seconds * 1e6, 1),
                "algbw_gbs": round(algbw, 1),
                "busbw_gbs": round(algbw * 2 * (world - 1) / world, 1),
                "nccl_proto": os.environ.get("NCCL_PROTO", "default"),
            }
            print(json.dumps(line), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
