"""Activation checkpointing, torch.compile, then DDP or FSDP2 — in that order.

The order follows torchtitan: activation checkpointing first (it changes what a block's
forward does), then ``torch.compile`` per block (so the compiled graph includes the
recomputation and DDP/FSDP hooks stay outside it), then the data-parallel wrapper (DDP
around the whole model, or FSDP2's ``fully_shard`` per block and then at the root so the
embeddings and the tied head form the root's group). Compiling with ``Module.compile()``
in place keeps parameter names unchanged, which keeps checkpoints portable.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from launcher.spec.job import JobSpec

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parallelize(model: nn.Module, job: JobSpec, *, device: torch.device, world_size: int) -> nn.Module:
    """Apply AC → compile → FSDP/DDP as the job asks; returns the module to train."""
    if job.train.activation_checkpointing:
        apply_activation_checkpointing(model)
    if job.train.compile:
        apply_compile(model)
    if job.parallel.strategy == "fsdp":
        return apply_fsdp(model, job, device=device, world_size=world_size)
    if world_size > 1:
        return apply_ddp(model, job, device=device)
    return model


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward (see ``model.Block``)."""
    for block in model.blocks:
        block.checkpoint_activations = True


def apply_compile(model: nn.Module) -> None:
    """Compile the embeddings, each block and the head, in place (names unchanged).

    Per block rather than whole-model: every block has the same shapes, so one compiled
    graph is reused L times, and FSDP's per-block hooks sit between graphs.
    """
    model.embed.compile()
    for block in model.blocks:
        block.compile()
    model.head.compile()


def apply_ddp(model: nn.Module, job: JobSpec, *, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg = job.parallel.ddp
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
        static_graph=cfg.static_graph,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
    )
    if cfg.comm_hook == "bf16" and device.type != "cuda":
        raise ValueError("parallel.ddp.comm_hook bf16 needs CUDA GPUs and NCCL; on the CPU use fp16 or none")
    if cfg.comm_hook != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.bf16_compress_hook if cfg.comm_hook == "bf16" else default_hooks.fp16_compress_hook
        ddp.register_comm_hook(state=None, hook=hook)
    return ddp


def fsdp_param_dtype(job: JobSpec) -> torch.dtype | None:
    """The dtype FSDP gathers parameters in; None keeps them fp32."""
    name = job.parallel.fsdp.param_dtype
    if name == "auto":
        name = job.precision.dtype
    dtype = DTYPES[name]
    return None if dtype == torch.float32 else dtype


def apply_fsdp(model: nn.Module, job: JobSpec, *, device: torch.device, world_size: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    cfg = job.parallel.fsdp
    mesh = init_device_mesh(device.type, (world_size,))
    options = dict(
        mesh=mesh,
        reshard_after_forward=cfg.reshard_after_forward,
        mp_policy=MixedPrecisionPolicy(param_dtype=fsdp_param_dtype(job), reduce_dtype=DTYPES[cfg.reduce_dtype]),
        offload_policy=CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy(),
    )
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def gradient_sync(model: nn.Module, enabled: bool) -> AbstractContextManager:
    """Skip the gradient all-reduce / reduce-scatter on non-final micro-batches.

    DDP: ``no_sync()`` while accumulating. FSDP2: ``set_requires_gradient_sync`` (gradients
    stay unsharded and unreduced until the last micro-batch). Plain modules: nothing to do.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        return nullcontext()
    if isinstance(model, DDP) and not enabled:
        return model.no_sync()
    return nullcontext()


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2 modifies the model in place)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor over ranks (a collective: call it on the same steps on every rank)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    out = tensor.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / dist.get_world_size()
