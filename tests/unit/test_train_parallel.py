"""The process group's backend for a job (pure: NCCL itself needs GPUs)."""

from __future__ import annotations

import pytest

from launcher.spec.job import JobSpec
from launcher.train.parallel import process_group_backend


def job(**over) -> JobSpec:
    spec = {"name": "pg", "model": {"size": "tiny"}, "data": {"seq_len": 16},
            "train": {"steps": 2, "warmup_steps": 0}, "resources": {"device": "cuda"}}
    for key, value in over.items():
        section, field = key.split("__", 1)
        node = spec.setdefault(section, {})
        *path, leaf = field.split("__")
        for name in path:
            node = node.setdefault(name, {})
        node[leaf] = value
    return JobSpec.model_validate(spec)


@pytest.mark.parametrize(("over", "backend"), [
    ({}, "nccl"),
    ({"parallel__strategy": "fsdp"}, "nccl"),
    # the offloaded gradient shards are CPU tensors: their norm's and the fp16 scaler's
    # all-reduces need gloo beside NCCL
    ({"parallel__strategy": "fsdp", "parallel__fsdp__cpu_offload": True}, "cuda:nccl,cpu:gloo"),
    ({"parallel__strategy": "fsdp", "parallel__fsdp__cpu_offload": True, "precision__dtype": "fp16"},
     "cuda:nccl,cpu:gloo"),
    ({"parallel__strategy": "fsdp", "parallel__fsdp__cpu_offload": True, "nccl__backend": "nccl"},
     "cuda:nccl,cpu:gloo"),
    # gloo runs CPU tensors already
    ({"parallel__strategy": "fsdp", "parallel__fsdp__cpu_offload": True, "nccl__backend": "gloo"}, "gloo"),
    ({"parallel__strategy": "ddp", "parallel__fsdp__cpu_offload": True}, "nccl"),  # read with fsdp only
    ({"resources__device": "cpu"}, "gloo"),
])
def test_process_group_backend_adds_gloo_for_cpu_offloaded_shards(over, backend):
    assert process_group_backend(job(**over)) == backend


def test_the_trainer_joins_the_group_with_that_backend(one_process_trainer_env, monkeypatch):
    """``Trainer.init_distributed`` takes the backend from ``process_group_backend`` (a
    mixed string here, which gloo-only CPU torch can run)."""
    import torch.distributed as dist

    from launcher.train import loop, parallel

    asked = []

    def backend(spec: JobSpec) -> str:
        asked.append(spec)
        return "cpu:gloo"

    monkeypatch.setattr(parallel, "process_group_backend", backend)
    cpu = job(resources__device="cpu", resources__nodes=1, resources__nproc_per_node=1,
              precision__dtype="fp32", train__micro_batch=2)
    trainer = loop.Trainer(cpu)
    try:
        assert asked == [cpu] and dist.get_backend() == "cpu:gloo"
    finally:
        trainer.close()


def test_the_declared_torch_floor_has_the_apis_the_trainer_uses():
    """pyproject's ``torch>=`` is no older than the torch (2.6) that made public what the trainer
    calls: ``torch.nn.utils.get_total_norm`` (the gradient norm) and
    ``torch.distributed.fsdp.fully_shard`` (FSDP2); it said 2.4."""
    import re
    from pathlib import Path

    import torch

    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=(\d+)\.(\d+)', text)
    assert floor is not None
    assert (int(floor[1]), int(floor[2])) >= (2, 6)
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard  # noqa: F401

    assert callable(torch.nn.utils.get_total_norm)
