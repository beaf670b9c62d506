"""bf16 weights with fp32 masters (``launcher.train.optim``) on a GPU.

    python -m pytest -m gpu tests/integration/test_gpu_optim.py

The Triton update against the torch reference and torch's fused AdamW on fp32 weights, with
clipping and two parameter groups; the gradients' table following addresses that change.
"""

import functools

import pytest
import torch
from fixtures.optim_cases import BETAS, LR, bf16_grads, build, fp32_params, groups

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = [(50304, 64), (768,), (3, 1030), (2304, 768), (7,)]
make = functools.partial(build, SHAPES, device="cuda")  # make(kernels=...)
grads = functools.partial(bf16_grads, SHAPES, device="cuda")  # grads(step)


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_kernel_matches_the_reference_and_torch_adamw(clip):
    params, masters, opt = make(kernels=True)
    ref_params, ref_masters, ref_opt = make(kernels=False)
    # the same initial values, trained by torch's fused AdamW
    fp32 = fp32_params(SHAPES, device="cuda")
    torch_opt = torch.optim.AdamW(groups(fp32), lr=LR, betas=BETAS, fused=True)
    for step in range(1, 6):
        for group in (params, ref_params, fp32):
            for p, g in zip(group, grads(step), strict=True):
                p.grad = g.to(p.dtype)
        if clip:
            norm = opt.clip_grad_norm_(clip)
            ref_norm = ref_opt.clip_grad_norm_(clip)
            torch_norm = torch.nn.utils.clip_grad_norm_(fp32, clip)
            torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
            torch.testing.assert_close(norm, torch_norm, rtol=1e-5, atol=0)
        opt.step()
        ref_opt.step()
        torch_opt.step()
        for p, q, r in zip(params, ref_params, fp32, strict=True):
            torch.testing.assert_close(
                masters.master_of(p), ref_masters.master_of(q), rtol=1e-6, atol=1e-7
            )
            torch.testing.assert_close(masters.master_of(p), r.detach(), rtol=1e-5, atol=1e-6)
            assert torch.equal(p.detach(), masters.master_of(p).bfloat16())  # rounded to nearest
            assert p.dtype == torch.bfloat16
    assert opt.state[params[0]]["step"] == 5


def test_gradient_table_follows_new_addresses():
    params, masters, opt = make(kernels=True)
    ref_params, ref_masters, ref_opt = make(kernels=False)
    for step in range(1, 4):
        for group in (params, ref_params):
            for p, g in zip(group, grads(step), strict=True):
                p.grad = g.clone()  # fresh memory each step
        opt.step()
        ref_opt.step()
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(
            masters.master_of(p), ref_masters.master_of(q), rtol=1e-6, atol=1e-7
        )


def test_noncontiguous_gradient_is_refused():
    params, _, opt = make(kernels=True)
    for p, g in zip(params, grads(1), strict=True):
        p.grad = g
    params[3].grad = params[3].grad.t().contiguous().t()
    with pytest.raises(RuntimeError, match="contiguous"):
        opt.step()
