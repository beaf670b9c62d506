"""Model shapes, parameter counts and the FLOPs formula (pure, on the meta device or tiny)."""

from __future__ import annotations

import sys

import pytest
import torch
from fixtures.tiny_job import tiny_job

from launcher.errors import SpecError
from launcher.spec.job import SIZE_PRESETS, JobSpec, ModelSpec
from launcher.train import parallel
from launcher.train.model import (
    build_model,
    count_params,
    describe,
    flops_per_token,
    mask_count,
    matmul_params_per_token,
)
from launcher.train.parallel import apply_compile, apply_float8

HF_BERT_BASE_MLM = 109_514_298  # BertForMaskedLM, bert-base-uncased config, tied decoder, no pooler


def meta_params(spec: ModelSpec) -> int:
    with torch.device("meta"):
        return count_params(build_model(spec))


def expected_params(arch: str, L: int, d: int, V: int, P: int, ff: int) -> int:
    block = (3 * d * d + 3 * d) + (d * d + d) + (d * ff + ff) + (ff * d + d) + 2 * (2 * d)
    if arch == "bert":  # word, position, token type, embedding LN; head dense + LN + decoder bias
        return V * d + P * d + 2 * d + 2 * d + L * block + (d * d + d) + 2 * d + V
    return V * d + P * d + L * block + 2 * d  # tied LM head, final LN


# GPT-2 124M with its vocabulary padded to 50304
@pytest.mark.parametrize(("arch", "want"), [("bert", HF_BERT_BASE_MLM), ("gpt", 124_475_904)])
def test_base_presets_match_hugging_face(arch: str, want: int):
    assert meta_params(ModelSpec(arch=arch, size="base")) == want


@pytest.mark.parametrize("arch", ["bert", "gpt"])
@pytest.mark.parametrize("size", list(SIZE_PRESETS))
def test_presets_match_the_formula(arch: str, size: str):
    spec = ModelSpec(arch=arch, size=size)
    d = spec.dims()
    want = expected_params(
        arch, d["n_layers"], d["d_model"], d["vocab_size"], d["max_positions"], d["d_ff"]
    )
    assert meta_params(spec) == want


def test_explicit_dims_override_the_preset():
    spec = ModelSpec(
        arch="bert", size="tiny", n_layers=3, d_model=64, n_heads=4, d_ff=100, vocab_size=500
    )
    assert meta_params(spec) == expected_params("bert", 3, 64, 500, 512, 100)


@pytest.mark.parametrize("arch", ["bert", "gpt"])
def test_forward_returns_a_scalar_loss_near_uniform(arch: str):
    torch.manual_seed(0)
    spec = ModelSpec(arch=arch, size="tiny", vocab_size=256)
    model = build_model(spec)
    ids = torch.randint(0, 256, (2, 16))
    if arch == "bert":
        loss = model(
            ids, torch.randint(0, 256, (2, 4)), torch.tensor([[0, 3, 7, 9], [1, 2, 5, 15]])
        )
    else:
        loss = model(ids, torch.randint(0, 256, (2, 16)))
    assert loss.shape == () and abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 1.0
    loss.backward()
    assert model.embed.tok.weight.grad is not None


def test_bert_head_reads_only_the_masked_positions():
    torch.manual_seed(0)
    model = build_model(ModelSpec(arch="bert", size="tiny", vocab_size=128))
    hidden = torch.randn(1, 8, 128, requires_grad=True)
    mask_pos = torch.tensor([[2, 5]])
    loss = model.head(hidden, torch.tensor([[3, 4]]), mask_pos, model.embed.tok.weight)
    loss.backward()
    touched = hidden.grad.abs().sum(-1)[0].nonzero().flatten().tolist()
    assert touched == [2, 5]


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = build_model(ModelSpec(arch="gpt", size="tiny", vocab_size=64)).eval()
    ids = torch.randint(0, 64, (1, 8))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 64
    first = model.blocks[0](model.embed(ids))
    second = model.blocks[0](model.embed(changed))
    assert torch.equal(first[:, :-1], second[:, :-1])
    assert not torch.equal(first[:, -1], second[:, -1])


def test_mask_count_is_fixed_per_sequence():
    assert mask_count(512, 0.15) == 77
    assert mask_count(8, 0.01) == 1


def test_flops_per_token_bert_base_by_hand():
    spec = ModelSpec(arch="bert", size="base")
    body = 12 * (4 * 768**2 + 2 * 768 * 3072)
    head = 77 / 512 * (768**2 + 30522 * 768)
    assert matmul_params_per_token(spec, seq_len=512, mask_prob=0.15) == pytest.approx(body + head)
    assert flops_per_token(spec, seq_len=512, mask_prob=0.15) == pytest.approx(
        6 * (body + head) + 12 * 12 * 768 * 512
    )


