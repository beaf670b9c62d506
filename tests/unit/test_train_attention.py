"""The packed attention ops (``launcher.train.attention``) on the CPU, where they run their
reference: its packed layouts, autograd registration and fake kernels under ``torch.compile``
against torch's attention; and ``choose``'s rules. The GPU kernels: test_gpu_attention.py.
"""

import pytest
import torch
from pydantic import ValidationError

from launcher.errors import SpecError
from launcher.spec.job import JobSpec
from launcher.train import attention
from launcher.train.model import GPT, BertForMaskedLM


def _qkv(b=2, s=9, h=3, d=8, dtype=torch.float64):
    return torch.randn(b, s, 3, h, d, dtype=dtype, requires_grad=True)


@pytest.mark.parametrize("causal", [True, False])
def test_matches_sdpa_and_its_gradient(causal):
    torch.manual_seed(0)
    qkv = _qkv()
    dout = torch.randn(2, 9, 3, 8, dtype=torch.float64)
    out = attention.packed_attention(qkv, causal)
    assert out.shape == (2, 9, 3, 8) and out.is_contiguous()
    (grad,) = torch.autograd.grad(out, qkv, dout)

    ref_in = qkv.detach().clone().requires_grad_()
    ref = attention.sdpa_attention(ref_in, causal)
    (ref_grad,) = torch.autograd.grad(ref, ref_in, dout)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    # the log-sum-exp is kept in fp32 (what FA4 reads): the backward's P is exact to fp32's rounding
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert grad.shape == qkv.shape and grad.is_contiguous()


def test_log_sum_exp_is_the_scaled_scores():
    """The forward's second output is what FA4's backward reads: logsumexp of q·kᵀ/√d per
    (batch, head, query), causal mask applied."""
    torch.manual_seed(1)
    qkv = _qkv(b=1, s=5, h=2, d=4).detach()
    _, lse = torch.ops.launcher.attention_fwd(qkv, True)
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / 2.0
    scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    assert lse.shape == (1, 2, 5) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).float())


def test_compiled_matches_eager():
    torch.manual_seed(2)
    qkv = _qkv(dtype=torch.float32)
    dout = torch.randn(2, 9, 3, 8)

    def f(x):
        return attention.packed_attention(x * 1.0, True)

    want = torch.autograd.grad(f(qkv), qkv, dout)[0]
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(qkv), qkv, dout)[0]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("model_cls", [GPT, BertForMaskedLM])
def test_models_packed_equal_sdpa(model_cls):
    """A model with ``packed`` attention gives the loss and gradients of its SDPA version."""
    torch.manual_seed(3)
    model = model_cls(
        n_layers=2, d_model=32, n_heads=4, d_ff=64, vocab_size=96, max_positions=16
    ).double()
    ids = torch.randint(0, 96, (2, 16))
    bert = {"mask_pos": torch.tensor([[1, 5], [2, 9]]), "labels": torch.randint(0, 96, (2, 2))}
    kwargs = bert if model_cls is BertForMaskedLM else {"labels": torch.randint(0, 96, (2, 16))}
    grads = []
    for packed in (False, True):
        for m in model.modules():
            if isinstance(m, type(model.blocks[0].attn)):
                m.packed = packed
        model.zero_grad()
        loss = model(ids, **kwargs)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-12, atol=1e-12)
    for a, b in zip(grads[1][1], grads[0][1], strict=True):  # fp32 log-sum-exp, as above
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def _choose(requested, device, dtype=torch.bfloat16, dropout=0.0, head_dim=64):
    return attention.choose(
        requested, device=device, dtype=dtype, dropout=dropout, head_dim=head_dim
    )


def test_choose_on_cpu():
    cpu = torch.device("cpu")
    assert _choose("auto", cpu) == "auto"
    assert _choose("cudnn", cpu, dtype=None) == "cudnn"
    with pytest.raises(SpecError, match="train.attention.*GPUs only.*Set train.attention: auto"):
        _choose("cudnn-fa4", cpu)
    with pytest.raises(SpecError, match="bf16 or fp16.*dropout"):
        _choose("cudnn-fa4", cpu, dtype=None, dropout=0.1)


@pytest.mark.parametrize(
    ("over", "expected"),
    [
        ({"model": {"dropout": 0.1}}, "model.dropout must be 0"),
        ({"precision": {"dtype": "fp32"}}, "bf16 or fp16 inputs"),
        ({"precision": {"dtype": "tf32"}}, "bf16 or fp16 inputs"),
        # 96 fits
        ({"model": {"d_model": 192, "n_heads": 2}}, "head dimension (d_model / n_heads) is 96"),
        ({"model": {"d_model": 200, "n_heads": 2}}, "head dimension (d_model / n_heads) is 100"),
        ({"model": {"d_model": 512, "n_heads": 2}}, "head dimension (d_model / n_heads) is 256"),
    ],
)
def test_the_job_spec_refuses_cudnn_fa4_where_the_job_alone_rules_it_out(over, expected):
    """Dropout, fp32/tf32 and the head dimension are known before any worker starts: an explicit
    cudnn-fa4 is refused there (exit 2) in the words ``choose`` uses; ``auto`` falls back."""
    spec = {
        "name": "fa4",
        "model": {"arch": "gpt", "size": "tiny"},
        "data": {"seq_len": 16},
        "train": {"steps": 2, "warmup_steps": 0, "attention": "cudnn-fa4"},
    }
    for section, values in over.items():
        spec[section] = {**spec.get(section, {}), **values}
    if expected.endswith("96"):  # a multiple of 8 up to 128: accepted
        assert JobSpec.model_validate(spec).train.attention == "cudnn-fa4"
        return
    with pytest.raises(
        ValidationError,
        match=r"cudnn-fa4 \(cuDNN's forward, FlashAttention-4's backward\) "
        r"cannot run this job: .*Set train.attention: auto",
    ) as err:
        JobSpec.model_validate(spec)
    assert expected in str(err.value)
    spec["train"]["attention"] = "auto"
    assert JobSpec.model_validate(spec).train.attention == "auto"


def test_choose_on_gpus(monkeypatch):
    """The rules on GPUs, the device queries replaced (pure logic: no GPU here)."""
    gpu = torch.device("cuda", 0)
    cap = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap["value"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    missing = {"value": None}
    monkeypatch.setattr(attention, "fa4_import_error", lambda: missing["value"])

    assert _choose("auto", gpu) == "cudnn-fa4"
    assert _choose("cudnn-fa4", gpu, dtype=torch.float16) == "cudnn-fa4"
    assert _choose("auto", gpu, dtype=None) == "auto"  # fp32
    assert _choose("auto", gpu, dropout=0.1) == "auto"
    assert _choose("auto", gpu, head_dim=128) == "cudnn-fa4"
    for head_dim in (36, 256):
        assert _choose("auto", gpu, head_dim=head_dim) == "auto"
        with pytest.raises(SpecError, match=f"head dimension .* is {head_dim}"):
            _choose("cudnn-fa4", gpu, head_dim=head_dim)
    missing["value"] = "ModuleNotFoundError: No module named 'flash_attn'"
    assert _choose("auto", gpu) == "auto"
    with pytest.raises(SpecError, match=r"not importable .*flash_attn.*pip install -e '.\[fa4\]'"):
        _choose("cudnn-fa4", gpu)
    missing["value"], cap["value"] = None, (8, 0)
    assert _choose("auto", gpu) == "auto"
    with pytest.raises(SpecError, match="compute capability 9.0.*Some GPU has 8.0"):
        _choose("cudnn-fa4", gpu)
