"""Training health: grad_norm and eval_loss against a plain PyTorch computation of the same
model and batches, a non-finite step stopping the run (and never reaching a checkpoint), and
``on_nonfinite: skip`` leaving the parameters and AdamW's state as they were."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fixtures.batching import source
from fixtures.tiny_job import tiny_job

from launcher.errors import NonFiniteError
from launcher.metrics import read_records
from launcher.spec.job import JobSpec
from launcher.train.checkpoint import latest_checkpoint, step_dir
from launcher.train.data import val_seed
from launcher.train.health import read_interval, stop_reason
from launcher.train.loop import Trainer, lr_factor, param_groups


def job(arch: str = "gpt", **train) -> JobSpec:
    train = {"steps": 4, "lr": 1e-3, "log_every": 1, **train}
    return JobSpec.model_validate(
        tiny_job(arch, model={"vocab_size": 256, "dropout": 0.0}, **train)
    )


def steps(metrics: Path) -> list[dict]:
    return [r for r in read_records(Path(str(metrics).format(rank=0))) if r["type"] == "step"]


# -- pure logic ----------------------------------------------------------------------------


def test_an_interval_sums_up_finite_steps_and_names_the_first_non_finite_one():
    rows = torch.tensor([[2.0, 1.0], [4.0, 3.0], [math.nan, math.inf], [6.0, math.inf]])
    fields, run = read_interval(rows, first_step=11, has_norm=True, norm_counts=True, run=2)
    assert fields["loss"] == pytest.approx(3.0) and fields["grad_norm"] == pytest.approx(2.0)
    assert fields["grad_norm_max"] == 3.0 and fields["nonfinite_steps"] == 2
    assert fields["first_nonfinite"] == {"step": 13, "loss": "nan", "grad_norm": "inf"}
    assert fields["nonfinite_in_a_row"] == 2 and run == 2  # the run before was broken at 11
    # under a loss scaler an infinite norm is an overflow the scaler skips itself
    fields, run = read_interval(rows, first_step=11, has_norm=True, norm_counts=False, run=0)
    assert fields["nonfinite_steps"] == 1 and fields["loss"] == pytest.approx(4.0) and run == 0
    bad = torch.tensor([[math.inf, 1.0]] * 3)
    fields, run = read_interval(bad, first_step=1, has_norm=False, norm_counts=True, run=2)
    assert fields["loss"] is None and fields["grad_norm"] is None
    assert fields["nonfinite_in_a_row"] == 5 and run == 5


def test_stop_names_the_step_what_and_the_checkpoint_skip_stops_past_its_limit(tmp_path: Path):
    rows = torch.tensor([[1.0, 1.0], [math.nan, math.nan]])
    fields, _ = read_interval(rows, first_step=4, has_norm=True, norm_counts=True, run=0)
    record = {"step": 5, **fields}
    reason = stop_reason(record, mode="stop", max_skips=3, checkpoint=tmp_path / "step_3")
    assert reason is not None and reason.startswith("non-finite at step 5: the loss is nan")
    assert "the gradient norm is nan" in reason and f"{tmp_path / 'step_3'}" in reason
    nothing = stop_reason(record, mode="stop", max_skips=3, checkpoint=None)
    assert nothing is not None and "no checkpoint was saved" in nothing
    assert stop_reason(record, mode="skip", max_skips=1, checkpoint=None) is None
    long = {**record, "nonfinite_in_a_row": 2}
    skipped = stop_reason(long, mode="skip", max_skips=1, checkpoint=None)
    assert skipped is not None and "train.max_nonfinite_skips (1)" in skipped
    fine, _ = read_interval(rows[:1], first_step=5, has_norm=True, norm_counts=True, run=0)
    assert stop_reason({"step": 5, **fine}, mode="stop", max_skips=1, checkpoint=None) is None


# -- the trainer, one process on the CPU -----------------------------------------------------


def reference_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy from the model's logits with torch's own function: GPT every position,
    BERT the masked positions."""
    logits = model.logits(batch["input_ids"])
    if "mask_pos" in batch:
        pos = batch["mask_pos"]
        logits = logits.gather(1, pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_grad_norm_and_eval_loss_match_plain_pytorch(
    arch: str, one_process_trainer_env: Path, monkeypatch
):
    spec = job(arch, steps=2, grad_clip=0.5, eval_every=2, eval_steps=3)
    with Trainer(spec) as trainer:
        plain = copy.deepcopy(trainer.model)  # a world of one: the plain model, before any step
        batch = trainer.data.batch(1, 0)
        trainer.train()
        val = trainer.val_batches
        trained = copy.deepcopy(trainer.model)
    loss = reference_loss(plain, batch)
    loss.backward()
    want_norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad) for p in plain.parameters()])
    )
    first, second = steps(one_process_trainer_env)
    assert first["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert first["grad_norm"] == pytest.approx(want_norm.item(), rel=1e-5)
    assert want_norm.item() > 0.5  # clipped, and the record holds the norm before clipping
    assert first["eval_loss"] is None and second["grad_norm"] > 0
    # the held-out batches: a seed stream of their own, the same samples the trainer read
    ref = source(arch, vocab=256, seq=16, micro=2, seed=val_seed(spec.train.seed))
    held_out = [ref.batch(i + 1) for i in range(3)]
    ref.close()
    assert len(val) == 3
    assert all(torch.equal(a[k], b[k]) for a, b in zip(val, held_out, strict=True) for k in a)
    assert not torch.equal(held_out[0]["input_ids"], batch["input_ids"])
    trained.eval()
    with torch.no_grad():
        want_eval = sum(reference_loss(trained, b) for b in held_out) / 3
    assert second["eval_loss"] == pytest.approx(want_eval.item(), rel=1e-5)
    assert second["eval_s"] is not None and second["eval_s"] >= 0


def poison(monkeypatch, trainer, at: set[int], what: str) -> None:
    """A non-finite loss (``loss``: NaN after the backward, the gradients left finite) or
    gradient norm (``grad``: one parameter's gradient infinite) at the steps ``at``."""
    original = trainer.forward_backward

    def forward_backward(step: int, micro: int) -> torch.Tensor:
        loss = original(step, micro)
        if step in at:
            if what == "loss":
                return loss * math.nan
            trainer.trained_params[0].grad.fill_(math.inf)
        return loss

    monkeypatch.setattr(trainer, "forward_backward", forward_backward)


@pytest.mark.parametrize("fused", [False, True], ids=["host-check", "fused-found-inf"])
@pytest.mark.parametrize("what", ["loss", "grad"])
def test_skip_leaves_parameters_and_adamw_state_and_counts(
    what: str, fused: bool, one_process_trainer_env: Path, monkeypatch
):
    """Both ways a step is skipped: the flag read on the host (the CPU's AdamW), and the
    device-side mask of a fused AdamW (the GPU's; torch's fused AdamW runs on the CPU too)."""
    spec = job(steps=5, on_nonfinite="skip", max_nonfinite_skips=2)
    snapshots: dict[int, dict] = {}

    def on_step(step: int) -> None:
        snapshots[step] = {
            "params": [p.detach().clone() for p in trainer.trained_params],
            "steps": [float(s["step"]) for s in trainer.optimizer.state.values()],
        }

    with Trainer(spec) as trainer:
        if fused:
            groups = param_groups(trainer.model, spec.train.weight_decay)
            trainer.optimizer = torch.optim.AdamW(groups, lr=spec.train.lr, fused=True)
            trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(
                trainer.optimizer, lambda i: lr_factor(i, spec.train)
            )
        poison(monkeypatch, trainer, {3, 4}, what)
        final = trainer.train(on_step=on_step)
    for step in (3, 4):  # skipped: nothing changed
        for a, b in zip(snapshots[2]["params"], snapshots[step]["params"], strict=True):
            assert torch.equal(a, b), step
        n = len(snapshots[2]["steps"])
        assert snapshots[step]["steps"] == snapshots[2]["steps"] == [2.0] * n
    assert not torch.equal(snapshots[5]["params"][0], snapshots[4]["params"][0])
    assert snapshots[5]["steps"][0] == 3.0
    records = steps(one_process_trainer_env)
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1, 0]
    assert records[2]["first_nonfinite"]["step"] == 3 and records[2]["loss"] is None
    assert all(math.isfinite(r["loss"]) for r in records if r["step"] != 3 and r["step"] != 4)
    assert final["skipped_steps"] == 2


