"""A user's own torchrun script, launched by `launch examples/custom_job.yaml`.

Anything torchrun can run works; calling `launcher.report(...)` feeds the launcher's
per-rank tables (it is a no-op when the script runs outside the launcher).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

import launcher


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--fail-at", type=int, default=-1, help="raise at this step (rank 1)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, args.steps + 1):
        if step == args.fail_at and rank == min(1, dist.get_world_size() - 1):
            raise RuntimeError(f"injected failure at step {step}")
        x = torch.randn(args.batch, 64)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.01)
        launcher.report(step=step, samples=args.batch, tokens=args.batch * 64, loss=loss.item())
        if rank == 0 and step % 5 == 0:
            print(f"step {step}/{args.steps} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()
    if rank == 0:
        print(f"done on {os.environ.get('LAUNCHER_NODE', 'plain torchrun')}", flush=True)


if __name__ == "__main__":
    main()
