"""The LM head's matmul and its cross-entropy as one autograd step.

``linear_cross_entropy(x, weight, bias, labels)`` is ``F.cross_entropy(F.linear(x, weight,
bias).float(), labels)``, with the logits' gradient formed in the forward's one pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from launcher.train import fused

VOCAB_MULTIPLE = 64  # the padded vocabulary the products see (see the module docstring)


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    kernels: bool = False,
) -> torch.Tensor:
    """Mean cross-entropy of ``x @ weight.T + bias`` (``x`` (..., d), ``weight`` (V, d))
    against ``labels`` (...), under the ambient autocast. ``kernels``: on CUDA, the loss and
    the logits' gradient come from ``launcher.train.fused.softmax_xent_`` (one Triton kernel
    that overwrites the logits with their gradient) instead of inductor's kernel."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    x, labels = x.reshape(-1, x.shape[-1]), labels.reshape(-1)
    if dtype == torch.float16:
        logits = F.linear(x, weight, bias)
        return F.cross_entropy(logits.float(), labels)
    return _LinearCrossEntropy.apply(x, weight, bias, labels, dtype, kernels and fused.available(x))


def loss_and_dlogits(
    logits: torch.Tensor, labels: torch.Tensor, classes: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean cross-entropy (fp32) and ``softmax(logits) - onehot(labels)`` in the logits'
    dtype, both computed in fp32 (one kernel when compiled). ``classes``: only the first so many
    columns are classes; the rest (padding) get probability 0 and gradient 0."""
    z = logits.float()
    if classes is not None and classes < z.shape[1]:
        column = torch.arange(z.shape[1], device=z.device)
        z = torch.where(column < classes, z, float("-inf"))
    # logsumexp, not softmax's spelling (max, exp, sum), which inductor turns into a slower
    # online softmax.
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    target = z.gather(1, labels.unsqueeze(1))
    loss = (lse - target).mean()
    dlogits = torch.exp(z - lse).to(logits.dtype)
    # The label's entry, p - 1, computed in fp32 and rounded once like the others.
    dlogits.scatter_(1, labels.unsqueeze(1), (torch.exp(target - lse) - 1).to(logits.dtype))
    return loss, dlogits


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, labels, dtype, kernels):
        # Cast as autocast would (its casts are the same no-ops or copies), then run the
        # product without it so that the backward, which runs outside autocast, matches.
        xc, wc = x.to(dtype), weight.to(dtype)
        bc = None if bias is None else bias.to(dtype)
        classes = weight.shape[0]
        pad = -classes % VOCAB_MULTIPLE
        if pad:
            wc = F.pad(wc, (0, 0, 0, pad))
            bc = None if bc is None else F.pad(bc, (0, pad))
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(xc, wc, bc)
            if kernels:
                loss, dlogits = fused.softmax_xent_(logits, labels, classes).mean(), logits
            else:
                loss, dlogits = loss_and_dlogits(logits, labels, classes)
        ctx.save_for_backward(xc, wc, dlogits)
        ctx.classes = classes
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        xc, wc, dlogits = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        classes = ctx.classes
        scale = grad_loss.float() / dlogits.shape[0]
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (dlogits @ wc).float().mul(scale).to(x_dtype)  # padded rows of wc are 0
        if ctx.needs_input_grad[1]:
            dw = (dlogits.t() @ xc)[:classes].float().mul(scale).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            db = dlogits[:, :classes].float().sum(0).mul(scale).to(b_dtype)
        return dx, dw, db, None, None, None