def test_too_many_skips_in_a_row_stop(one_process_trainer_env: Path, monkeypatch):
    with Trainer(job(steps=8, on_nonfinite="skip", max_nonfinite_skips=2)) as trainer:
        poison(monkeypatch, trainer, {2, 3, 4, 5}, "loss")
        with pytest.raises(NonFiniteError, match=r"3 steps in a row up to step 4"):
            trainer.train()


def test_a_non_finite_step_stops_before_the_next_checkpoint(
    one_process_trainer_env: Path, monkeypatch, tmp_path: Path
):
    """Records every 10 steps, checkpoints every 2: the checkpoint at step 4 reads the record of
    steps 3 and 4 first, and step 3's NaN stops the run there, naming step 2's checkpoint."""
    ckpt = tmp_path / "ckpt"
    spec = job(steps=8, log_every=10, checkpoint={"dir": str(ckpt), "every_steps": 2})
    with Trainer(spec) as trainer:
        poison(monkeypatch, trainer, {3}, "loss")
        with pytest.raises(NonFiniteError) as err:
            trainer.train()
    message = str(err.value)
    assert message.startswith("non-finite at step 3: the loss is nan (train.on_nonfinite: stop")
    assert latest_checkpoint(ckpt) == step_dir(ckpt, 2) and f"is {step_dir(ckpt, 2)}." in message
    assert [r["step"] for r in steps(one_process_trainer_env)] == [2, 4]
