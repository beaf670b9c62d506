"""``linear_cross_entropy`` (the LM head's product and loss as one autograd step) equals
``F.cross_entropy(F.linear(...).float(), labels)``: loss and every gradient, eager and compiled,
fp32 and bf16 autocast, with and without a bias, with a vocabulary the step pads and one it
does not (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from launcher.train.loss import linear_cross_entropy, loss_and_dlogits

# rows not a power of two: the 1/rows scale is not exact; 101 is padded
ROWS, D, VOCAB = 48, 16, 101


def inputs(bias: bool, seed: int = 0, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, ROWS // 3, D, generator=g).requires_grad_()
    w = (torch.randn(vocab, D, generator=g) * 0.5).requires_grad_()
    b = torch.randn(vocab, generator=g).requires_grad_() if bias else None
    labels = torch.randint(0, vocab, (3, ROWS // 3), generator=g)
    return x, w, b, labels


def loss_and_grads(fn, x, w, b, labels, dtype):
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = fn(x, w, b, labels) * 3.0  # a scale on the loss, as accumulation or a scaler puts
    loss.backward()
    return [loss.detach()] + [t.grad.clone() for t in (x, w, b) if t is not None]


def reference(x, w, b, labels):
    logits = F.linear(x, w, b)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


@pytest.mark.parametrize("vocab", [VOCAB, 128])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("dtype", "tol"), [(None, 1e-6), (torch.bfloat16, 8e-3)])
def test_loss_and_gradients_match_plain_autograd(bias: bool, dtype, tol: float, vocab: int):
    x, w, b, labels = inputs(bias, vocab=vocab)
    want = loss_and_grads(reference, x, w, b, labels, dtype)
    got = loss_and_grads(linear_cross_entropy, x, w, b, labels, dtype)
    for name, g, r in zip(["loss", "x", "weight", "bias"], got, want, strict=False):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        scale, off = r.abs().max().item(), (g - r).abs().max().item()
        assert off <= tol * max(scale, 1.0), (name, off, scale)


@pytest.mark.processes  # inductor runs g++ and compile workers
def test_the_compiled_head_matches_eager():
    x, w, b, labels = inputs(bias=True, seed=1)
    compiled = torch.compile(linear_cross_entropy)
    want = loss_and_grads(linear_cross_entropy, x, w, b, labels, None)
    got = loss_and_grads(compiled, x, w, b, labels, None)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_dlogits_is_softmax_minus_onehot_rounded_once():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(8, 33, generator=g) * 4).to(torch.bfloat16)
    labels = torch.randint(0, 33, (8,), generator=g)
    loss, dlogits = loss_and_dlogits(logits, labels)
    exact = torch.softmax(logits.float(), -1) - F.one_hot(labels, 33).float()
    assert dlogits.dtype == torch.bfloat16
    torch.testing.assert_close(dlogits.float(), exact, rtol=2**-8, atol=1e-6)  # one bf16 rounding
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), labels), rtol=1e-6, atol=1e-6)


def test_padded_columns_are_no_classes():
    """Columns past ``classes`` (the padding up to a multiple of 64) have probability 0: the
    loss is the unpadded one and their gradient is exactly 0."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 40, generator=g) * 4
    labels = torch.randint(0, 33, (8,), generator=g)
    loss, dlogits = loss_and_dlogits(logits, labels, classes=33)
    want, want_grad = loss_and_dlogits(logits[:, :33], labels)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dlogits[:, :33], want_grad, rtol=1e-6, atol=1e-6)
    assert torch.equal(dlogits[:, 33:], torch.zeros(8, 7))


def test_fp16_takes_the_plain_path():
    """fp16's small gradients need the loss scale before their cast: no fused step there."""
    x, w, b, labels = inputs(bias=False)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = linear_cross_entropy(x, w, b, labels)
    assert loss.grad_fn is not None and "LinearCrossEntropy" not in type(loss.grad_fn).__name__
