"""The compile cache's key and its file: written by rank 0 when it compiled something new,
loaded by every rank, a bad file a miss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures.tiny_job import tiny_job

from launcher.spec.job import JobSpec
from launcher.train.compile_cache import (
    CompileCache,
    cache_autograd_functions,
    cache_hits,
    graph_key,
    open_cache,
)
from launcher.train.loss import linear_cross_entropy


def job(**train) -> JobSpec:
    return JobSpec.model_validate(tiny_job(compile=True, **train))


def test_the_key_follows_what_changes_the_graphs_only():
    cpu = torch.device("cpu")
    base = graph_key(job(), device=cpu, world_size=1)
    assert graph_key(job(steps=70, lr=3e-4, seed=9), device=cpu, world_size=1) == base
    assert graph_key(job(), device=cpu, world_size=8) != base  # DDP wraps what compiles
    assert graph_key(job(), device=cpu, world_size=8) == graph_key(job(), device=cpu, world_size=2)
    assert graph_key(job(micro_batch=3), device=cpu, world_size=1) != base
    assert graph_key(job(activation_checkpointing=True), device=cpu, world_size=1) != base


@pytest.mark.processes  # inductor runs the C++ compiler
def test_rank_0_writes_what_it_compiled_and_a_later_run_loads_it(
    tmp_path: Path, monkeypatch, caplog
):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("LAUNCHER_COMPILE_CACHE", str(tmp_path / "shared"))
    torch._dynamo.reset()
    path = open_cache(job(), device=torch.device("cpu"), rank=0, world_size=1).path
    assert path.parent == tmp_path / "shared" and path.name.startswith("gpt-")
    other = CompileCache(path, rank=1)
    other.load()  # nothing there yet: a miss
    assert not other.loaded

    @torch.compile
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * 2 + 1).sum(dim=-1)

    f(torch.randn(4, 8))
    other.save()  # rank 1 never writes
    assert not path.exists()
    first = CompileCache(path, rank=0)
    first.save()
    assert path.is_file() and first.known > 0
    written = path.stat().st_mtime_ns
    first.save()  # nothing new compiled: the file stays as it is
    assert path.stat().st_mtime_ns == written

    later = CompileCache(path, rank=1)
    later.load()
    assert later.loaded and later.known == first.known

    path.write_bytes(b"not artifacts")
    broken = CompileCache(path, rank=0)
    with caplog.at_level("WARNING"):
        broken.load()
    assert not broken.loaded and "compiling afresh" in caplog.text
    torch._dynamo.reset()


@pytest.mark.processes  # inductor runs the C++ compiler
def test_a_graph_holding_the_fused_loss_comes_from_aot_autograds_cache(tmp_path: Path, monkeypatch):
    """The LM-head loss is a custom autograd.Function; its graphs are cached all the same, so a
    warm start skips tracing the forward and backward."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    import torch._functorch.config as config

    monkeypatch.setattr(config, "autograd_cache_allow_custom_autograd_functions", False)
    cache_autograd_functions()
    assert config.autograd_cache_allow_custom_autograd_functions

    def step(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = linear_cross_entropy(x, w, None, labels)
        loss.backward()
        return loss

    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    labels = torch.randint(0, 11, (6,))
    before = cache_hits()["aot_autograd"]
    torch._dynamo.reset()
    first = torch.compile(step)(x, w, labels)
    torch._dynamo.reset()  # as a new process: dynamo traces again, AOTAutograd reads its cache
    again = torch.compile(step)(x, w, labels)
    after = cache_hits()["aot_autograd"]
    torch._dynamo.reset()
    assert after["bypass"] == before["bypass"]
    assert after["miss"] - before["miss"] == 1 and after["hit"] - before["hit"] == 1
    assert torch.equal(first, again)


@pytest.mark.parametrize("flag", [True, False])
def test_the_job_switches_it(flag: bool):
    assert job(compile_cache=flag).train.compile_cache is flag
