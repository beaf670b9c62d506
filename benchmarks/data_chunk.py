"""Host time of one chunk of batches (``MadeAhead._make``), or with ``--scan`` of the
vocabulary check a rank runs when it opens a token file.

    python benchmarks/data_chunk.py [--threads 1] [--repeat 5]
    python benchmarks/data_chunk.py --scan 100000000 [--threads 1] [--repeat 7] [--world 8]

How it measures: docs/performance.md, under its name.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import host_batches

from launcher.train import data as data_module
from launcher.train import tokens as tokens_module
from launcher.train.data import MadeAhead, SyntheticBatches
from launcher.train.tokens import TokenFileBatches

CASES = {
    "bert-base": dict(arch="bert", micro_batch=64, grad_accum=4, seq_len=512, vocab_size=30522),
    "gpt2-124m": dict(arch="gpt", micro_batch=16, grad_accum=1, seq_len=1024, vocab_size=50304),
}


def chunk_ms(data: MadeAhead, repeat: int) -> list[float]:
    times = []
    for i in range(repeat):
        start = 1 + i * data.steps_ahead
        began = time.perf_counter()
        data._make(range(start, start + data.steps_ahead))
        times.append(1e3 * (time.perf_counter() - began))
    return times


SCAN_CASES = {  # name: (ids written modulo, vocabulary)
    "gpt2": (50257, 50257),
    "bert": (30522, 30522),
    "too-small": (50257, 30522),
    "2^16": (50257, 1 << 16),
}


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def scan_ms(n: int, *, repeat: int, world: int, cold: bool, threads: int) -> None:
    """Time opening a uint16 token file of n ids (its vocabulary check) per SCAN_CASES."""
    common = host_batches(arch="gpt", seq_len=1024, micro_batch=1, grad_accum=1)
    with tempfile.TemporaryDirectory() as tmp:
        for name, (modulo, vocab) in SCAN_CASES.items():
            path = Path(tmp) / f"ids-{modulo}.bin"
            if not path.exists():
                (torch.arange(n, dtype=torch.int64) * 7919 % modulo).to(
                    torch.uint16
                ).numpy().tofile(path)
            times, rank_times, verdict = [], [], "ok"
            for _ in range(repeat):
                if cold:
                    drop_from_page_cache(path)
                began = time.perf_counter()
                try:
                    TokenFileBatches(
                        path=path, token_dtype="uint16", vocab_size=vocab, **common
                    ).close()
                except data_module.DataError:
                    verdict = "DataError"
                times.append(1e3 * (time.perf_counter() - began))
                if world > 1:
                    if cold:
                        drop_from_page_cache(path)
                    ids = tokens_module.open_token_file(path, "uint16").view(torch.int16)
                    slowest = 0.0
                    for rank in range(world):
                        start, stop = tokens_module.scan_slice(n, rank, world)
                        began = time.perf_counter()
                        tokens_module.scan_ids(ids, vocab, low_bits=0xFFFF, start=start, stop=stop)
                        slowest = max(slowest, time.perf_counter() - began)
                    rank_times.append(1e3 * slowest)
            row = {
                "scan": name,
                "ids": n,
                "vocab": vocab,
                "threads": threads,
                "cold": cold,
                "verdict": verdict,
                "open_ms_p50": round(statistics.median(times), 1),
                "open_ms_min": round(min(times), 1),
            }
            if rank_times:
                row.update(world=world, slowest_rank_ms_p50=round(statistics.median(rank_times), 1))
            print(json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument(
        "--scan", type=int, metavar="N", help="time the vocabulary check of N uint16 ids instead"
    )
    p.add_argument(
        "--world", type=int, default=1, help="with --scan: also the slowest of W ranks' slices"
    )
    p.add_argument(
        "--cold", action="store_true", help="with --scan: drop the file from the page cache first"
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.scan:
        scan_ms(
            args.scan, repeat=args.repeat, world=args.world, cold=args.cold, threads=args.threads
        )
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.bin"
        (torch.arange(1 << 24) * 7919 % 30000).to(torch.uint16).numpy().tofile(path)
        for name, dims in CASES.items():
            common = host_batches(**dims)
            for source, data in (
                ("synthetic", SyntheticBatches(**common)),
                ("tokens", TokenFileBatches(path=path, token_dtype="uint16", **common)),
            ):
                times = chunk_ms(data, args.repeat)
                line = {
                    "case": name,
                    "source": source,
                    "threads": args.threads,
                    "steps": data.steps_ahead,
                    "chunk_ms_p50": round(statistics.median(times), 1),
                    "chunk_ms_min": round(min(times), 1),
                }
                print(json.dumps(line), flush=True)
                data.close()


if __name__ == "__main__":
    main()
