"""The Triton bias + GELU kernels (``launcher.train.fused``) against PyTorch on a GPU.

    python -m pytest -m gpu tests/integration/test_gpu_fused.py

fp32 within fp32 rounding of ``F.gelu(y + b)``; bf16 within one bf16 step of the float64
function of the same inputs. Eager, and inside a compiled MLP block with its gradients.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from fixtures.numerics import rel_err, ulp_bf16

from launcher.train import fused
from launcher.train.model import MLP

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def gelu64(y, b, approximate):
    """GELU in float64, in forms without cancellation in the tails: the truth to round."""
    z = y.double() + (0 if b is None else b.double())
    if approximate == "tanh":
        return z * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (z + 0.044715 * z**3))
    return z * 0.5 * torch.special.erfc(-z / math.sqrt(2))


def run(y, b, approximate, op, g=None):
    """The op's output and the gradients of y and b for the incoming gradient g."""
    y = y.detach().clone().requires_grad_()
    b = None if b is None else b.detach().clone().requires_grad_()
    out = op(y, b, approximate)
    if g is None:
        g = torch.linspace(-2, 2, out.numel(), device=out.device).reshape(out.shape)
    out.backward(g.to(out.dtype))
    return out.detach(), y.grad, None if b is None else b.grad


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_matches_pytorch(approximate, bias):
    torch.manual_seed(0)
    y = torch.randn(1000, 3072 - 64, device="cuda") * 4  # neither dim a multiple of a tile
    b = torch.randn(y.shape[1], device="cuda") if bias else None
    got = run(y, b, approximate, fused.bias_gelu)
    want = run(y, b, approximate, fused._reference)
    for name, a, w in zip(("output", "dy", "db"), got, want, strict=True):
        if w is not None:
            torch.testing.assert_close(
                a, w, rtol=2e-5, atol=1e-4 if name == "db" else 2e-5, msg=name
            )


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bf16_is_the_fp32_function_rounded_once(approximate):
    torch.manual_seed(1)
    y = (torch.randn(4096, 3072, device="cuda") * 3).bfloat16()
    b = torch.randn(3072, device="cuda")  # fp32, as a bias parameter under autocast
    g = torch.randn(y.shape, device="cuda").bfloat16()
    h, dy, db = run(y, b, approximate, fused.bias_gelu, g)
    h_ref, dy_ref, db_ref = run(y.double(), b.double(), approximate, gelu64, g.double())
    assert h.dtype == dy.dtype == torch.bfloat16 and db.dtype == torch.float32
    assert ((h.double() - h_ref).abs() <= ulp_bf16(h_ref) + 1e-30).all()
    assert ((dy.double() - dy_ref).abs() <= ulp_bf16(dy_ref) + 1e-6 * g.double().abs()).all()
    torch.testing.assert_close(db.double(), db_ref, rtol=1e-4, atol=1e-3)  # fp32 sums of fp32 terms


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_mlp_compiled_matches_unfused(approximate):
    torch.manual_seed(2)
    mlp = MLP(768, 3072, approximate=approximate).cuda()
    x = torch.randn(8, 512, 768, device="cuda")

    def outputs(fused_on: bool, compiled: bool):
        mlp.fused = fused_on
        mlp.zero_grad(set_to_none=True)
        fn = torch.compile(mlp, fullgraph=True) if compiled else mlp
        with torch.autocast("cuda", torch.bfloat16):
            out = fn(x)
        out.float().square().mean().backward()
        return [out.detach().float()] + [p.grad.clone() for p in mlp.parameters()]

    want = outputs(False, compiled=False)
    for compiled in (False, True):
        for a, w in zip(outputs(True, compiled), want, strict=True):
            assert rel_err(a, w) < 1e-2
    torch._dynamo.reset()


def test_cpu_tensors_take_the_reference_path():
    y = torch.randn(4, 8)
    assert not fused.available(y)
    torch.testing.assert_close(fused.bias_gelu(y, None), F.gelu(y))
