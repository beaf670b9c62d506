"""The LM-head loss kernel (``launcher.train.fused.softmax_xent_``) against PyTorch on a GPU.

    python -m pytest -m gpu tests/integration/test_gpu_loss_kernel.py

Against ``loss_and_dlogits``: the loss to fp32 rounding, the gradient to one bf16 step; both
kernel forms, GPT-2's and BERT's vocabularies, and the head with the kernel against without it,
eager and compiled.
"""

import pytest
import torch
from fixtures.numerics import ulp_bf16

from launcher.train import fused
from launcher.train.loss import linear_cross_entropy, loss_and_dlogits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(
    "rows,cols,classes", [(333, 50304, 50304), (200, 30528, 30522), (64, 1000, 1000)]
)
@pytest.mark.parametrize(
    "config", [None, {"BLOCK": None, "num_warps": 16}], ids=["chunked", "whole-row"]
)
def test_loss_kernel_is_the_reference_rounded_once(rows, cols, classes, config):
    torch.manual_seed(0)
    z = (torch.randn(rows, cols, device="cuda") * 4).to(torch.bfloat16)
    labels = torch.randint(0, classes, (rows,), device="cuda")
    want_loss, want = loss_and_dlogits(z, labels, classes if classes < cols else None)
    got = z.clone()
    loss = fused._launch_xent(got, labels, classes, got, config)
    torch.testing.assert_close(loss.mean(), want_loss, rtol=1e-6, atol=0)
    assert ((got.float() - want.float()).abs() <= ulp_bf16(want.float())).all()
    assert (got != want).float().mean() < 1e-3
    if classes < cols:
        assert (got[:, classes:] == 0).all()  # padding: probability 0, gradient 0
    rows_sum = got.float().sum(1)  # softmax sums to 1, minus the label's 1
    assert rows_sum.abs().max() < 0.05


@pytest.mark.parametrize("compiled", [False, True])
def test_head_with_the_kernel_trains_as_without(compiled):
    torch.manual_seed(0)
    x = torch.randn(4, 256, 64, device="cuda", requires_grad=True)
    w = (torch.randn(30522, 64, device="cuda") * 0.05).requires_grad_()
    b = torch.zeros(30522, device="cuda", requires_grad=True)
    labels = torch.randint(0, 30522, (4, 256), device="cuda")
    results = []
    for kernels in (False, True):
        fn = lambda kernels=kernels: linear_cross_entropy(x, w, b, labels, kernels)  # noqa: E731
        if compiled:
            fn = torch.compile(fn)
        with torch.autocast("cuda", torch.bfloat16):
            loss = fn()
        results.append((loss.detach(), *torch.autograd.grad(loss, (x, w, b))))
    for name, a, want in zip(("loss", "dx", "dw", "db"), results[1], results[0], strict=True):
        torch.testing.assert_close(a, want, rtol=1e-2, atol=1e-5, msg=name)
