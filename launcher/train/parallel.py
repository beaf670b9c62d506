"""Float8 layers, activation checkpointing, torch.compile, then DDP or FSDP2, in that order
(torchtitan's).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from launcher.spec.job import JobSpec
from launcher.train.model import Block, LanguageModel

log = logging.getLogger(__name__)

# The dtype each precision computes in outside float8 matmuls (fp8 runs the rest in bf16).
DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,
}


def parallelize(
    model: LanguageModel, job: JobSpec, *, device: torch.device, world_size: int
) -> nn.Module:
    """Apply float8 → AC → compile → FSDP/DDP as the job asks; returns the module to train."""
    if job.precision.dtype == "fp8":
        p = job.precision
        n = apply_float8(model, recipe=p.fp8_recipe, layers=p.fp8_layers, device=device)
        if n == 0:
            log.warning(
                "fp8: no linear layer of this model passes torchao's %s size filter; all stay bf16 "
                "(precision.fp8_layers: all converts them anyway)",
                p.fp8_recipe,
            )
        else:
            log.info(
                "fp8: %d linear layers in float8 (%s scaling, layers %s)",
                n,
                p.fp8_recipe,
                p.fp8_layers,
            )
    if job.train.activation_checkpointing:
        apply_activation_checkpointing(model)
    data_parallel = world_size > 1 or shards_alone(job)
    if job.train.compile:
        scope = job.train.compile_scope
        if scope == "auto":
            scope = "block" if data_parallel else "model"
        whole = scope == "model"
        apply_compile(
            model,
            cuda_graphs=job.train.cuda_graphs,
            whole=whole,
            batch_weight_grads=batches_weight_grads(job, model, device=device, whole=whole),
        )
    if not data_parallel:
        if job.parallel.strategy == "fsdp":
            log.info("fsdp on one process: nothing to shard, the model trains unwrapped")
        return model
    if job.parallel.strategy == "fsdp":
        return apply_fsdp(model, job, device=device, world_size=world_size)
    return apply_ddp(model, job, device=device)


def shards_alone(job: JobSpec) -> bool:
    """Whether FSDP applies to a world of one process: only for ``parallel.fsdp.cpu_offload``
    (else one process trains the model unwrapped, as under DDP)."""
    return job.parallel.strategy == "fsdp" and job.parallel.fsdp.cpu_offload


def process_group_backend(job: JobSpec) -> str:
    """The backend ``init_process_group`` gets: the job's, with gloo beside NCCL for the CPU
    tensors of FSDP's offloaded gradient shards (``parallel.fsdp.cpu_offload``)."""
    backend = job.backend
    if backend == "nccl" and job.parallel.strategy == "fsdp" and job.parallel.fsdp.cpu_offload:
        return "cuda:nccl,cpu:gloo"
    return backend


FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and later


def apply_float8(model: nn.Module, *, recipe: str, layers: str, device: torch.device) -> int:
    """Swap the blocks' linear layers for torchao's float8 training layers; returns how many.
    ``layers="auto"`` keeps those torchao's size filter expects to lose time; ``"all"``
    converts every one whose dims divide by 16. SpecError without FP8 hardware or torchao."""
    from launcher.errors import SpecError

    field = "precision.dtype"
    cuda = device.type == "cuda"
    if not cuda or torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        what = torch.cuda.get_device_name(device) if cuda else "the CPU"
        cap = ".".join(map(str, torch.cuda.get_device_capability(device))) if cuda else "none"
        raise SpecError(
            f"fp8 needs FP8 tensor cores (compute capability 8.9 or above: Ada, Hopper, Blackwell); "
            f"{what} has compute capability {cap}. Set precision.dtype: bf16.",
            field=field,
        )
    try:
        from torchao.float8 import (
            Float8LinearConfig,
            _auto_filter_for_recipe,
            convert_to_float8_training,
        )
    except ImportError as err:
        raise SpecError(
            f"fp8 trains through torchao's float8 layers, and torchao is not importable here ({err}); "
            "install it on every node (pip install 'torchao>=0.17', or the project's fp8 extra) "
            "or set precision.dtype: bf16.",
            field=field,
        ) from err
    size_ok = _auto_filter_for_recipe(recipe, filter_fqns=[]) if layers == "auto" else None

    def wanted(module: nn.Module, fqn: str) -> bool:
        if not (fqn.startswith("blocks.") and isinstance(module, nn.Linear)):
            return False
        if size_ok is not None:
            return size_ok(module, fqn)
        out_features, in_features = module.weight.shape
        return out_features % 16 == 0 and in_features % 16 == 0

    chosen = [name for name, m in model.named_modules() if wanted(m, name)]
    if chosen:
        convert_to_float8_training(
            model, module_filter_fn=wanted, config=Float8LinearConfig.from_recipe_name(recipe)
        )
    return len(chosen)


