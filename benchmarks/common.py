"""What several benchmarks share: their options, the ``launch run`` command, the versions they
record, progress and JSON output."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose help shows the script's docstring as written."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_sets(parser: argparse.ArgumentParser, help: str) -> None:
    """``--set KEY=VALUE``, repeatable, into ``args.sets``."""
    parser.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help=help
    )


def kernel_bench_args(doc: str, sweep_help: str) -> argparse.Namespace:
    """--sweep and --out, for a benchmark of the Triton kernels; exits where they cannot run."""
    import torch

    from launcher.train import fused

    p = parser(doc)
    p.add_argument("--sweep", action="store_true", help=sweep_help)
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available() or not fused.available(torch.empty(0, device="cuda")):
        raise SystemExit("needs a CUDA GPU and Triton")
    return args


def event_ms(fn: Callable[[], object], rounds: int, calls: int) -> float:
    """Median GPU ms of one ``fn()``: ``rounds`` rounds of ``calls`` calls between CUDA events."""
    import torch

    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def launch_run(job: str | Path, run_dir: Path, sets: Iterable[str], *extra: str) -> list[str]:
    """The argv of ``launch run JOB --run-dir RUN_DIR EXTRA... --set S...``."""
    overrides = [a for s in sets for a in ("--set", s)]
    launch = [sys.executable, "-m", "launcher", "run", str(job), "--run-dir", str(run_dir)]
    return [*launch, *extra, *overrides]


def host_batches(**fields: Any) -> dict[str, Any]:
    """The arguments of a ``Batches`` for a world of one on the CPU, seed 0: ``fields`` (the
    model's and the batch's) over those."""
    import torch

    one = dict(mask_prob=0.15, seed=0, rank=0, world_size=1, device=torch.device("cpu"))
    return one | fields


def write_json(path: str | Path | None, doc: dict) -> None:
    """``doc`` as indented JSON at ``path``, where there is one."""
    if path:
        Path(path).write_text(json.dumps(doc, indent=2))


def environment() -> dict:
    """torch, CUDA, cuDNN, NCCL and torchao versions, the GPUs and the date."""
    import torch

    try:
        import torchao

        torchao_version = torchao.__version__
    except ImportError:
        torchao_version = None
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "torchao": torchao_version,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def fmt(value: float | None, spec: str) -> str:
    """``value`` formatted by ``spec``; empty for None."""
    return "" if value is None else format(value, spec)


def progress(name: str, result: dict, digits: int) -> None:
    """One line for a finished run: its result (floats to ``digits``) and its error's tail."""
    brief = {
        k: round(v, digits) if isinstance(v, float) else v
        for k, v in result.items()
        if k not in ("error", "cmd")
    }
    error = f"\n  error: {result['error'][-1500:]}" if "error" in result else ""
    print(f"[{name}] {brief}{error}", flush=True)
