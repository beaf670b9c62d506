"""bf16 working weights with fp32 master weights (``precision.weights: bf16``).

``MasterWeights`` holds the masters; ``MasterAdamW`` updates them in one kernel per group.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, overload

import torch
from torch import nn

from launcher.errors import SpecError
from launcher.spec.job import bf16_weights_obstacles, bf16_weights_refusal
from launcher.train import parallel

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference
    triton = None

BLOCK = 1024  # elements a program; each tensor's slice of the flat buffers is padded to it
NUM_WARPS = 4
FIELD = "precision.weights"


def choose_weights(
    requested: str, *, dtype: str, grad_accum: int, sharded: bool, device: torch.device
) -> str:
    """The weights a run trains (``precision.weights``): ``auto`` is ``bf16`` for bf16 training
    with one micro-batch a step, unsharded, on a CUDA GPU with Triton, else ``fp32``."""
    if requested == "fp32":
        return "fp32"
    reasons = bf16_weights_obstacles(dtype=dtype, grad_accum=grad_accum, sharded=sharded)
    if requested == "auto":
        return "bf16" if not reasons and triton is not None and device.type == "cuda" else "fp32"
    if reasons:
        raise SpecError(bf16_weights_refusal(reasons), field=FIELD)
    return "bf16"


class MasterWeights:
    """The fp32 masters of ``params`` and each ``p.data`` made a bf16 view into one flat buffer
    (the same ``nn.Parameter`` objects). Build it after loading weights, before DDP."""

    def __init__(self, params: Sequence[nn.Parameter]):
        params = list(params)
        if len({id(p) for p in params}) != len(params):
            raise ValueError("MasterWeights: a parameter is listed twice")
        if not params:
            raise ValueError("MasterWeights: no parameters")
        device = params[0].device
        self.params = params
        self.dtype = torch.bfloat16  # the working weights': the kernels read and write bf16
        self.block = BLOCK  # the kernels' block for these buffers (BLOCK when they were laid out)
        self.numels = [p.numel() for p in params]
        self.starts = []
        total = 0
        for n in self.numels:
            self.starts.append(total)
            total += -(-n // self.block) * self.block
        self.master = torch.zeros(total, device=device, dtype=torch.float32)
        self.flat = torch.zeros(total, device=device, dtype=self.dtype)
        self._index = {}
        with torch.no_grad():
            for i, p in enumerate(params):
                if p.device != device:
                    raise ValueError(f"MasterWeights: parameters on {device} and {p.device}")
                self.view(self.master, i).copy_(p.detach())
                p.data = self.view(self.flat, i).copy_(p.detach())
                self._index[id(p)] = i
        self.device = device
        # Per tensor, on the device: first element in the flat buffers, element count.
        self.starts_t = torch.tensor(self.starts, device=device, dtype=torch.int64)
        self.numels_t = torch.tensor(self.numels, device=device, dtype=torch.int64)

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Tensor ``i``'s slice of a flat buffer laid out like the masters, shaped like it."""
        start = self.starts[i]
        return flat[start : start + self.numels[i]].view(self.params[i].shape)

    def index(self, p: torch.Tensor) -> int:
        return self._index[id(p)]

    def master_of(self, p: torch.Tensor) -> torch.Tensor:
        return self.view(self.master, self.index(p))

    def blocks(self, indices: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The block table of tensors ``indices``: each block's tensor index (int32) and its
        first element within that tensor (int64), on the device."""
        tensor: list[int] = []
        first: list[int] = []
        for i in indices:
            n = -(-self.numels[i] // self.block)
            tensor += [i] * n
            first += range(0, n * self.block, self.block)
        return (
            torch.tensor(tensor, dtype=torch.int32).to(self.device),
            torch.tensor(first, dtype=torch.int64).to(self.device),
        )


def substitute_masters(state_dict: dict[str, Any], masters: MasterWeights | None) -> dict[str, Any]:
    """``state_dict`` (a model's, its tensors sharing the parameters' storage) with each bf16
    parameter replaced by its fp32 master: what a checkpoint saves, and the tensors a load fills."""
    if masters is None:
        return state_dict
    by_ptr = {p.data_ptr(): masters.view(masters.master, i) for i, p in enumerate(masters.params)}
    return {
        k: by_ptr.get(v.data_ptr(), v) if isinstance(v, torch.Tensor) else v
        for k, v in state_dict.items()
    }


@functools.cache
def torch_adamw_settings() -> dict[str, Any]:
    """The group settings of torch's AdamW (amsgrad, fused, ...) at their defaults: MasterAdamW's
    groups carry them too, so that a checkpoint loads into either optimizer (DCP asks for every
    key of the groups it fills)."""
    return {
        k: v
        for k, v in torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults.items()
        if k not in ("lr", "betas", "eps", "weight_decay")
    }


class MasterAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW``'s arithmetic in fp32 on bf16 parameters whose fp32 masters
    ``masters`` holds; ``clip_grad_norm_`` before ``step`` folds the clipping into the update.
    Its state_dict is torch AdamW's format; one step count serves every parameter."""

    def __init__(
        self,
        params: Any,
        masters: MasterWeights,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        defaults = dict(
            torch_adamw_settings(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
        )
        super().__init__(params, defaults)
        self.masters = masters
        self.exp_avg = torch.zeros_like(masters.master)
        self.exp_avg_sq = torch.zeros_like(masters.master)
        self._step = torch.zeros((), dtype=torch.float32)  # shared by every parameter's state
        self._coef: torch.Tensor | None = None
        self._tables: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._grad_tables: dict[tuple[int, ...], torch.Tensor] = {}
        self._group_indices = [
            tuple(masters.index(p) for p in g["params"]) for g in self.param_groups
        ]
        for group in self.param_groups:
            for p in group["params"]:
                i = masters.index(p)
                self.state[p] = {
                    "step": self._step,
                    "exp_avg": masters.view(self.exp_avg, i),
                    "exp_avg_sq": masters.view(self.exp_avg_sq, i),
                }
        self.kernels = triton is not None and masters.device.type == "cuda"

    # -- state ---------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Hyperparameters from ``state_dict``'s groups; moments and step copied into this
        optimizer's buffers (torch's own load would replace them with new tensors)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state has {len(groups)} parameter groups, this one {len(self.param_groups)}"
            )
        ids = [i for g in groups for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        if len(ids) != len(params):
            raise ValueError(f"optimizer state has {len(ids)} parameters, this one {len(params)}")
        by_id = dict(zip(ids, params, strict=True))
        with torch.no_grad():
            for i, saved in state_dict["state"].items():
                mine = self.state[by_id[i]]
                for key in ("exp_avg", "exp_avg_sq"):
                    mine[key].copy_(saved[key])
                self._step.fill_(float(saved["step"]))
        for mine, saved in zip(self.param_groups, groups, strict=True):
            mine.update({k: v for k, v in saved.items() if k != "params"})

    # -- clipping ------------------------------------------------------------------------

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The gradients' global 2-norm (a 0-d tensor, no host sync); the next ``step``
        multiplies them by ``max_norm / (norm + 1e-6)`` clamped to 1, torch's clipping rule."""
        if self.kernels:
            grads, present = self._gradients()
            indices = tuple(i for group in present for i in group)
            if not indices:
                return torch.zeros((), device=self.masters.device)
            norm, self._coef = _launch_norm(
                self.masters, self._blocks(indices), grads, float(max_norm)
            )
            return norm
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return torch.zeros((), device=self.masters.device)
        norm = torch.nn.utils.get_total_norm([p.grad.float() for p in params])  # fp32, not bf16
        self._coef = parallel.clip_coefficient(norm, max_norm)
        return norm

    # -- the update ----------------------------------------------------------------------

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if closure is not None:
            raise ValueError("MasterAdamW.step takes no closure")
        self._step += 1
        step = int(self._step.item())
        coef, self._coef = self._coef, None
        grads, present = (
            self._gradients() if self.kernels else (None, [()] * len(self.param_groups))
        )
        for group, indices in zip(self.param_groups, present, strict=True):
            beta1, beta2 = group["betas"]
            hyper = dict(
                lr=float(group["lr"]),
                weight_decay=float(group["weight_decay"]),
                beta1=beta1,
                beta2=beta2,
                eps=float(group["eps"]),
                step_size=float(group["lr"]) / (1 - beta1**step),
                sqrt_bias_correction2=math.sqrt(1 - beta2**step),
            )
            if self.kernels:
                if indices:
                    assert grads is not None
                    _launch_adamw(self, self._blocks(indices), grads, coef, hyper)
                continue
            for p in group["params"]:
                if p.grad is not None:
                    self._reference_update(p, coef, hyper)
        return None

    def _reference_update(
        self, p: torch.Tensor, coef: torch.Tensor | None, hyper: dict[str, float]
    ) -> None:
        """``torch.optim.AdamW``'s update of one parameter, on its master, in fp32; ``hyper``:
        the kernel's scalars by name, as ``step`` makes them."""
        assert p.grad is not None
        g = p.grad.float()
        if coef is not None:
            g = g * coef
        state, master = self.state[p], self.masters.master_of(p)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        master.mul_(1 - hyper["lr"] * hyper["weight_decay"])
        m.lerp_(g, 1 - hyper["beta1"])
        v.mul_(hyper["beta2"]).addcmul_(g, g, value=1 - hyper["beta2"])
        denom = (v.sqrt() / hyper["sqrt_bias_correction2"]).add_(hyper["eps"])
        master.addcdiv_(m, denom, value=-hyper["step_size"])
        p.copy_(master)

    # -- tables for the kernels ------------------------------------------------------------

    def _gradients(self) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
        """The gradients' device addresses by tensor index, and per group the indices of the
        tensors with a gradient; a table is uploaded again only when its addresses change."""
        ptrs = [0] * len(self.masters.params)
        present = []
        for group, indices in zip(self.param_groups, self._group_indices, strict=True):
            have = []
            for p, i in zip(group["params"], indices, strict=True):
                if p.grad is not None:
                    ptrs[i] = p.grad.data_ptr()
                    have.append(i)
            present.append(tuple(have))
        key = tuple(ptrs)
        table = self._grad_tables.get(key)
        if table is None:
            for group in self.param_groups:
                for p in group["params"]:
                    g = p.grad
                    if g is not None and (
                        g.dtype != self.masters.dtype
                        or not g.is_contiguous()
                        or g.device != self.masters.device
                    ):
                        raise RuntimeError(
                            f"MasterAdamW: a gradient is {g.dtype}, contiguous={g.is_contiguous()}, on {g.device}; "
                            f"the fused update reads contiguous {self.masters.dtype} gradients on {self.masters.device}"
                        )
            host = torch.tensor(ptrs, dtype=torch.int64)
            cuda = self.masters.device.type == "cuda"
            table = (host.pin_memory() if cuda else host).to(self.masters.device, non_blocking=cuda)
            if len(self._grad_tables) >= 4:  # addresses that moved for good
                self._grad_tables.clear()
            self._grad_tables[key] = table
        return table, present

    def _blocks(self, indices: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The block table of these tensors (cached: the set rarely changes)."""
        if indices not in self._tables:
            self._tables[indices] = self.masters.blocks(indices)
        return self._tables[indices]


def _launch_norm(
    masters: MasterWeights,
    table: tuple[torch.Tensor, torch.Tensor],
    grads: torch.Tensor,
    max_norm: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    block_tensor, block_first = table
    partial = torch.empty(block_tensor.numel(), device=masters.device, dtype=torch.float32)
    _sumsq_kernel[(block_tensor.numel(),)](
        grads,
        block_tensor,
        block_first,
        masters.numels_t,
        partial,
        BLOCK=masters.block,
        num_warps=NUM_WARPS,
    )
    out = torch.empty(2, device=masters.device, dtype=torch.float32)
    _norm_kernel[(1,)](partial, partial.numel(), out, max_norm, BLOCK=4096, num_warps=8)
    return out[0], out[1]


def _launch_adamw(
    opt: MasterAdamW,
    table: tuple[torch.Tensor, torch.Tensor],
    grads: torch.Tensor,
    coef: torch.Tensor | None,
    hyper: dict[str, float],
) -> None:
    """The kernel's update of these blocks; ``hyper``: its scalars by name, as ``step`` makes them."""
    masters = opt.masters
    block_tensor, block_first = table
    _adamw_kernel[(block_tensor.numel(),)](
        grads,
        block_tensor,
        block_first,
        masters.numels_t,
        masters.starts_t,
        masters.master,
        opt.exp_avg,
        opt.exp_avg_sq,
        masters.flat,
        grads if coef is None else coef,
        **hyper,
        HAS_COEF=coef is not None,
        BLOCK=masters.block,
        num_warps=NUM_WARPS,
    )


if triton is not None:

    @triton.jit
    def _grad_block(GRADS, BLOCK_TENSOR, BLOCK_FIRST, NUMELS, BLOCK: tl.constexpr):
        """This program's block of one gradient: tensor index, offsets within it, mask, values (fp32)."""
        b = tl.program_id(0)
        t = tl.load(BLOCK_TENSOR + b)
        local = tl.load(BLOCK_FIRST + b) + tl.arange(0, BLOCK)
        mask = local < tl.load(NUMELS + t)
        g_ptr = tl.load(GRADS + t).to(tl.pointer_type(tl.bfloat16))
        g = tl.load(g_ptr + local, mask=mask, other=0.0).to(tl.float32)
        return t, local, mask, g

    @triton.jit
    def _sumsq_kernel(GRADS, BLOCK_TENSOR, BLOCK_FIRST, NUMELS, PARTIAL, BLOCK: tl.constexpr):
        _, _, _, g = _grad_block(GRADS, BLOCK_TENSOR, BLOCK_FIRST, NUMELS, BLOCK)
        tl.store(PARTIAL + tl.program_id(0), tl.sum(g * g, axis=0))

    @triton.jit
    def _norm_kernel(PARTIAL, N, OUT, max_norm, BLOCK: tl.constexpr):
        """OUT[0] = sqrt(sum(PARTIAL)), OUT[1] = the clipping coefficient (torch's rule)."""
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, N, BLOCK):
            i = start + tl.arange(0, BLOCK)
            acc += tl.load(PARTIAL + i, mask=i < N, other=0.0)
        norm = tl.sqrt_rn(tl.sum(acc, axis=0))
        tl.store(OUT, norm)
        tl.store(OUT + 1, tl.minimum(max_norm / (norm + 1e-6), 1.0))

    @triton.jit
    def _adamw_kernel(
        GRADS,
        BLOCK_TENSOR,
        BLOCK_FIRST,
        NUMELS,
        STARTS,
        MASTER,
        EXP_AVG,
        EXP_AVG_SQ,
        WEIGHT,
        COEF,
        lr,
        weight_decay,
        beta1,
        beta2,
        eps,
        step_size,
        sqrt_bias_correction2,
        HAS_COEF: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """torch's AdamW on one block: fp32 master, moments and arithmetic; the bf16 weight written."""
        t, local, mask, g = _grad_block(GRADS, BLOCK_TENSOR, BLOCK_FIRST, NUMELS, BLOCK)
        if HAS_COEF:
            g = g * tl.load(COEF)
        flat = tl.load(STARTS + t) + local
        p = tl.load(MASTER + flat, mask=mask)
        m = tl.load(EXP_AVG + flat, mask=mask)
        v = tl.load(EXP_AVG_SQ + flat, mask=mask)
        p = p * (1.0 - lr * weight_decay)
        m = m + (1.0 - beta1) * (g - m)
        v = beta2 * v + (1.0 - beta2) * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), sqrt_bias_correction2) + eps
        p = p - step_size * tl.div_rn(m, denom)
        tl.store(MASTER + flat, p, mask=mask)
        tl.store(EXP_AVG + flat, m, mask=mask)
        tl.store(EXP_AVG_SQ + flat, v, mask=mask)
        tl.store(WEIGHT + flat, p.to(WEIGHT.dtype.element_ty), mask=mask)
