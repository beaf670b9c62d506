"""The LM head's matmul and its cross-entropy as one autograd step.

``linear_cross_entropy(x, weight, bias, labels)`` is
``F.cross_entropy(F.linear(x, weight, bias).float(), labels)``: the mean over every row, the
logits in the autocast dtype, the softmax and the loss in fp32. It differs in when the work
happens. Plain autograd reads the logits three times: once in the forward (their log-sum-exp),
twice in the backward (to form ``softmax - onehot`` and write it). Here the forward forms that
gradient right away, in the pass that reads the logits for the loss, and keeps it instead of
the logits; the backward only multiplies by it. The log-sum-exp and the gradient are one
kernel: with ``kernels`` (``train.kernels: auto`` on CUDA) the launcher's Triton kernel
(``launcher.train.fused.softmax_xent_``), which writes the gradient over the logits, 1.07 ms a
step for GPT-2's 16k × 50304 bf16 logits on one H200; else inductor's compiled
``loss_and_dlogits``, 1.73 ms, against 2.1 ms (1.1 forward, 1.0 backward) for plain
autograd's. Splitting the rows into chunks whose logits fit in L2 measured slower (inductor
then splits each chunk's reduction into three kernels).

The loss's own gradient (1/rows, times whatever scales the loss: accumulation, a loss scaler)
is applied to the two products' outputs, (rows × d) and (vocab × d), not to the logits. So the
stored ``softmax - onehot`` never depends on it: in bf16 it is the same tensor autograd would
form, up to that scale. fp16 is not handled here (its small gradients need the loss scale
applied before the cast to fp16): ``linear_cross_entropy`` takes the plain path for it.

A vocabulary that is not a multiple of 64 (BERT's 30522, GPT-2's own 50257) is padded to one
inside the step: the bf16 copy of the weight that the products read gets zero rows, and the
padded columns of the logits are masked out of the softmax, so the loss and every gradient are
those of the unpadded head. Unpadded, the logits' rows (61,044 bytes for 30522 columns) are not
16-byte aligned and cuBLAS falls back to slower kernels without Hopper's TMA loads.

Every label must be a class index (no ``ignore_index``): the trainer's batches have no padding.
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
    # logsumexp, not softmax's spelling (max, exp, sum), which inductor turns into an online
    # softmax: that kernel took 1.81 ms against this one's 1.70 on GPT-2's logits (one H200).
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
