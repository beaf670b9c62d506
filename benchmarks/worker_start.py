"""Where one rank's start goes: importing torch and the trainer, CUDA's start, then each of
the trainer's stages under cProfile (the 45 costliest calls by cumulative time).

    python benchmarks/worker_start.py jobs/gpt.yaml [KEY=VALUE ...]

One process, world size 1, metrics to $OUTDIR (default /tmp).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

begun = time.perf_counter()
import torch  # noqa: E402

torch_s = time.perf_counter() - begun
# Without RANK the trainer makes its own one-process group, as `python -m launcher.train` does.
os.environ["LAUNCHER_METRICS_FILE"] = os.environ.get("OUTDIR", "/tmp") + "/rank{rank}.jsonl"
begun = time.perf_counter()
import launcher.train.__main__  # noqa: E402, F401
from launcher.spec import load_job  # noqa: E402
from launcher.train.loop import Trainer  # noqa: E402

trainer_import_s = time.perf_counter() - begun
begun = time.perf_counter()
if torch.cuda.is_available():
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
cuda_s = time.perf_counter() - begun
print(f"import torch {torch_s:.2f} s; the trainer {trainer_import_s:.2f} s; CUDA {cuda_s:.2f} s")

job = load_job(sys.argv[1], sys.argv[2:])
profile = cProfile.Profile()
begun = time.perf_counter()
profile.enable()
trainer = Trainer(job)
profile.disable()
print(f"Trainer() {time.perf_counter() - begun:.2f} s; stages {trainer.startup_s}")
out = io.StringIO()
pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(45)
print(out.getvalue())
trainer.close()
