"""``parallel.fsdp.blocks_per_unit``: consecutive blocks share one FSDP unit (one parameter
group: one all-gather, one reduce-scatter), parameter names unchanged (one gloo process)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from fixtures.tiny_job import tiny_job

from launcher.spec.job import JobSpec
from launcher.train.model import build_model
from launcher.train.parallel import apply_fsdp, parallelize, shards_alone
from launcher.util import free_port


def fsdp_job(fsdp: dict, *, size: str = "mini", vocab: int = 512, device: str = "cpu", **train):
    """A BERT on synthetic 16-token samples whose blocks FSDP shards with ``fsdp``."""
    spec = tiny_job("bert", model={"size": size, "vocab_size": vocab}, **train)
    more = {"parallel": {"strategy": "fsdp", "fsdp": fsdp}, "resources": {"device": device}}
    return JobSpec.model_validate({**spec, **more})


@pytest.fixture(scope="module")
def one_process_group():
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MASTER_ADDR", "127.0.0.1")
        env.setenv("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        yield
        dist.destroy_process_group()


@pytest.mark.parametrize(("per_unit", "units"), [(1, 4), (2, 2), (3, 2), (4, 1), (8, 1)])
def test_blocks_are_grouped_into_units(one_process_group, per_unit: int, units: int):
    job = fsdp_job({"blocks_per_unit": per_unit})
    model = build_model(job.model)
    names = [n for n, _ in model.named_parameters()]
    model = apply_fsdp(model, job, device=torch.device("cpu"), world_size=1)
    groups = [b._get_fsdp_state()._fsdp_param_group for b in model.blocks]
    assert len({id(g) for g in groups}) == units
    # every block's parameters are in its unit's group, and no parameter was renamed
    for block, group in zip(model.blocks, groups, strict=True):
        managed = {id(p.sharded_param) for p in group.fsdp_params}
        assert all(id(p) in managed for p in block.parameters())
    assert [n for n, _ in model.named_parameters()] == names


@pytest.mark.parametrize("reshard_after_forward", [False, True])
def test_accumulation_keeps_parameters_gathered_only_when_the_step_does_anyway(
    one_process_group, reshard_after_forward: bool
):
    """With ``reshard_after_forward: false`` a micro-batch that does not sync leaves its blocks
    gathered for the next one (one all-gather per step); the syncing micro-batch reshards.
    With resharding after forward (memory first) every backward reshards, as FSDP does."""
    from torch.distributed.tensor import DTensor

    from launcher.train.data import build_data
    from launcher.train.parallel import gradient_sync

    job = fsdp_job({"reshard_after_forward": reshard_after_forward}, grad_accum=2)
    cpu = torch.device("cpu")
    model = apply_fsdp(build_model(job.model), job, device=cpu, world_size=1)
    data = build_data(job, rank=0, world_size=1, device=cpu)

    def gathered() -> list[bool]:
        return [not isinstance(next(b.parameters()), DTensor) for b in model.blocks]

    assert gathered() == [False] * len(model.blocks)
    for micro in range(2):
        with gradient_sync(model, micro == 1, keep_gathered=not reshard_after_forward):
            model(**data.batch(1, micro)).backward()
        expect = micro == 0 and not reshard_after_forward
        assert gathered() == [expect] * len(model.blocks), micro
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())


def test_fsdp_on_one_process_trains_the_model_unwrapped_unless_it_offloads():
    """One process has nothing to shard: parallelize leaves the model plain, as DDP does."""
    from torch.distributed.fsdp import FSDPModule

    job = fsdp_job({}, size="tiny", vocab=256)
    model = build_model(job.model)
    assert parallelize(model, job, device=torch.device("cpu"), world_size=1) is model
    assert not isinstance(model, FSDPModule) and not shards_alone(job)
    # offloading to the CPU is for GPUs (the spec refuses it on device cpu)
    assert shards_alone(fsdp_job({"cpu_offload": True}, size="tiny", vocab=256, device="cuda"))