def apply_activation_checkpointing(model: LanguageModel) -> None:
    """Recompute each block's activations in backward (see ``model.Block``)."""
    for block in model.blocks:
        assert isinstance(block, Block)
        block.checkpoint_activations = True


def batches_weight_grads(
    job: JobSpec, model: nn.Module, *, device: torch.device, whole: bool
) -> bool:
    """Whether the compiled backward batches the blocks' weight gradients over the layers
    (``train.weight_grads: auto``): one whole-model graph on a CUDA GPU with half-precision
    weights and no activation checkpointing."""
    half = any(p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters())
    return (
        job.train.weight_grads == "auto"
        and whole
        and device.type == "cuda"
        and half
        and not job.train.activation_checkpointing
    )


def apply_compile(
    model: LanguageModel,
    *,
    cuda_graphs: bool = False,
    whole: bool = False,
    batch_weight_grads: bool = False,
) -> None:
    """Compile the embeddings, each block and the head (or, ``whole``, the model), in place
    (names unchanged); ``cuda_graphs`` replays them as CUDA graphs, ``batch_weight_grads``
    adds ``wgrad.WeightGradBatching`` to a whole-model compilation. Dynamo's DDP optimizer
    is off: a block is already the unit of overlap."""
    torch._dynamo.config.optimize_ddp = False
    options: dict[str, Any] = {"mode": "reduce-overhead"} if cuda_graphs else {}
    if whole:
        if batch_weight_grads:
            from torch._inductor import list_mode_options

            from launcher.train.wgrad import WeightGradBatching

            inductor = dict(list_mode_options("reduce-overhead")) if cuda_graphs else {}
            options = {"options": {**inductor, "post_grad_custom_post_pass": WeightGradBatching()}}
        model.compile(**options)
        return
    model.embed.compile(**options)
    for block in model.blocks:
        block.compile(**options)
    model.head.compile(**options)


def apply_ddp(model: nn.Module, job: JobSpec, *, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from launcher.errors import SpecError

    cfg = job.parallel.ddp
    if cfg.comm_hook == "bf16" and device.type != "cuda":  # resources.device auto that found no GPU
        raise SpecError(
            "bf16 needs CUDA GPUs and NCCL; on the CPU use fp16 or none",
            field="parallel.ddp.comm_hook",
        )
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
        static_graph=cfg.static_graph,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
    )
    if cfg.comm_hook != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = getattr(default_hooks, f"{cfg.comm_hook}_compress_hook")  # bf16 or fp16
        ddp.register_comm_hook(state=None, hook=hook)
    elif any(p.dtype == torch.bfloat16 for p in model.parameters()):  # precision.weights bf16
        ddp.register_comm_hook(state=None, hook=allreduce_in_fp32)
    return ddp


def allreduce_in_fp32(group, bucket):  # no annotations: DDP compares them to its own types
    """A DDP comm hook for bf16 gradients (``precision.weights: bf16``): the bucket
    (``dist.GradBucket``) is averaged in fp32, as fp32 gradients are, and rounded to bf16
    once, after the sum."""
    group = group or dist.group.WORLD
    buffer = bucket.buffer()
    wide = buffer.to(torch.float32).div_(dist.get_world_size(group))

    def narrow(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return dist.all_reduce(wide, group=group, async_op=True).get_future().then(narrow)


def fsdp_param_dtype(job: JobSpec) -> torch.dtype | None:
    """The dtype FSDP gathers parameters in; None keeps them fp32."""
    name = job.parallel.fsdp.param_dtype
    dtype = DTYPES[job.precision.dtype if name == "auto" else name]
    return None if dtype == torch.float32 else dtype


def apply_fsdp(
    model: LanguageModel, job: JobSpec, *, device: torch.device, world_size: int
) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    cfg = job.parallel.fsdp
    mesh = init_device_mesh(device.type, (world_size,))
    policies: dict[str, Any] = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(
            param_dtype=fsdp_param_dtype(job), reduce_dtype=DTYPES[cfg.reduce_dtype]
        ),
        offload_policy=CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy(),
    )
    blocks, per_unit = list(model.blocks), cfg.blocks_per_unit
    units = [blocks[i : i + per_unit] for i in range(0, len(blocks), per_unit)]
    for i, unit in enumerate(units):
        # The last unit's backward runs right after the head's: resharding it after forward
        # would only all-gather it again at once (torchtitan does the same).
        reshard = cfg.reshard_after_forward and i < len(units) - 1
        # A list is one unit: one all-gather, one reduce-scatter and one set of hooks for
        # all its blocks (FSDP's per-unit host work is what a small model's step waits on).
        fully_shard(unit if len(unit) > 1 else unit[0], reshard_after_forward=reshard, **policies)
    fully_shard(model, reshard_after_forward=cfg.reshard_after_forward, **policies)
    return model


