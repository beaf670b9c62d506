"""Does the trainer's step wait on the host? Host issue time against device time, per rank.

    torchrun --standalone --nproc-per-node 2 benchmarks/host_bound.py jobs/bert_ddp.yaml \\
        [--set train.cuda_graphs=false ...]

Rank 0 prints one JSON line: the slowest rank's tokens/s and every rank's figures.
How it measures: docs/performance.md, under its name.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch.distributed as dist
from common import add_sets

from launcher.spec import load_job
from launcher.train.loop import Trainer
from launcher.train.meter import peak_memory_gib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("job", help="a job file (the built-in trainer)")
    add_sets(p, "a job override, as for launch")
    p.add_argument(
        "--warmup", type=int, default=30, help="untimed steps first (compilation, graph recording)"
    )
    p.add_argument(
        "--probe", type=int, default=10, help="steps timed one at a time from an idle device"
    )
    p.add_argument("--steps", type=int, default=120, help="steps timed back to back")
    args = p.parse_args()
    if min(args.probe, args.steps) < 1 or args.warmup < 0:
        p.error("--probe and --steps must be at least 1, --warmup at least 0")
    total = args.warmup + args.probe + args.steps
    job = load_job(args.job, [f"train.steps={total}", "train.warmup_steps=0", *args.sets])
    trainer = Trainer(job)
    try:
        result = measure(trainer, args.warmup, args.probe, args.steps)
        every: list[dict] = [{} for _ in range(trainer.world_size)]
        dist.all_gather_object(every, result)
        if trainer.rank == 0:
            line = {
                "job": job.name,
                "sets": args.sets,
                "world_size": trainer.world_size,
                "tokens_per_s_per_rank": min(r["tokens_per_s"] for r in every),
                "ranks": every,
            }
            print(json.dumps(line))
    finally:
        trainer.close()


def measure(trainer: Trainer, warmup: int, probe: int, steps: int) -> dict:
    sync = trainer.meter.sync  # the trainer's device synchronisation (a no-op on the CPU)
    tokens = trainer.meter.tokens_per_step
    step = 0
    for _ in range(warmup):
        step += 1
        trainer.train_step(step)
    issue, synced = [], []
    for _ in range(probe):
        step += 1
        sync()
        dist.barrier()
        began = time.perf_counter()
        trainer.train_step(step)
        issued = time.perf_counter()
        sync()
        done = time.perf_counter()
        issue.append((issued - began) * 1e3)
        synced.append((done - began) * 1e3)
    sync()
    dist.barrier()
    began = time.perf_counter()
    for _ in range(steps):
        step += 1
        loss = trainer.train_step(step)
    sync()
    seconds = time.perf_counter() - began
    return {
        "rank": trainer.rank,
        "tokens_per_s": steps * tokens / seconds,
        "step_ms": seconds * 1e3 / steps,
        "issue_ms": statistics.median(issue),
        "synced_ms": statistics.median(synced),
        "loss": float(loss),
        "peak_mem_gib": peak_memory_gib(trainer.device),
    }


if __name__ == "__main__":
    main()
