"""A checkpoint of GPT-2 124M's training state (1.39 GiB) on this machine, no GPU needed: DCP's
write and planning time, and what the first background save holds training.

    python benchmarks/checkpoint_write.py [--dir DIR] [--threads 1,2,4] [--repeats 3]
                                          [--parts] [--out FILE]

``--dir`` must be on the disk checkpoints go to. How it measures: docs/performance.md, under
its name.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from common import host_batches, parser
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict

import launcher.train.checkpoint as checkpoint
from launcher.spec.job import CheckpointSpec, ModelSpec
from launcher.train.data import SyntheticBatches
from launcher.train.model import build_model


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--threads", default="1,2,4")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--parts", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckpt-write-", dir=args.dir))
    try:
        results = run(root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


def run(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = build_model(ModelSpec(arch="gpt", size="base", bias=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
    for param in model.parameters():  # the moments exist after a step; no forward needed
        param.grad = torch.randn_like(param) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    gib = _bytes(state) / 2**30
    results: dict[str, Any] = {"state_gib": round(gib, 3), "cpus": torch.get_num_threads()}
    print(f"state: {gib:.2f} GiB in {root}", flush=True)

    results["plan_ms"] = round(_plan_seconds(state, cached=False) * 1000, 1)
    _plan_seconds(state, cached=True)  # fills DCP's cache
    results["plan_cached_ms"] = round(_plan_seconds(state, cached=True) * 1000, 1)
    print(
        f"DCP planning (one rank): {results['plan_ms']} ms, "
        f"{results['plan_cached_ms']} ms with the plan of the previous save cached",
        flush=True,
    )

    threads = [int(t) for t in args.threads.split(",") if t]
    times: dict[int, list[float]] = {t: [] for t in threads}
    for rep in range(args.repeats):
        for count in threads:
            folder = root / f"threads{count}-{rep}"
            started = time.perf_counter()
            writer = dcp.FileSystemWriter(str(folder), thread_count=count)
            dcp.save(state, storage_writer=writer, no_dist=True)
            times[count].append(time.perf_counter() - started)
            shutil.rmtree(folder)
            print(
                f"write, {count} thread(s), round {rep + 1}: {times[count][-1]:.2f} s", flush=True
            )
    results["write_s"] = {
        str(count): {
            "median": round(statistics.median(ts), 3),
            "all": [round(t, 3) for t in ts],
            "gib_per_s": round(gib / statistics.median(ts), 3),
        }
        for count, ts in times.items()
    }
    for count, row in results["write_s"].items():
        print(f"write, {count} thread(s): median {row['median']} s ({row['gib_per_s']} GiB/s)")

    if args.parts:
        runs: dict[str, list[list[dict[str, Any]]]] = {"unprepared": [], "prepared": []}
        for rep in range(args.repeats):
            for key, prepared in (("unprepared", False), ("prepared", True)):
                records = _first_save(root / key, model, optimizer, scheduler, prepared)
                runs[key].append(records)
                print(f"{key}, round {rep + 1}: {json.dumps(records)}", flush=True)
        results["first_save"] = runs
        for key, rounds in runs.items():
            for i, label in enumerate(("first", "second")):
                median = {
                    part: round(statistics.median(r[i][part] for r in rounds), 3)
                    for part in ("blocking_s", "setup_s", "stage_s")
                }
                print(f"{label} background save, {key}, median: {median}")
    return results


def _first_save(
    folder: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    prepared: bool,
) -> list[dict[str, Any]]:
    """Two background saves by a fresh Checkpointer, the second after the first completed;
    their ``checkpoint`` records."""
    records: list[dict[str, Any]] = []
    real = checkpoint.write_record
    checkpoint.write_record = records.append  # type: ignore[assignment]
    fields = dict(arch="gpt", vocab_size=64, seq_len=8, micro_batch=2, grad_accum=1)
    data = SyntheticBatches(**host_batches(**fields))
    ckpt = checkpoint.Checkpointer(
        CheckpointSpec(dir=folder, every_steps=1), rank=0, data=data, elastic_batch="keep"
    )
    try:
        if prepared:
            ckpt.prepare(model, optimizer, scheduler)
            time.sleep(5.0)  # steps run meanwhile; the allocation is done by the first save
        for step in (1, 2):
            ckpt.save(step, model, optimizer, scheduler)
            ckpt.wait()
    finally:
        ckpt.close()
        checkpoint.write_record = real  # type: ignore[assignment]
        shutil.rmtree(folder, ignore_errors=True)
    return [r for r in records if r["type"] == "checkpoint"]


def _plan_seconds(state: dict[str, Any], *, cached: bool) -> float:
    """DCP's planning of one rank's save (local plan, global plan, finish), as ``save`` runs it;
    ``cached``: with DCP's plan caching (a class-wide cache, filled by the first such call)."""
    planner = DefaultSavePlanner(enable_plan_caching=True) if cached else DefaultSavePlanner()
    started = time.perf_counter()
    planner.set_up_planner(state, is_coordinator=True)
    local = planner.create_local_plan()
    global_plans, _ = planner.create_global_plan([local])
    planner.finish_plan(global_plans[0])
    return time.perf_counter() - started


def _bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_bytes(v) for v in obj)
    return 0


if __name__ == "__main__":
    main()