def gradient_sync(
    model: nn.Module, enabled: bool, *, keep_gathered: bool = False
) -> AbstractContextManager:
    """Skip the gradient all-reduce / reduce-scatter on non-final micro-batches (DDP's
    ``no_sync``, FSDP2's ``set_requires_gradient_sync``); ``keep_gathered`` also keeps FSDP2's
    parameters gathered between micro-batches: one all-gather per optimizer step."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(model, FSDPModule):
        # The setters walk every module; call them only when the flag changes (never without
        # gradient accumulation, where every backward syncs and reshards, FSDP's default).
        if getattr(model, "_launcher_grad_sync", True) != enabled:
            model.set_requires_gradient_sync(enabled)
            if keep_gathered:
                model.set_reshard_after_backward(enabled)
            setattr(model, "_launcher_grad_sync", enabled)  # noqa: B010 - a flag of our own
        return nullcontext()
    if isinstance(model, DDP) and not enabled:
        return model.no_sync()
    return nullcontext()


def needs_backward(model: nn.Module, sync: bool) -> bool:
    """Whether a micro-batch's gradients must come from ``loss.backward()``, for FSDP2's hooks
    (always) or DDP's (on a syncing micro-batch)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return is_sharded(model) or (sync and isinstance(model, DDP))


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s result, with the L2 norm from ``grad_norm``;
    returns the total norm before clipping."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    total = grad_norm(params)
    coef = clip_coefficient(total, max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in local:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group_grads in by_dtype.values():
        if _foreach_ok(group_grads):
            torch._foreach_mul_(group_grads, coef.to(group_grads[0].device))
        else:
            for t in group_grads:
                t.mul_(coef.to(t.device))
    return total


@torch.no_grad()
def clip_in_fused_optimizer(
    optimizer: torch.optim.Optimizer, parameters: Iterable[nn.Parameter], max_norm: float
) -> torch.Tensor:
    """Clip as ``clip_grad_norm_`` does, inside the next step of a fused Adam/AdamW (through its
    ``grad_scale`` slot: not with a ``GradScaler``); returns the total norm before clipping."""
    total = grad_norm(parameters)
    scale = clip_coefficient(total, max_norm).reciprocal()
    optimizer.grad_scale = scale  # type: ignore[attr-defined]  # torch's fused kernel reads it
    return total


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``max_norm / (total_norm + 1e-6)`` clamped to 1, torch's clipping rule (a tensor: no sync)."""
    return torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)


@torch.no_grad()
def grad_norm(parameters: Iterable[nn.Parameter]) -> torch.Tensor:
    """The total L2 norm of all gradients, a 0-d tensor on their device (no host sync).
    FSDP2's ``Shard`` gradients on a 1-D mesh: a foreach norm of the local shards and one
    scalar all-reduce; anything else: torch's ``get_total_norm``."""
    from torch.distributed.tensor import DTensor, Shard

    grads: list[torch.Tensor] = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    if not isinstance(grads[0], DTensor):
        return torch.nn.utils.get_total_norm(grads)
    mesh = grads[0].device_mesh
    if mesh.ndim != 1 or not all(
        isinstance(g, DTensor) and g.device_mesh == mesh and isinstance(g.placements[0], Shard)
        for g in grads
    ):
        total = torch.nn.utils.get_total_norm(grads)
        return total.full_tensor() if isinstance(total, DTensor) else total
    local = [g.to_local() for g in grads if isinstance(g, DTensor)]
    # The local norm in fp32; empty shards left out.
    nonempty = [t for t in local if t.numel()]
    if nonempty:
        local_norm = torch.nn.utils.get_total_norm(nonempty, foreach=_foreach_ok(nonempty))
        local_norm = local_norm.to(device=local[0].device, dtype=torch.float32)
    else:
        local_norm = torch.zeros((), device=local[0].device)
    group = mesh.get_group()
    total = local_norm.square()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.sqrt()


def _foreach_ok(tensors: list[torch.Tensor]) -> bool:
    """Whether the foreach kernels apply: all tensors on one CPU or CUDA device."""
    device = tensors[0].device
    return device.type in ("cpu", "cuda") and all(t.device == device for t in tensors)


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor over ranks (a collective: call it on the same steps on every rank)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    out = tensor.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / dist.get_world_size()
