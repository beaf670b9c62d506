"""launcher/train/wgrad.py on a GPU: cuBLAS's pointer-array batched product against each
layer's torch.mm, under a CUDA graph, and the pass in a compiled GPT's backward.

    python -m pytest -m gpu tests/integration/test_gpu_wgrad.py
"""

import copy

import pytest
import torch

from launcher.spec.job import ModelSpec
from launcher.train import wgrad
from launcher.train.model import build_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# GPT-2 124M's four block linears (dY columns, X columns) at 4096 tokens, 3 layers
SHAPES = [(2304, 768), (768, 768), (3072, 768), (768, 3072)]


def tensors(n: int, k: int, *, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dys = [torch.randn(4096, n, device="cuda", dtype=dtype, generator=g) for _ in range(3)]
    xs = [torch.randn(4096, k, device="cuda", dtype=dtype, generator=g) for _ in range(3)]
    return dys, xs


def assert_products(out, dys, xs):
    for i, (dy, x) in enumerate(zip(dys, xs, strict=True)):
        ref = dy.t().float() @ x.float()
        # bf16 outputs of fp32 sums: within a rounding step of the exact product's bf16
        torch.testing.assert_close(out[i].float(), ref, rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cublas_batched_matches_each_product(n, k, dtype):
    dys, xs = tensors(n, k, dtype=dtype)
    out = torch.empty(3, n, k, device="cuda", dtype=dtype)
    assert wgrad._cublas_batched(dys, xs, out)
    assert_products(out, dys, xs)
    assert torch.equal(torch.ops.launcher.batched_wgrad(dys, xs), out)


def test_tensors_cublas_cannot_take_go_one_by_one():
    dys, xs = tensors(768, 768)
    odd = [torch.empty(4096, 769, device="cuda", dtype=torch.bfloat16)[:, 1:].copy_(x) for x in xs]
    out = torch.empty(3, 768, 768, device="cuda", dtype=torch.bfloat16)
    assert not wgrad._cublas_batched(dys, odd, out)  # every row 2 bytes off alignment
    # another dtype than the output's
    assert not wgrad._cublas_batched(dys, [x.float() for x in xs], out)
    assert_products(torch.ops.launcher.batched_wgrad(dys, odd), dys, xs)


def test_a_captured_call_replays_on_the_tensors_new_values():
    dys, xs = tensors(768, 3072)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.launcher.batched_wgrad(dys, xs)  # warm cuBLAS up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.launcher.batched_wgrad(dys, xs)
    new_dys, new_xs = tensors(768, 3072, seed=5)
    for t, v in zip([*dys, *xs], [*new_dys, *new_xs], strict=True):
        t.copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    assert_products(out, new_dys, new_xs)


def test_the_compiled_backward_batches_and_its_gradients_agree():
    torch.manual_seed(0)
    model = build_model(
        ModelSpec(arch="gpt", size="mini", bias=False, vocab_size=512, max_positions=128)
    )
    model = model.to("cuda", torch.bfloat16)
    reference = copy.deepcopy(model)
    batching = wgrad.WeightGradBatching()
    model.compile(options={"post_grad_custom_post_pass": batching})
    reference.compile()
    g = torch.Generator(device="cuda").manual_seed(1)
    ids, labels = (torch.randint(0, 512, (8, 128), device="cuda", generator=g) for _ in range(2))
    # a cached graph would skip the pass
    with torch._inductor.config.patch(force_disable_caches=True):
        for m in (model, reference):
            m(ids, labels).backward()
    assert batching.groups == 4
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad.float(), q.grad.float(), rtol=2**-6, atol=1e-4, msg=name)
