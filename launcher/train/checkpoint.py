"""Checkpoints with ``torch.distributed.checkpoint``: model, optimizer, scheduler, loss scale,
step, data position and RNG state, resumable at another world size. A background save
(``train.checkpoint.async``) copies the state to host memory and is marked complete once every
rank's part is on disk.
"""

from __future__ import annotations

import copy
import logging
import pickle
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.amp import GradScaler
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from launcher.errors import untrusted_checkpoint
from launcher.metrics import write_record
from launcher.spec.job import CheckpointSpec
from launcher.train.data import Batches
from launcher.train.optim import substitute_masters
from launcher.util import unsafe_path, unsafe_reason, write_atomic

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
# What held training at a save, in the ``checkpoint`` record as ``<part>_s``: waiting for the
# previous background save, gathering the state, first-save setup (the writers' process group,
# host memory), the copy to host memory (background saves), the write itself (synchronous saves),
# and the rest (DCP handing the copy to its thread).
PARTS = ("wait", "state", "setup", "stage", "write", "other")
# An optimizer's group settings that say how it runs rather than what it computes.
RUN_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def complete_checkpoints(root: Path | None) -> list[Path]:
    """The complete checkpoint folders under ``root``, oldest first."""
    if root is None or not root.is_dir():
        return []
    done = [p for p in root.glob("step_*") if (p / MARKER).is_file() and p.name[5:].isdigit()]
    return sorted(done, key=lambda p: int(p.name[5:]))


def latest_checkpoint(root: Path | None) -> Path | None:
    """The newest complete checkpoint folder under ``root``, or None."""
    done = complete_checkpoints(root)
    return done[-1] if done else None


class ResumeError(ValueError):
    """A checkpoint this job cannot go on from as configured (the message names the fix)."""


class CheckpointFailed(RuntimeError):
    """A background save failed; the checkpoints completed before it are untouched."""


@dataclass
class _Pending:
    """A background save in flight: its step, folder, DCP future and when it began."""

    step: int
    path: Path
    future: Future
    started: float


@dataclass(frozen=True)
class Resumed:
    """Where a resumed run picked up: the checkpoint, its step, the global samples used
    through that step, and the world size and global batch it was written at."""

    path: Path
    step: int
    samples: int
    world_size: int
    global_batch: int


