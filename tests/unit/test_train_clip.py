"""The sharded gradient clipping equals torch's ``clip_grad_norm_`` on the unsharded model
(two gloo ranks on the CPU, FSDP2 with uneven shards)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fixtures.ranks import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from launcher.train.parallel import clip_grad_norm_, clip_in_fused_optimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 3 output rows: sharded 2 + 1 over two ranks (uneven); a bias of 5: 3 + 2.
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 5), nn.Linear(5, 1, bias=False))


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
        results = []
        for max_norm in (0.05, 1e6):
            ref, sharded = _model(), _model()
            fully_shard(sharded[2], mesh=init_device_mesh("cpu", (world,)))
            fully_shard(sharded, mesh=init_device_mesh("cpu", (world,)))
            ref(x).square().sum().backward()
            sharded(x).square().sum().backward()
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            got = clip_grad_norm_(sharded.parameters(), max_norm)
            grads = [p.grad.full_tensor() for p in sharded.parameters()]
            results.append((want, got, [p.grad for p in ref.parameters()], grads))
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_sharded_clip_matches_torch_on_the_full_model(tmp_path: Path):
    out = tmp_path / "clip.pt"
    run_ranks(_worker, 2, str(out))
    for want, got, ref_grads, grads in torch.load(out):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        for g_ref, g in zip(ref_grads, grads, strict=True):
            torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-8)


def test_plain_gradients_clip_as_torch_clips_them():
    ref, model = _model(), _model()
    for m in (ref, model):
        m(torch.ones(2, 4)).sum().backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    got = clip_grad_norm_(model.parameters(), 0.1)
    assert torch.equal(got, want)
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def _clipped_adamw_steps(fold: bool | None, max_norm: float = 0.5) -> list[torch.Tensor]:
    """Five fused AdamW steps on a loss large enough to clip; ``fold``: the clipping handed to
    the optimizer as its grad_scale (the trainer's way), False: gradients multiplied in place,
    None: no clipping."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for i in range(5):
        opt.zero_grad()
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
        (model(x).square().sum() * 100).backward()
        if fold:
            clip_in_fused_optimizer(opt, model.parameters(), max_norm)
        elif fold is False:
            clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_clipping_folded_into_fused_adamw_matches_clipping_in_place():
    folded, in_place, unclipped = (_clipped_adamw_steps(f) for f in (True, False, None))
    for a, b in zip(folded, in_place, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # The comparison can fail: these steps do clip.
    assert max((a - b).abs().max().item() for a, b in zip(folded, unclipped, strict=True)) > 1e-4
