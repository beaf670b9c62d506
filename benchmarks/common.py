"""What several benchmarks share: their ``--set`` option, the versions they record, progress."""

from __future__ import annotations

import argparse
import time


def add_sets(parser: argparse.ArgumentParser, help: str) -> None:
    """``--set KEY=VALUE``, repeatable, into ``args.sets``."""
    parser.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help=help
    )


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


def progress(name: str, result: dict, digits: int) -> None:
    """One line for a finished run: its result (floats to ``digits``) and its error's tail."""
    brief = {
        k: round(v, digits) if isinstance(v, float) else v
        for k, v in result.items()
        if k not in ("error", "cmd")
    }
    error = f"\n  error: {result['error'][-1500:]}" if "error" in result else ""
    print(f"[{name}] {brief}{error}", flush=True)
