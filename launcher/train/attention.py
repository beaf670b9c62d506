"""Attention on the packed QKV projection: cuDNN's forward, FlashAttention-4's backward.

Two ``torch.library`` custom ops; on the CPU a plain reference of the same function runs.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from launcher.errors import SpecError
from launcher.spec.job import cudnn_fa4_obstacles, cudnn_fa4_refusal

FA4_MIN_CAPABILITY = (9, 0)  # FA4's backward: Hopper (sm90) and newer
FIELD = "train.attention"


@functools.cache
def fa4_import_error() -> str | None:
    """Why FlashAttention-4's backward cannot be imported here, or None when it can."""
    try:
        from flash_attn.cute.interface import _flash_attn_bwd  # noqa: F401
    except Exception as err:  # noqa: BLE001 (an ImportError, or a broken install's error)
        return f"{type(err).__name__}: {err}"
    return None


def choose(
    requested: str,
    *,
    device: torch.device,
    dtype: torch.dtype | None,
    dropout: float,
    head_dim: int,
) -> str:
    """The attention a job runs: ``auto`` is ``cudnn-fa4`` where it can run (compute capability
    9.0+, half precision, no dropout, FlashAttention-4 importable), else torch's choice;
    ``cudnn-fa4`` asked for where it cannot run is a SpecError."""
    if requested not in ("auto", "cudnn-fa4"):
        return requested
    reasons = []
    if device.type != "cuda":
        reasons.append("it runs on GPUs only")
    elif (cap := torch.cuda.get_device_capability(device)) < FA4_MIN_CAPABILITY:
        reasons.append(
            f"FlashAttention-4 needs compute capability 9.0 or above (Hopper, Blackwell); "
            f"{torch.cuda.get_device_name(device)} has {'.'.join(map(str, cap))}"
        )
    # what the job's cross-checks also refuse (an explicit cudnn-fa4 rarely gets this far)
    reasons += cudnn_fa4_obstacles(
        head_dim=head_dim, half=dtype in (torch.bfloat16, torch.float16), dropout=dropout
    )
    if not reasons and (missing := fa4_import_error()) is not None:
        reasons.append(
            f"flash_attn.cute (the flash-attn-4 package) is not importable "
            f"({missing}); install it on every node: pip install -e '.[fa4]' in the launcher's folder"
        )
    if not reasons:
        return "cudnn-fa4"
    if requested == "auto":
        return "auto"
    raise SpecError(cudnn_fa4_refusal(reasons), field=FIELD)


def packed_attention(qkv: torch.Tensor, causal: bool) -> torch.Tensor:
    """Attention over ``qkv`` (batch, seq, 3, heads, head_dim), scale 1/sqrt(head_dim); returns
    (batch, seq, heads, head_dim). Under ``torch.use_deterministic_algorithms`` (the trainer's
    ``cudnn.deterministic``) FA4's backward sums dq in a fixed order; otherwise by atomic adds,
    whose order varies from run to run."""
    out, _ = torch.ops.launcher.attention_fwd(qkv, causal)
    return out


# -- the forward: cuDNN's fused attention, keeping its log-sum-exp -------------------------------


@torch.library.custom_op("launcher::attention_fwd", mutates_args=())
def _attention_fwd(qkv: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    b, s, _, h, _ = qkv.shape
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (batch, heads, seq, head_dim) views
    if qkv.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False
        )[:2]
    else:
        out, lse = _reference_fwd(q, k, v, causal)
    # torch lays cuDNN's output out as (batch, seq, heads, head_dim): the transpose is free then
    return out.transpose(1, 2).contiguous(), lse.reshape(b, h, s).contiguous()


@_attention_fwd.register_fake
def _(qkv, causal):
    b, s, _, h, d = qkv.shape
    return qkv.new_empty(b, s, h, d), qkv.new_empty(b, h, s, dtype=torch.float32)


# -- the backward: FlashAttention-4's kernels, written into the packed gradient -----------------


@torch.library.custom_op("launcher::attention_bwd", mutates_args=())
def _attention_bwd(
    dout: torch.Tensor,
    qkv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    deterministic: bool,
) -> torch.Tensor:
    dqkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)
    q, k, v = qkv.unbind(2)  # (batch, seq, heads, head_dim) views, FA4's layout
    dq, dk, dv = dqkv.unbind(2)
    if qkv.is_cuda:
        from flash_attn.cute.interface import _flash_attn_bwd

        _flash_attn_bwd(
            q, k, v, out, dout, lse, causal=causal, deterministic=deterministic, dq=dq, dk=dk, dv=dv
        )
    else:
        _reference_bwd(q, k, v, out, dout, lse, causal, dq, dk, dv)
    return dqkv


@_attention_bwd.register_fake
def _(dout, qkv, out, lse, causal, deterministic):
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    qkv, causal = inputs
    out, lse = output
    ctx.save_for_backward(qkv, out, lse)
    ctx.causal = causal
    ctx.deterministic = torch.are_deterministic_algorithms_enabled()


def _backward(ctx, dout, _dlse):
    qkv, out, lse = ctx.saved_tensors
    return torch.ops.launcher.attention_bwd(
        dout.contiguous(), qkv, out, lse, ctx.causal, ctx.deterministic
    ), None


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# -- the CPU reference ---------------------------------------------------------------------------


def _acc(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the reference's accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """Scaled scores in fp32 (fp64 for fp64), (batch, heads, seq_q, seq_k), the causal mask applied."""
    s = (_acc(q) @ _acc(k).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        n_q, n_k = s.shape[-2:]
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _reference_fwd(q, k, v, causal):
    """(batch, heads, seq, head_dim) inputs: the output (input dtype) and log-sum-exp (fp32)."""
    s = _scores(q, k, causal)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ _acc(v)
    return out.to(q.dtype), lse.float()


def _reference_bwd(q, k, v, out, dout, lse, causal, dq, dk, dv):
    """FlashAttention's backward from the saved log-sum-exp, on (batch, seq, heads, head_dim)
    tensors, into ``dq``, ``dk`` and ``dv``: P = exp(S - lse), dV = Pᵀ·dO, dP = dO·Vᵀ,
    dS = P ∘ (dP - rowsum(dO ∘ O)), dQ = dS·K·scale, dK = dSᵀ·Q·scale."""
    q, k, v, out, dout = (_acc(t.transpose(1, 2)) for t in (q, k, v, out, dout))
    scale = 1.0 / math.sqrt(q.shape[-1])
    p = torch.exp(_scores(q, k, causal) - lse.unsqueeze(-1))
    dp = dout @ v.transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    for into, grad in (
        (dv, p.transpose(-1, -2) @ dout),
        (dq, ds @ k * scale),
        (dk, ds.transpose(-1, -2) @ q * scale),
    ):
        into.copy_(grad.transpose(1, 2))


def sdpa_attention(qkv: torch.Tensor, causal: bool, dropout_p: float = 0.0) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on the packed layout, returning (batch, seq, heads,
    head_dim) like ``packed_attention``, through torch's own kernels: the models' path when
    ``packed`` is off, and the tests' reference for the pair."""
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal).transpose(
        1, 2
    )