def test_flops_per_token_gpt_counts_the_lm_head_and_half_the_attention():
    spec = ModelSpec(arch="gpt", size="base")
    n = 12 * (4 * 768**2 + 2 * 768 * 3072) + 50304 * 768
    assert flops_per_token(spec, seq_len=1024, mask_prob=0.15) == pytest.approx(
        6 * n + 6 * 12 * 768 * 1024
    )


@pytest.mark.parametrize(("arch", "whole"), [("bert", False), ("gpt", True)])
def test_compile_is_per_block_or_the_whole_model_and_dynamos_ddp_optimizer_is_off(
    arch: str, whole: bool
):
    """Dynamo's DDP optimizer would split each compiled block at gradient-bucket boundaries."""
    model = build_model(ModelSpec(arch=arch, size="tiny", vocab_size=256))
    with torch._dynamo.config.patch(optimize_ddp=True):
        apply_compile(model, whole=whole)
        assert torch._dynamo.config.optimize_ddp is False
    assert (model._compiled_call_impl is not None) == whole
    parts = [model.embed, *model.blocks, model.head]
    assert all((m._compiled_call_impl is not None) != whole for m in parts)
    assert "blocks.0.attn.qkv.weight" in dict(model.named_parameters())  # names unchanged


@pytest.mark.parametrize(
    ("scope", "world", "strategy", "whole"),
    [
        ("auto", 1, "ddp", True),
        ("auto", 2, "ddp", False),
        ("auto", 1, "fsdp", True),
        ("block", 1, "ddp", False),
        ("model", 1, "ddp", True),
    ],
)
def test_compile_scope_auto_is_the_whole_model_for_one_process(
    monkeypatch, scope, world, strategy, whole
):
    seen = {}
    monkeypatch.setattr(parallel, "apply_compile", lambda model, **kw: seen.update(kw))
    monkeypatch.setattr(parallel, "apply_ddp", lambda model, job, device: model)
    monkeypatch.setattr(parallel, "apply_fsdp", lambda model, job, device, world_size: model)
    spec = tiny_job(model={"vocab_size": 256}, compile=True, compile_scope=scope)
    job = JobSpec.model_validate({**spec, "parallel": {"strategy": strategy}})
    model = build_model(job.model)
    parallel.parallelize(model, job, device=torch.device("cpu"), world_size=world)
    # CPU: weight gradients never batched
    assert seen == {"cuda_graphs": False, "whole": whole, "batch_weight_grads": False}


def test_fp8_without_fp8_tensor_cores_or_torchao_is_a_spec_error(monkeypatch):
    model = build_model(ModelSpec(arch="gpt", size="tiny", vocab_size=256))
    pattern = r"precision.dtype.*FP8 tensor cores.*the CPU has compute capability none"
    with pytest.raises(SpecError, match=pattern):
        apply_float8(model, recipe="tensorwise", layers="all", device=torch.device("cpu"))
    # An H100 without torchao installed: the error names the package and the way out.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(SpecError, match=r"torchao is not importable.*set precision.dtype: bf16"):
        apply_float8(model, recipe="tensorwise", layers="all", device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(SpecError, match=r"A100-SXM4-80GB has compute capability 8.0"):
        apply_float8(model, recipe="tensorwise", layers="all", device=torch.device("cuda", 0))


@pytest.mark.parametrize("arch", ["bert", "gpt"])
def test_bf16_hidden_states_stay_bf16_and_give_the_fp32_states_loss(arch: str):
    """Embeddings.out_dtype bf16 keeps every block's input and output bf16 under autocast (the
    LayerNorms hand back their input's dtype); fp32 states are what plain autocast gives. The
    two losses agree to bf16 precision."""
    torch.manual_seed(0)
    model = build_model(ModelSpec(arch=arch, size="tiny", vocab_size=256))
    ids = torch.randint(0, 256, (2, 16))
    bert = {"labels": ids[:, :3], "mask_pos": torch.arange(3).expand(2, 3)}
    kwargs = bert if arch == "bert" else {"labels": ids}
    seen: list[torch.dtype] = []
    for block in model.blocks:
        block.register_forward_hook(lambda mod, args, out: seen.extend([args[0].dtype, out.dtype]))
    losses = {}
    for states in (torch.bfloat16, torch.float32):
        seen.clear()
        model.embed.out_dtype = states
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[states] = model(ids, **kwargs).item()
        assert set(seen) == {states}
    assert abs(losses[torch.bfloat16] - losses[torch.float32]) < 0.02 * losses[torch.float32]


def test_the_banner_names_a_preset_or_the_dims_and_a_small_count():
    assert describe(ModelSpec(arch="bert", size="tiny"), 4_400_000) == "bert tiny, 4.4M params"
    custom = ModelSpec(arch="bert", n_layers=2, d_model=64, n_heads=2, vocab_size=1024)
    assert describe(custom, 120_300) == "bert 2x64, 120.3K params"
