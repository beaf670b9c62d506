"""An elastic restart is the same training: the built-in trainer checkpointed by 3 ranks and
resumed by 2 (grad_accum raised so the global batch is equal) ends where an uninterrupted run
ends, DDP and FSDP alike (real gloo processes on the CPU, fp32)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.ranks import run_ranks
from fixtures.tiny_job import tiny_job

from launcher.metrics import read_records
from launcher.spec.job import JobSpec
from launcher.train.checkpoint import ResumeError
from launcher.train.model import build_model

pytestmark = pytest.mark.processes  # starts processes: not in `just test-fast`

STEPS, CUT = 6, 3  # train to step 6; the first attempt stops after its checkpoint at step 3
MICRO, GLOBAL_BATCH = 2, 12  # 3 ranks x 2 micro-batches, 2 x 3, or 1 x 6
LR = 1e-3
RUN_TIMEOUT_S = 120


def job(
    ckpt: Path,
    *,
    world: int,
    strategy: str = "ddp",
    steps: int = STEPS,
    every: int = CUT,
    **train: Any,
) -> dict[str, Any]:
    """A tiny BERT whose global batch is GLOBAL_BATCH at ``world`` ranks; LR warm-up, cosine
    decay, clipping and weight decay on, so the schedule and AdamW's moments must continue."""
    train = {"grad_accum": GLOBAL_BATCH // (MICRO * world), **train}
    spec = tiny_job(
        "bert",
        model={"d_model": 32, "vocab_size": 128, "max_positions": 16},
        steps=steps,
        micro_batch=MICRO,
        lr=LR,
        lr_warmup_steps=2,
        log_every=1,
        checkpoint={"dir": str(ckpt), "every_steps": every},
        **train,
    )
    more = {"parallel": {"strategy": strategy}, "cudnn": {"benchmark": False}}
    return {**spec, **more, "resources": {"device": "cpu"}}  # the world is the ranks'


class Stop(Exception):
    """Ends an attempt right after a step (and its checkpoint), as a lost node would."""


def _worker(
    rank: int, world: int, port: int, spec: dict[str, Any], out: str, stop_at: int | None
) -> None:
    """One rank: train ``spec`` (stopping after step ``stop_at``); rank 0 saves the parameters."""
    # One thread per process (as torchrun sets): the trainer leaves torch's threads alone then.
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LAUNCHER_METRICS_FILE=f"{out}/rank{{rank}}.jsonl",
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    from launcher.train.loop import Trainer

    def on_step(step: int) -> None:
        if step == stop_at:
            raise Stop

    try:
        trainer = Trainer(JobSpec.model_validate(spec))
    except ResumeError as err:  # the trainer closed itself
        Path(out, f"error{rank}.txt").write_text(str(err))
        return
    with trainer:
        with contextlib.suppress(Stop):
            trainer.train(on_step=on_step)
        if stop_at is None:
            state = trainer.full_state_dict()
            if rank == 0:
                torch.save(state, f"{out}/params.pt")


def run(out: Path, world: int, spec: dict[str, Any], *, stop_at: int | None = None) -> Path:
    """``world`` real processes, gloo over a free TCP port on 127.0.0.1."""
    out.mkdir(parents=True)
    run_ranks(_worker, world, spec, str(out), stop_at, timeout=RUN_TIMEOUT_S)
    return out


def meta(out: Path, rank: int = 0) -> dict[str, Any]:
    return next(r for r in read_records(out / f"rank{rank}.jsonl") if r["type"] == "meta")


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(out / "rank0.jsonl") if r["type"] == "step"}


def initial_params() -> dict[str, torch.Tensor]:
    """The weights every run starts from (the trainer seeds torch with train.seed, then builds)."""
    spec = JobSpec.model_validate(job(Path("unused"), world=1))
    torch.manual_seed(spec.train.seed)
    model = build_model(spec.model)
    return {k: v.detach() for k, v in model.state_dict().items()}


