"""What training health and evaluation cost per step, measured inside the built-in trainer.

    python benchmarks/health_cost.py [--job jobs/quickstart.yaml] [--steps 40] [--set K=V ...]
    torchrun --nproc-per-node 2 benchmarks/health_cost.py     # the quickstart's 2 gloo ranks

Rank 0 prints one JSON line. How it measures: docs/performance.md, under its name.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from launcher.spec import load_job  # noqa: E402
from launcher.train import parallel  # noqa: E402
from launcher.train.loop import Trainer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default=str(ROOT / "jobs" / "quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    overrides = ["train.eval_every=1000000", "train.log_every=1000000", "train.warmup_steps=0"]
    overrides += args.overrides
    overrides.append(f"train.steps={args.steps + 2}")
    job = load_job(args.job, overrides)
    trainer = Trainer(job)
    try:
        out = measure(trainer, args.steps)
    finally:
        trainer.close()
    if trainer.rank == 0:
        print(json.dumps(out))
    return 0


def measure(trainer: Trainer, steps: int) -> dict:
    cuda = trainer.device.type == "cuda"
    results: dict[str, object] = {}

    def timed(name: str, fn: Callable[[], object]) -> float:
        if cuda:
            torch.cuda.synchronize(trainer.device)
        began = time.perf_counter()
        results[name] = fn()
        if cuda:
            torch.cuda.synchronize(trainer.device)
        return (time.perf_counter() - began) * 1e3

    names = ("step", "grad_norm", "skip_agreement", "meter", "loss_sum_before")
    times: dict[str, list[float]] = {k: [] for k in names}
    meter = trainer.meter
    meter.start()
    trainer.train_step(1)  # the first step (allocations) is not timed
    for step in range(2, steps + 2):
        times["step"].append(timed("loss", lambda s=step: trainer.train_step(s)))
        loss, norm = results["loss"], trainer.grad_norm
        assert isinstance(loss, torch.Tensor)
        times["grad_norm"].append(timed("norm", lambda: parallel.grad_norm(trainer.trained_params)))
        times["skip_agreement"].append(timed("bad", lambda x=loss, n=norm: trainer.nonfinite(x, n)))
        # no log step: what every step adds now (a row of loss and norm), and the one add of
        # the loss into a sum that it replaced
        times["meter"].append(
            timed("r", lambda s=step, x=loss, n=norm: meter.step_end(s, x, grad_norm=n))
        )
        times["loss_sum_before"].append(timed("r", lambda x=loss: x + x))
    evals = [timed("eval", trainer.evaluate) for _ in range(3)]
    t = trainer.job.train
    return {
        "job": trainer.job.name,
        "world_size": trainer.world_size,
        "device": str(trainer.device),
        "threads": torch.get_num_threads(),
        "steps_timed": steps,
        "micro_batch": t.micro_batch,
        "grad_accum": t.grad_accum,
        "eval_steps": t.eval_steps,
        **{f"{k}_ms_p50": round(statistics.median(v), 4) for k, v in times.items()},
        "eval_ms_p50": round(statistics.median(evals), 2),
        "eval_ms_all": [round(e, 2) for e in evals],
    }


if __name__ == "__main__":
    sys.exit(main())