class Checkpointer:
    """Saves every ``every_steps`` and at the end; resumes from the latest complete one, at
    any world size. ``data`` is this rank's batch source: its position is saved and restored."""

    def __init__(self, spec: CheckpointSpec, *, rank: int, data: Batches, elastic_batch: str):
        self.spec = spec
        self.root = Path(spec.dir) if spec.dir is not None else None
        self.rank = rank
        self.data = data
        self.elastic_batch = elastic_batch
        self.resumed: Resumed | None = None
        self.async_save = spec.async_save
        self.blocking_s: list[float] = []  # the time each save held training, in order
        self._pending: _Pending | None = None
        self._group: Any = None  # the background writes' own gloo group
        self._stager: Any = None  # host memory the state is copied into, kept between saves
        self._reserving: threading.Thread | None = None  # allocating that memory (``prepare``)
        if self.async_save and self.root is not None and _distributed():
            # A collective: every rank builds its Checkpointer at the same point of start-up.
            self._group = dist.new_group(backend="gloo")

    def record(self) -> dict[str, Any]:
        """The ``meta`` record's resume fields: null for a fresh start."""
        r = self.resumed
        return {
            "resumed_from_step": None if r is None else r.step,
            "resumed_world_size": None if r is None else r.world_size,
            "resumed_global_batch": None if r is None else r.global_batch,
        }

    def due(self, step: int, total_steps: int) -> bool:
        if self.root is None:
            return False
        every = self.spec.every_steps
        return step == total_steps or (every > 0 and step % every == 0)

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        scaler: GradScaler | None = None,
    ) -> Path:
        """Save step ``step``'s state (a collective; bf16 weights as their fp32 masters). With
        ``async_save`` it returns once the state is in host memory; ``poll``, ``wait`` or the
        next save mark it complete. The hold goes to ``blocking_s`` and a metrics record."""
        assert self.root is not None
        started = time.perf_counter()
        self.wait()  # one save in flight: its host copy is reused by this one
        parts = {"wait": time.perf_counter() - started}
        mark = time.perf_counter()
        path = step_dir(self.root, step)
        if self.rank == 0:
            if path.exists():  # a leftover from a run that died while saving this step
                shutil.rmtree(path)
            path.mkdir(parents=True)
        _barrier()
        state = self._state(step, model, optimizer, scheduler, scaler)
        parts["state"] = time.perf_counter() - mark
        if self.async_save:
            future = self._save_in_background(state, path, parts)
            self._pending = _Pending(step, path, future, started)
        else:
            mark = time.perf_counter()
            dcp.save(state, storage_writer=self._writer(path))
            _barrier()
            self._mark_complete(step, path)
            _barrier()
            parts["write"] = time.perf_counter() - mark
            log.info("checkpoint saved: %s", path)
        blocking = time.perf_counter() - started
        parts["other"] = max(0.0, blocking - sum(parts.values()))
        self.blocking_s.append(blocking)
        write_record(
            {
                "type": "checkpoint",
                "step": step,
                "async": self.async_save,
                "blocking_s": round(blocking, 4),
                **{f"{part}_s": round(parts[part], 4) for part in PARTS if part in parts},
            }
        )
        return path

    def prepare(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        scaler: GradScaler | None = None,
    ) -> None:
        """Allocate the host memory background saves copy the state into, on a thread of its
        own, so that the first save does not wait for it. Call it once the optimizer has state
        (after the first step); the first save waits for the thread where it is still going."""
        if not self.async_save or self.root is None or self._stager is not None:
            return
        if not optimizer.state:  # torch's get_state_dict would make it with a step of lr 0
            return
        state = self._state(0, model, optimizer, scheduler, scaler)
        if not _plain_tensors(state):  # DCP's stager allocates at its first copy
            return
        stager = self._stager = HostCopy()
        self._reserving = threading.Thread(
            target=stager.reserve, args=(state,), name="checkpoint-host-memory", daemon=True
        )
        self._reserving.start()

    def _state(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        scaler: GradScaler | None,
    ) -> dict[str, Any]:
        """What a checkpoint of step ``step`` holds: DCP's state dicts (bf16 weights as their
        fp32 masters) and the train and RNG entries."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        model_sd = substitute_masters(model_sd, getattr(optimizer, "masters", None))
        # Non-tensor leaves are pickled by DCP; each rank's RNG state has its own key.
        data = self.data
        train = {
            "step": step,
            "samples": data.first_sample(step + 1),
            "world_size": data.world_size,
            "global_batch": data.global_batch,
            "scheduler": pickle.dumps(scheduler.state_dict()),
        }
        if scaler is not None:
            train["scaler"] = pickle.dumps(scaler.state_dict())
        return {
            "model": model_sd,
            "optim": optim_sd,
            "train": train,
            "rng": {f"rank{self.rank}": _rng_state()},
        }

    def poll(self) -> None:
        """Mark a finished background save complete (no collective: call it at any step)."""
        if self._pending is not None and self._pending.future.done():
            self.wait()

    def wait(self) -> None:
        """Wait for the background save in flight, then mark it complete; raises
        ``CheckpointFailed`` when it failed (its folder never gets the marker)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.future.result()
        except (Exception, dcp.CheckpointException) as err:  # DCP's is a BaseException
            last = latest_checkpoint(self.root)
            raise CheckpointFailed(
                f"the checkpoint of step {pending.step} ({pending.path}) failed while it was "
                f"written in the background: {_cause(err)}. The last complete checkpoint is "
                f"{last or 'none'}"
            ) from err
        # DCP's coordinator (rank 0) finishes the save only after every rank's writes: rank 0's
        # future done means the whole checkpoint is on disk.
        self._mark_complete(pending.step, pending.path)
        total = time.perf_counter() - pending.started
        log.info("checkpoint saved: %s (in the background, %.1f s)", pending.path, total)
        write_record(
            {"type": "checkpoint_complete", "step": pending.step, "save_s": round(total, 3)}
        )

    def close(self) -> None:
        """Finish the save in flight (a failure is logged: the run is ending anyway) and free
        the host memory staged for it."""
        try:
            self.wait()
        except CheckpointFailed as err:
            log.error("%s", err)
        finally:
            if self._reserving is not None:
                self._reserving.join()
                self._reserving = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _save_in_background(
        self, state: dict[str, Any], path: Path, parts: dict[str, float]
    ) -> Future:
        """Copy ``state`` to host memory and start the write on DCP's thread, over a gloo group
        of its own (apart from training's collectives); the times go to ``parts``."""
        mark = time.perf_counter()
        if self._reserving is not None:  # the memory ``prepare`` allocates
            self._reserving.join()
            self._reserving = None
        if self._stager is None:
            self._stager = HostCopy() if _plain_tensors(state) else _dcp_stager()
        parts["setup"] = time.perf_counter() - mark
        group = {"process_group": self._group} if _distributed() else {"no_dist": True}
        response: Any = dcp.async_save(
            state, storage_writer=self._writer(path), async_stager=self._stager, **group
        )
        if isinstance(self._stager, HostCopy):
            parts["setup"] += self._stager.alloc_s
            parts["stage"] = self._stager.stage_s - self._stager.alloc_s
        # torch returns an AsyncSaveResponse instead of a future where staging itself is async
        return getattr(response, "upload_completion", response)

    def _writer(self, path: Path) -> dcp.FileSystemWriter:
        return dcp.FileSystemWriter(str(path), thread_count=self.spec.write_threads)

    def _mark_complete(self, step: int, path: Path) -> None:
        if self.rank == 0:
            write_atomic(path / MARKER, f"{step}\n")

    def maybe_resume(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        scaler: GradScaler | None = None,
    ) -> int:
        """Load the latest complete checkpoint when resume is auto, resharded for this world
        size, and put the data at the next sample; the step it ends (or 0). bf16 weights load
        into their fp32 masters; fp16's ``scaler`` goes on at the saved loss scale."""
        if self.spec.resume != "auto" or self.root is None:
            return 0
        path = self._agreed_checkpoint()
        if path is None:
            return 0
        # DCP's .metadata and the train state are unpickled: only from what no one else can change
        reason = unsafe_reason(self.root)  # the folder itself, then the checkpoint's files
        if found := (self.root, reason) if reason else unsafe_path(path):
            raise ResumeError(untrusted_checkpoint(*found))
        model_sd, optim_sd = get_state_dict(model, optimizer)
        model_sd = substitute_masters(model_sd, getattr(optimizer, "masters", None))
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        # DCP loads tensors in place and replaces the non-tensor leaves of this dict.
        train: dict[str, Any] = dict.fromkeys(("step", "samples", "world_size", "global_batch"), 0)
        train["scheduler"] = b""
        has_scaler = scaler is not None and "train.scaler" in saved
        if has_scaler:
            train["scaler"] = b""
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "train": train}
        rng_key = f"rank{self.rank}"
        has_rng = f"rng.{rng_key}" in saved
        if has_rng:
            state["rng"] = {rng_key: b""}
        dcp.load(state, checkpoint_id=str(path))
        # How the optimizer runs (fused or not) is this run's choice, not the checkpoint's.
        flags = [{k: g[k] for k in RUN_FLAGS if k in g} for g in optimizer.param_groups]
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        for group, kept in zip(optimizer.param_groups, flags, strict=True):
            group.update(kept)
        scheduler.load_state_dict(pickle.loads(state["train"]["scheduler"]))
        if has_scaler and scaler is not None:
            scaler.load_state_dict(pickle.loads(state["train"]["scaler"]))
        elif scaler is not None:
            log.warning(
                "%s has no loss scale (written without fp16); the scaler starts at %g",
                path,
                scaler.get_scale(),
            )
        if has_rng:
            _set_rng_state(pickle.loads(state["rng"][rng_key]))
        else:
            log.warning(
                "%s has no RNG state for %s (written by fewer ranks); keeping fresh RNG",
                path,
                rng_key,
            )
        self.resumed = self._continue_data(path, state["train"])
        return self.resumed.step

    def _agreed_checkpoint(self) -> Path | None:
        """The checkpoint every rank resumes from: the latest complete one rank 0 sees, told to
        the others; ResumeError on every rank where one does not see it (no shared folder)."""
        assert self.root is not None
        latest = latest_checkpoint(self.root)
        if not _distributed() or dist.get_world_size() == 1:
            return latest
        chosen = [latest.name if latest is not None else None]
        dist.broadcast_object_list(chosen, src=0)
        if chosen[0] is None:
            return None
        path = self.root / chosen[0]
        seen: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, (path / MARKER).is_file())
        missing = [rank for rank, ok in enumerate(seen) if not ok]
        if missing:
            ranks = ", ".join(map(str, missing))
            raise ResumeError(
                f"rank 0 resumes from {path}, which rank(s) {ranks} do not find complete in their "
                f"train.checkpoint.dir {self.root}: on several nodes it must be one folder every node "
                f"shares (NFS, Lustre, a shared home), or set train.checkpoint.resume: never to start fresh"
            )
        return path

    def _continue_data(self, path: Path, train: dict[str, Any]) -> Resumed:
        """Check the global batch against ``elastic_batch`` and move the data to the next sample."""
        data = self.data
        step = int(train["step"])
        resumed = Resumed(
            path, step, int(train["samples"]), int(train["world_size"]), int(train["global_batch"])
        )
        old, new = resumed.global_batch, data.global_batch
        if old != new:
            if self.elastic_batch == "keep":
                per_rank = data.micro_batch * data.world_size
                fix = (
                    f"set train.grad_accum: {old // per_rank} to keep it"
                    if old % per_rank == 0
                    else "choose a micro_batch and grad_accum whose product with the world size equals it"
                )
                raise ResumeError(
                    f"checkpoint {path} was written at a global batch of {old} samples "
                    f"({resumed.world_size} ranks); this run's is {new} (micro_batch "
                    f"{data.micro_batch} x grad_accum {data.grad_accum} x {data.world_size} ranks) "
                    f"and train.elastic_batch is keep: {fix}, or set train.elastic_batch: scale "
                    f"to let the global batch change"
                )
            log.warning(
                "global batch %d -> %d samples after step %d (train.elastic_batch: scale); "
                "the learning-rate schedule is unchanged",
                old,
                new,
                step,
            )
        data.continue_at(step, resumed.samples)
        was = resumed.world_size != data.world_size
        log.info(
            "resumed from %s (step %d%s); the data go on at sample %d",
            path,
            step,
            f", written by {resumed.world_size} ranks" if was else "",
            resumed.samples,
        )
        return resumed


