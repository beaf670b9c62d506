"""LR schedule and optimizer parameter groups (pure)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from fixtures.tiny_job import tiny_job

from launcher.metrics import read_records
from launcher.spec.job import JobSpec, TrainSpec
from launcher.train import fused, loop
from launcher.train.loop import Trainer, lr_factor, param_groups
from launcher.train.model import MLP


def factors(**kw) -> list[float]:
    spec = TrainSpec(**kw)
    return [lr_factor(i, spec) for i in range(spec.steps)]


def test_linear_warmup_then_cosine_to_the_floor():
    f = factors(
        steps=100, lr_warmup_steps=10, lr_schedule="cosine", min_lr_ratio=0.1, warmup_steps=0
    )
    assert f[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    assert f[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(f[10:]))
    assert f[-1] == pytest.approx(0.1)
    assert f[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 89)))


def test_linear_decay_and_constant():
    lin = factors(steps=11, lr_schedule="linear", min_lr_ratio=0.0, warmup_steps=0)
    assert lin == pytest.approx([1 - i / 10 for i in range(11)]) and lin[0] == 1.0  # no warm-up
    constant = factors(steps=20, lr_warmup_steps=4, lr_schedule="constant", warmup_steps=0)
    assert constant[4:] == [1.0] * 16


def test_no_weight_decay_on_biases_and_norms():
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Embedding(10, 4)
    )
    decay, no_decay = param_groups(model, 0.01)
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert {p.ndim for p in decay["params"]} == {2} and {p.ndim for p in no_decay["params"]} == {1}
    assert len(decay["params"]) == 2 and len(no_decay["params"]) == 3


def test_step_records_carry_the_lr_each_step_used(one_process_trainer_env):
    """``lr`` in a step record is what the optimizer used for that step (read back from it)."""
    job = JobSpec.model_validate(tiny_job(steps=6, lr=1e-3, lr_warmup_steps=3, log_every=1))
    with Trainer(job) as trainer:
        used = {1: trainer.optimizer.param_groups[0]["lr"]}  # after step s, the scheduler set s+1's
        trainer.train(
            on_step=lambda step: used.__setitem__(step + 1, trainer.optimizer.param_groups[0]["lr"])
        )
    records = read_records(one_process_trainer_env.with_name("rank0.jsonl"))
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert [r["lr"] for r in steps] == pytest.approx([used[s] for s in range(1, 7)])
    assert steps[0]["lr"] == pytest.approx(1e-3 / 3) and steps[2]["lr"] == pytest.approx(1e-3)


@pytest.mark.parametrize(
    ("kernels", "supported", "on"),
    [("auto", True, True), ("torch", True, False), ("auto", False, False)],
)
def test_train_kernels_sets_every_mlp(one_process_trainer_env, monkeypatch, kernels, supported, on):
    """``train.kernels`` reaches every block's MLP (``MLP.fused``) where the device supports the
    kernels (``fused.supported``, stood in for: this machine has no GPU); the MLP still computes
    the plain fc, GELU, proj on the CPU, where the kernels do not run."""
    monkeypatch.setattr(fused, "supported", lambda device: supported)
    job = JobSpec.model_validate(tiny_job("bert", steps=1, kernels=kernels))
    with Trainer(job) as trainer:
        mlps = [m for m in trainer.model.modules() if isinstance(m, MLP)]
        assert mlps and {m.fused for m in mlps} == {on}
        x = torch.randn(3, 5, mlps[0].fc.in_features)
        torch.testing.assert_close(
            mlps[0](x), mlps[0].proj(torch.nn.functional.gelu(mlps[0].fc(x))), rtol=0, atol=0
        )


def _accumulated_step(
    in_place: bool, by_backward: bool, monkeypatch
) -> tuple[dict, torch.Tensor | None]:
    """Two optimizer steps of a tiny BERT over 2 micro-batches; the parameters after them and
    the gradient of a trained parameter that no micro-batch uses (stale before each step)."""
    monkeypatch.setattr(loop.parallel, "needs_backward", lambda model, sync: by_backward)
    job = JobSpec.model_validate(tiny_job("bert", grad_accum=2))
    with loop.Trainer(job) as trainer:
        unused = torch.nn.Parameter(torch.zeros(3))
        trainer.trained_params.append(unused)  # not the optimizer's: only its gradient matters
        if in_place:  # what train.cuda_graphs with grad_accum > 1 sets up (graphs need a GPU)
            trainer.grads_in_place = True
            for p in trainer.trained_params:
                p.grad = torch.zeros_like(p)
        for step in (1, 2):
            unused.grad = torch.ones(3)
            trainer.train_step(step)
            if not by_backward:  # stale: what it held before the step is gone
                zeroed = unused.grad is not None and torch.equal(unused.grad, torch.zeros(3))
                assert zeroed if in_place else unused.grad is None
        return {k: v.clone() for k, v in trainer.model.state_dict().items()}, unused.grad


@pytest.mark.parametrize("in_place", [False, True])
def test_foreach_accumulation_sums_what_backward_sums(
    one_process_trainer_env, monkeypatch, in_place
):
    """Gradients taken by ``torch.autograd.grad`` and summed with foreach ops (``Trainer.backward``,
    for micro-batches no DDP or FSDP hook needs) train the model bit for bit as autograd's own
    accumulation does, with the gradients as fresh tensors or kept in their own memory (under
    CUDA graphs); a parameter no micro-batch uses gets no stale gradient."""
    ours, _ = _accumulated_step(in_place, False, monkeypatch)
    theirs, stale = _accumulated_step(in_place, True, monkeypatch)
    # zero_grad, not backward, clears it on autograd's way (it is not the optimizer's here): the check can fail
    assert stale is not None and bool(stale.ne(0).all())
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
