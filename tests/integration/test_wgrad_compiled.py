"""launcher/train/wgrad.py's pass on a compiled GPT's backward, on the CPU (the op's per-layer
torch.mm leaves the gradients bitwise the same)."""

from __future__ import annotations

import copy

import torch

from launcher.spec.job import ModelSpec
from launcher.train import wgrad
from launcher.train.model import build_model

LAYERS = 2


def tiny_gpt(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(
        ModelSpec(
            arch="gpt", size="tiny", bias=False, n_layers=LAYERS, vocab_size=256, max_positions=32
        )
    )
    return model.to(dtype)


def gradients(
    model: torch.nn.Module, pass_: wgrad.WeightGradBatching | None
) -> dict[str, torch.Tensor]:
    torch._dynamo.reset()
    model.compile(options={"post_grad_custom_post_pass": pass_} if pass_ else None)
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, 256, (2, 32), generator=g) for _ in range(2))
    # compiled afresh: a graph from inductor's cache would skip the pass, and its count
    with torch._inductor.config.patch(force_disable_caches=True):
        model(ids, labels).backward()
    return {name: p.grad.float() for name, p in model.named_parameters()}


def test_the_pass_batches_each_linear_over_the_layers_and_the_gradients_stay():
    model = tiny_gpt(torch.bfloat16)
    reference = gradients(copy.deepcopy(model), None)
    batching = wgrad.WeightGradBatching()
    batched = gradients(model, batching)
    assert batching.groups == 4  # qkv, proj, fc, fc2: one group each, of LAYERS products
    assert reference.keys() == batched.keys()
    for name, grad in reference.items():
        # the op's CPU path is one torch.mm per layer, as the backward's own products
        torch.testing.assert_close(batched[name], grad, rtol=0, atol=0, msg=name)


def test_fp32_products_are_left_alone():
    batching = wgrad.WeightGradBatching()
    gradients(tiny_gpt(torch.float32), batching)
    assert batching.groups == 0
