"""cuDNN's forward with FlashAttention-4's backward (``launcher.train.attention``) on a GPU.

    python -m pytest -m gpu tests/integration/test_gpu_attention.py

Needs compute capability 9.0+ and flash-attn-4. The reference is torch's cuDNN attention: the
forward is the same kernel (bit for bit), the backward agrees to bf16 rounding; then GPT
blocks with the pair, compiled and replayed as CUDA graphs.
"""

import pytest
import torch
import torch.nn.functional as F
from fixtures.numerics import rel_err
from torch.nn.attention import SDPBackend, sdpa_kernel

from launcher.train import attention
from launcher.train.model import GPT, Attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _needs_fa4():
    if torch.cuda.get_device_capability() < attention.FA4_MIN_CAPABILITY:
        pytest.skip(
            f"FlashAttention-4's backward needs compute capability 9.0+, {torch.cuda.get_device_name()} lacks it"
        )
    if attention.fa4_import_error() is not None:
        pytest.skip(f"flash-attn-4 is not installed ({attention.fa4_import_error()})")


def test_cudnn_log_sum_exp_is_the_scaled_scores():
    torch.manual_seed(0)
    qkv = torch.randn(2, 256, 3, 4, 64, device="cuda", dtype=torch.bfloat16)
    for causal in (True, False):
        _, lse = torch.ops.launcher.attention_fwd(qkv, causal)
        q, k, _ = qkv.float().permute(2, 0, 3, 1, 4).unbind(0)
        s = q @ k.transpose(-1, -2) / 8.0
        if causal:  # -inf above the diagonal
            s = s + torch.full((256, 256), float("-inf"), device="cuda").triu(1)
        torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(
    "shape",
    [(4, 1024, 12, 64, True), (8, 512, 12, 64, False), (2, 200, 4, 64, True)],
    ids=["gpt2", "bert", "ragged"],
)
def test_pair_matches_cudnn_both_ways(shape):
    _needs_fa4()
    b, s, h, d, causal = shape
    torch.manual_seed(1)
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    out = attention.packed_attention(qkv, causal)
    (grad,) = torch.autograd.grad(out, qkv, dout)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        ref = attention.sdpa_attention(qkv, causal)
        (ref_grad,) = torch.autograd.grad(ref, qkv, dout)
    assert rel_err(out, ref) < 1e-3  # the same cuDNN kernel (its plan may differ)
    assert grad.is_contiguous() and grad.shape == qkv.shape
    assert torch.isfinite(grad).all()
    for i, name in enumerate("qkv"):  # each of dq, dk, dv to bf16 rounding of cuDNN's
        assert rel_err(grad[:, :, i], ref_grad[:, :, i]) < 1e-2, name
    # and closer to an fp32 reference than bf16's own rounding error
    q32 = qkv.detach().float().requires_grad_()
    (grad32,) = torch.autograd.grad(attention.sdpa_attention(q32, causal), q32, dout.float())
    assert rel_err(grad, grad32) < 1e-2


def test_gpt_blocks_compiled_with_cuda_graphs():
    """A small GPT with the pair, compiled with CUDA graphs (the default GPT job's mode),
    trains like the same model on torch's attention: the same losses to bf16 rounding. It
    learns one fixed batch by heart (random tokens have nothing else to learn)."""
    _needs_fa4()
    losses = {}
    for packed in (False, True):
        torch.manual_seed(2)
        model = GPT(
            n_layers=2, d_model=256, n_heads=4, d_ff=1024, vocab_size=512, max_positions=256
        ).cuda()
        for m in model.modules():
            if isinstance(m, Attention):
                m.packed = packed
        model.compile(mode="reduce-overhead")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
        gen = torch.Generator(device="cuda").manual_seed(3)
        ids = torch.randint(0, 512, (4, 257), device="cuda", generator=gen)
        run = []
        for _ in range(10):
            torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", torch.bfloat16):
                loss = model(ids[:, :-1], ids[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            run.append(float(loss))
        losses[packed] = run
    assert losses[True][-1] < losses[True][0] - 0.5  # it learns the batch
    for a, b in zip(losses[True], losses[False], strict=True):
        assert abs(a - b) < 2e-2 * abs(b), (losses[True], losses[False])


def test_sdpa_reference_still_used_without_packed():
    """``packed`` off: the module is plain scaled_dot_product_attention (torch's choice)."""
    torch.manual_seed(4)
    m = Attention(128, 2, 0.0, causal=True).cuda()
    x = torch.randn(2, 64, 128, device="cuda")
    qkv = m.qkv(x).view(2, 64, 3, 2, 64).permute(2, 0, 3, 1, 4)
    want = m.proj(
        F.scaled_dot_product_attention(*qkv.unbind(0), is_causal=True)
        .transpose(1, 2)
        .reshape(2, 64, 128)
    )
    torch.testing.assert_close(m(x), want)