def _cause(err: BaseException) -> str:
    """One line per failed rank (DCP's CheckpointException maps a rank to its exception and
    traceback)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        causes = {rank: e[0] if isinstance(e, tuple) else e for rank, e in failures.items()}
        return "; ".join(
            f"rank {rank}: {type(e).__name__}: {e}" for rank, e in sorted(causes.items())
        )
    return f"{type(err).__name__}: {err}"


class HostCopy:
    """DCP's stager protocol: each tensor copied into a host buffer kept between saves (pinned
    for GPU tensors), everything else deep-copied (torch 2.11's own stager fails on some
    objects). ``reserve`` allocates ahead; ``stage_s`` and ``alloc_s`` time the last copy."""

    should_synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.stage_s = 0.0
        self.alloc_s = 0.0

    def reserve(self, state: Any) -> None:
        """Allocate (and fault in) a buffer for every tensor of ``state``; copies nothing. A
        failure is logged: the first ``stage`` allocates what is missing."""
        try:
            cuda = [t.device for _, t in _tensors(state) if t.is_cuda]
            if cuda:  # a new thread's current device is 0, not this rank's
                torch.cuda.set_device(cuda[0])
            for path, tensor in _tensors(state):
                buf = self._buffer(tensor, path)
                if not tensor.is_cuda:  # pinned memory is resident already; pageable on use
                    buf.zero_()
        except Exception as err:  # a thread of its own: nobody else would see it
            log.warning("allocating host memory for checkpoints ahead failed: %s", err)

    def stage(self, state: Any) -> Any:
        started = time.perf_counter()
        self.alloc_s = 0.0
        copied = self._copy(state, ())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the non-blocking copies into pinned memory are done
        self.stage_s = time.perf_counter() - started
        return copied

    def _buffer(self, obj: torch.Tensor, path: tuple) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
            started = time.perf_counter()
            pin = obj.is_cuda
            buf = torch.empty(obj.shape, dtype=obj.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
            self.alloc_s += time.perf_counter() - started
        return buf

    def _copy(self, obj: Any, path: tuple) -> Any:
        if isinstance(obj, torch.Tensor):
            buf = self._buffer(obj, path)
            buf.copy_(obj.detach(), non_blocking=obj.is_cuda)
            return buf
        if isinstance(obj, dict):
            return {k: self._copy(v, (*path, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, (*path, i)) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._buffers.clear()


def _tensors(obj: Any, path: tuple = ()) -> Iterator[tuple[tuple, torch.Tensor]]:
    """(path, tensor) for every tensor in nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, (*path, i))


def _plain_tensors(state: Any) -> bool:
    """Whether every tensor in ``state`` is a plain one (no DTensor shard of FSDP)."""
    return all(type(t) in (torch.Tensor, nn.Parameter) for _, t in _tensors(state))


def _dcp_stager() -> Any:
    """DCP's stager into pinned host memory kept between saves, for sharded (DTensor) state."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=cuda,
        )
    )


def _rng_state() -> bytes:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return pickle.dumps(state)


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()