def assert_same_training(reference: Path, resumed: Path) -> None:
    """The same parameters, element by element within 1e-5 (world sizes sum gradients in other
    orders, and AdamW's division by a gradient's RMS magnifies rounding near zero), and overall
    within 1e-4 of the distance trained. A restart that repeats or skips samples, or loses the
    AdamW moments or the LR schedule, misses both by orders of magnitude."""
    ref, got = torch.load(reference / "params.pt"), torch.load(resumed / "params.pt")
    init = initial_params()
    assert sorted(ref) == sorted(got) == sorted(init)
    for name in ref:
        torch.testing.assert_close(
            got[name], ref[name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    apart = torch.cat([(got[k] - ref[k]).flatten() for k in ref]).norm()
    trained = torch.cat([(ref[k] - init[k]).flatten() for k in ref]).norm()
    assert apart <= 1e-4 * trained, (apart, trained)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """One process, 6 micro-batches per step, no restart: the reference."""
    base = tmp_path_factory.mktemp("reference")
    return run(base / "run", 1, job(base / "ckpt", world=1))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_three_to_two_ranks_resumes_to_the_uninterrupted_parameters(
    tmp_path: Path, uninterrupted: Path, strategy: str
):
    ckpt = tmp_path / "ckpt"
    run(tmp_path / "attempt0", 3, job(ckpt, world=3, strategy=strategy), stop_at=CUT)
    assert (ckpt / "step_00000003" / "COMPLETE").is_file()
    second = run(tmp_path / "attempt1", 2, job(ckpt, world=2, strategy=strategy))
    assert_same_training(uninterrupted, second)
    record = meta(second)
    assert [record[k] for k in ("world_size", "grad_accum", "global_batch")] == [2, 3, GLOBAL_BATCH]
    assert record["start_step"] == record["resumed_from_step"] == CUT
    assert record["resumed_world_size"] == 3 and record["resumed_global_batch"] == GLOBAL_BATCH
    assert record["start_sample"] == CUT * GLOBAL_BATCH
    assert meta(tmp_path / "attempt0")["resumed_from_step"] is None
    # the loss logged after the restart is the reference's, step for step
    after = losses(second)
    assert sorted(after) == list(range(CUT + 1, STEPS + 1))
    reference = losses(uninterrupted)
    close = all(abs(after[s] - reference[s]) <= 1e-5 * abs(reference[s]) for s in after)
    assert close, (after, reference)


def test_fsdp_two_to_three_ranks_resumes_to_the_uninterrupted_parameters(
    tmp_path: Path, uninterrupted: Path
):
    """The other way round (a spare joins): the 2-rank shards split into 3, some uneven."""
    ckpt = tmp_path / "ckpt"
    run(tmp_path / "attempt0", 2, job(ckpt, world=2, strategy="fsdp"), stop_at=CUT)
    second = run(tmp_path / "attempt1", 3, job(ckpt, world=3, strategy="fsdp"))
    assert_same_training(uninterrupted, second)


def test_a_different_global_batch_is_refused_under_keep_and_taken_under_scale(tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    run(tmp_path / "attempt0", 1, job(ckpt, world=1, steps=2, every=1), stop_at=1)
    grown = {"grad_accum": 12}  # a global batch of 24 instead of 12
    refused = run(tmp_path / "keep", 1, job(ckpt, world=1, steps=2, every=1, **grown))
    message = (refused / "error0.txt").read_text()
    assert "global batch of 12 samples" in message and "train.grad_accum: 6" in message
    assert "train.elastic_batch: scale" in message
    assert not (refused / "rank0.jsonl").exists()  # refused before the first record
    scaled = run(
        tmp_path / "scale", 1, job(ckpt, world=1, steps=2, every=1, elastic_batch="scale", **grown)
    )
    record = meta(scaled)
    assert record["resumed_from_step"] == 1 and record["resumed_global_batch"] == 12
    assert record["global_batch"] == 24 and record["grad_accum"] == 12
    assert record["start_sample"] == 12  # the next sample after the 12 that step 1 used
    assert (ckpt / "step_00000002" / "COMPLETE").is_file()
