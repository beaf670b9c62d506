"""launcher/train/wgrad.py on the CPU: the op's per-layer path, the pointer table, what
cuBLAS is given, and when the trainer asks for it. The pass on a compiled model:
tests/integration/test_wgrad_compiled.py; cuBLAS's path: tests/integration/test_gpu_wgrad.py."""

from __future__ import annotations

import pytest
import torch
from fixtures.tiny_job import tiny_job

from launcher.spec.job import JobSpec
from launcher.train import wgrad
from launcher.train.parallel import batches_weight_grads


def test_the_op_is_each_layers_product():
    g = torch.Generator().manual_seed(2)
    dys = [torch.randn(64, 24, generator=g).bfloat16() for _ in range(3)]
    xs = [torch.randn(64, 16, generator=g).bfloat16() for _ in range(3)]
    out = torch.ops.launcher.batched_wgrad(dys, xs)
    assert out.shape == (3, 24, 16) and out.dtype == torch.bfloat16
    for i in range(3):
        assert torch.equal(out[i], dys[i].t() @ xs[i])


def test_the_pointer_table_holds_the_addresses_exactly():
    pointers = [2**47 - 16, 140_000_000_000_016, 16, 0x7F00_1234_5670]
    assert wgrad._pointer_table(pointers, torch.device("cpu")).tolist() == pointers


def test_cublas_takes_only_aligned_row_major_tensors_of_one_leading_dimension():
    base = torch.empty(4, 64, dtype=torch.bfloat16)
    assert wgrad._row_major([base[:, :32], base[:, 32:]]) == 64
    other = torch.empty(4, 32, dtype=torch.bfloat16)
    assert wgrad._row_major([base[:, :32], other]) is None  # two lds
    assert wgrad._row_major([base.t()]) is None  # column-major
    assert wgrad._row_major([base[:, 1:33]]) is None  # 2 bytes off
    assert wgrad._row_major([other[:1].expand(4, 32)]) is None  # rows overlap
    assert not wgrad._cublas_batched([base[:, :32]], [base[:, :32]], torch.empty(1, 32, 32))  # CPU


def job(**train: object) -> JobSpec:
    return JobSpec.model_validate({**tiny_job(**train), "precision": {"dtype": "bf16"}})


@pytest.mark.parametrize(
    ("spec", "weights", "device", "whole", "expected"),
    [
        ({}, torch.bfloat16, "cuda", True, True),
        ({"weight_grads": "per-layer"}, torch.bfloat16, "cuda", True, False),
        # fp32 weights: each product is cast before it is a gradient
        ({}, torch.float32, "cuda", True, False),
        # per-block graphs: the layers' products never meet
        ({}, torch.bfloat16, "cuda", False, False),
        ({}, torch.bfloat16, "cpu", True, False),
        # would hold every recomputed input
        ({"activation_checkpointing": True}, torch.bfloat16, "cuda", True, False),
    ],
)
def test_when_the_trainer_batches(spec, weights, device, whole, expected):
    model = torch.nn.Linear(4, 4).to(weights)
    on = batches_weight_grads(job(**spec), model, device=torch.device(device), whole=whole)
    assert on is expected
