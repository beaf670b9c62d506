"""The process group's backend for a job (pure: NCCL itself needs GPUs)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fixtures.tiny_job import tiny_job
from packaging.requirements import Requirement
from packaging.version import Version

from launcher.spec.job import JobSpec
from launcher.train import loop, parallel
from launcher.train.parallel import process_group_backend

REPO = Path(__file__).resolve().parents[2]


def job(strategy: str = "ddp", offload: bool = False, **sections) -> JobSpec:
    """A tiny job on CUDA, under ``strategy``; ``sections`` replace the job's own."""
    parallel = {"strategy": strategy, "fsdp": {"cpu_offload": offload}}
    spec = {**tiny_job(), "parallel": parallel, "resources": {"device": "cuda"}}
    return JobSpec.model_validate({**spec, **sections})


@pytest.mark.parametrize(
    ("strategy", "offload", "sections", "backend"),
    [
        ("ddp", False, {}, "nccl"),
        ("fsdp", False, {}, "nccl"),
        # the offloaded gradient shards are CPU tensors: their norm's and the fp16 scaler's
        # all-reduces need gloo beside NCCL
        ("fsdp", True, {}, "cuda:nccl,cpu:gloo"),
        ("fsdp", True, {"precision": {"dtype": "fp16"}}, "cuda:nccl,cpu:gloo"),
        ("fsdp", True, {"nccl": {"backend": "nccl"}}, "cuda:nccl,cpu:gloo"),
        ("fsdp", True, {"nccl": {"backend": "gloo"}}, "gloo"),  # gloo runs CPU tensors already
        ("ddp", True, {}, "nccl"),  # read with fsdp only
        ("ddp", False, {"resources": {"device": "cpu"}}, "gloo"),
    ],
)
def test_process_group_backend_adds_gloo_for_cpu_offloaded_shards(
    strategy, offload, sections, backend
):
    assert process_group_backend(job(strategy, offload, **sections)) == backend


def test_the_trainer_joins_the_group_with_that_backend(one_process_trainer_env, monkeypatch):
    """``Trainer.init_distributed`` takes the backend from ``process_group_backend`` (a
    mixed string here, which gloo-only CPU torch can run)."""
    asked = []

    def backend(spec: JobSpec) -> str:
        asked.append(spec)
        return "cpu:gloo"

    monkeypatch.setattr(parallel, "process_group_backend", backend)
    cpu = JobSpec.model_validate(tiny_job())
    with loop.Trainer(cpu):
        assert asked == [cpu] and dist.get_backend() == "cpu:gloo"


# What the trainer calls that an older torch lacks: (module, name, the torch release that made
# it public). A new API with a newer release goes here, with pyproject's torch floor raised.
TRAINER_TORCH_APIS = [
    ("torch.nn.utils", "get_total_norm", (2, 6)),  # optim: the gradient norm
    # FSDP2; torch.distributed._composable.fsdp before
    ("torch.distributed.fsdp", "fully_shard", (2, 6)),
    ("torch.distributed.fsdp", "MixedPrecisionPolicy", (2, 6)),
    ("torch.distributed.fsdp", "CPUOffloadPolicy", (2, 6)),
]


def _declared_torch_specifier():
    """The version specifier of the one ``torch`` requirement in pyproject's dependencies."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    requirements = map(Requirement, pyproject["project"]["dependencies"])
    torch_reqs = [r for r in requirements if r.name == "torch"]
    assert len(torch_reqs) == 1, (
        f"pyproject should declare torch once in [project] dependencies: {torch_reqs}"
    )
    return torch_reqs[0].specifier


def test_the_declared_torch_floor_is_the_oldest_torch_with_the_apis_the_trainer_uses():
    """pyproject's torch requirement admits the release that made public everything in
    TRAINER_TORCH_APIS and refuses every torch before it: its one lower bound is that release."""
    spec = _declared_torch_specifier()
    major, minor = max(release for _, _, release in TRAINER_TORCH_APIS)
    needed = Version(f"{major}.{minor}")
    lower = [s for s in spec if s.operator in (">=", ">", "==", "~=", "===")]
    assert [(s.operator, Version(s.version)) for s in lower] == [(">=", needed)], (
        f"pyproject's torch{spec} should have the one lower bound >={needed}"
    )
    assert spec.contains(f"{needed}.0") and spec.contains(f"{major}.{minor}.1")
    assert not spec.contains(f"{major}.{minor - 1}.99")


def test_the_trainer_uses_the_apis_the_torch_floor_is_for():
    """TRAINER_TORCH_APIS is no stale list: the trainer calls each of them, and the installed
    torch (which the declared requirement admits) has them."""
    source = "\n".join(p.read_text() for p in (REPO / "launcher" / "train").glob("*.py"))
    for module, name, _ in TRAINER_TORCH_APIS:
        assert name in source, (
            f"the trainer no longer uses {module}.{name}: update TRAINER_TORCH_APIS and the floor"
        )
        assert hasattr(importlib.import_module(module), name)
    assert _declared_torch_specifier().contains(Version(torch.__version__).base_version)
