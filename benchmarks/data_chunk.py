"""Host time of one chunk of batches (``MadeAhead._make``: ``steps_ahead`` optimizer steps).

The worker thread makes each chunk while the GPU trains on the steps before, so a chunk must
take well under those steps' GPU time. Times bert-base (micro-batch 64, grad_accum 4, seq 512,
vocabulary 30522) and GPT-2 124M (micro-batch 16, seq 1024, vocabulary 50304) on synthetic
data and on a token file (uint16, generated here), with torch on ``--threads`` CPU threads
(1: what a rank gets under torchrun's OMP_NUM_THREADS=1). Prints one JSON line per case:
the median and minimum over ``--repeat`` chunks, each of new samples.

    python benchmarks/data_chunk.py [--threads 1] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from launcher.train.data import MadeAhead, SyntheticBatches, TokenFileBatches

CASES = {"bert-base": dict(arch="bert", micro_batch=64, grad_accum=4, seq_len=512, vocab_size=30522),
         "gpt2-124m": dict(arch="gpt", micro_batch=16, grad_accum=1, seq_len=1024, vocab_size=50304)}


def chunk_ms(data: MadeAhead, repeat: int) -> list[float]:
    times = []
    for i in range(repeat):
        start = 1 + i * data.steps_ahead
        began = time.perf_counter()
        data._make(range(start, start + data.steps_ahead))
        times.append(1e3 * (time.perf_counter() - began))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.bin"
        (torch.arange(1 << 24) * 7919 % 30000).to(torch.uint16).numpy().tofile(path)
        for name, dims in CASES.items():
            common = dict(**dims, mask_prob=0.15, seed=0, rank=0, world_size=1, device=torch.device("cpu"))
            for source, data in (("synthetic", SyntheticBatches(**common)),
                                 ("tokens", TokenFileBatches(path=path, token_dtype="uint16", **common))):
                times = chunk_ms(data, args.repeat)
                print(json.dumps({"case": name, "source": source, "threads": args.threads,
                                  "steps": data.steps_ahead, "chunk_ms_p50": round(statistics.median(times), 1),
                                  "chunk_ms_min": round(min(times), 1)}), flush=True)
                data.close()


if __name__ == "__main__":
    main()
