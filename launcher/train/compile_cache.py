"""Compiled graphs kept between runs in ``$LAUNCHER_COMPILE_CACHE``: torch's cache artifacts,
one file per graph key, loaded by every rank before it compiles and written by rank 0; and
how many of a run's graphs came from a cache (``cache_hits``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from launcher.spec.envforward import COMPILE_CACHE_ENV
from launcher.spec.job import JobSpec

log = logging.getLogger(__name__)

DEFAULT_DIR = "~/.cache/launcher/compile"


def cache_dir() -> Path:
    return Path(os.environ.get(COMPILE_CACHE_ENV) or DEFAULT_DIR).expanduser()


def graph_key(job: JobSpec, *, device: torch.device, world_size: int) -> str:
    """What the compiled graphs depend on: torch, the GPU, the trainer's code, and the job's
    model, shapes, precision, kernels and parallelism (not its steps, LR or data source)."""
    t = job.train
    parts: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "code": _code_hash(),
        "model": job.model.model_dump(mode="json"),
        "seq_len": job.data.seq_len,
        "mask_prob": job.data.mask_prob,
        "train": {
            k: getattr(t, k)
            for k in (
                "micro_batch",
                "grad_accum",
                "compile_scope",
                "cuda_graphs",
                "kernels",
                "attention",
                "activation_checkpointing",
                "grad_clip",
            )
        },
        "precision": job.precision.model_dump(mode="json"),
        "parallel": job.parallel.model_dump(mode="json"),
        "distributed": world_size > 1,
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclasses.dataclass(eq=False)
class CompileCache:
    """One job's cache file; ``load`` before the first compile, ``save`` after compiling."""

    path: Path
    rank: int
    known: int = 0  # artifacts the file held when loaded (or last written)
    loaded: bool = False

    def load(self) -> None:
        """Hand the file's artifacts to torch's caches; a missing or unreadable file is a miss."""
        try:
            blob = self.path.read_bytes()
        except OSError:
            return
        try:
            info = torch.compiler.load_cache_artifacts(blob)
        except Exception as err:  # written by another torch, or cut short: compile afresh
            info, why = None, str(err)
        else:
            why = "torch found no artifacts in it"
        if info is None:
            log.warning("compile cache %s not loaded (%s); compiling afresh", self.path, why)
            return
        self.known = _count(info)
        self.loaded = True
        if self.rank == 0:
            log.info("compile cache: %d artifacts from %s", self.known, self.path)

    def save(self) -> None:
        """Rank 0: write this process's artifacts when there are more than the file holds."""
        if self.rank != 0:
            return
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        blob, info = saved
        count = _count(info)
        if count <= self.known:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(
                dir=self.path.parent, prefix=f".{self.path.name}.", delete=False
            ) as tmp:
                tmp.write(blob)
            os.replace(tmp.name, self.path)
        except OSError as err:  # a read-only or full folder: the next run compiles again
            log.warning("compile cache not written to %s: %s", self.path, err)
            return
        self.known = count
        log.info("compile cache: %d artifacts written to %s", count, self.path)


def open_cache(job: JobSpec, *, device: torch.device, rank: int, world_size: int) -> CompileCache:
    key = graph_key(job, device=device, world_size=world_size)
    return CompileCache(cache_dir() / f"{job.model.arch}-{key}.bin", rank=rank)


def cache_autograd_functions() -> None:
    """Let AOTAutograd's cache keep graphs that hold a custom ``autograd.Function`` (the fused
    LM-head loss is one). torch leaves them out by default, and a warm start then traces the
    forward and backward again. The traced function is part of the graph, so of the cache key."""
    import torch._functorch.config as config

    if hasattr(config, "autograd_cache_allow_custom_autograd_functions"):
        config.autograd_cache_allow_custom_autograd_functions = True


def cache_hits() -> dict[str, dict[str, int]]:
    """Graphs compiled so far in this process, by cache and outcome: AOTAutograd's (forward and
    backward) and inductor's FX graph cache, each ``hit``, ``miss`` or ``bypass``."""
    from torch._dynamo.utils import counters

    out: dict[str, dict[str, int]] = {}
    for cache, group, prefix in (
        ("aot_autograd", "aot_autograd", "autograd_cache_"),
        ("fx_graph", "inductor", "fxgraph_cache_"),
    ):
        seen = counters[group]
        out[cache] = {k: int(seen[prefix + k]) for k in ("hit", "miss", "bypass")}
    return out


def _count(info: Any) -> int:
    return sum(len(keys) for keys in getattr(info, "artifacts", {}).values()) if info else 0


def _code_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
