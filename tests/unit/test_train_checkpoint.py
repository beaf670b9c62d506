"""Which checkpoint resume picks, and when one is due (pure; DCP itself runs in integration and
in test_train_elastic)."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fixtures.batching import source
from fixtures.ranks import run_ranks
from fixtures.tiny_job import tiny_job

from launcher.metrics import read_records
from launcher.spec.job import CheckpointSpec, JobSpec
from launcher.train.checkpoint import MARKER, Checkpointer, ResumeError, latest_checkpoint, step_dir
from launcher.train.loop import Trainer, param_groups
from launcher.train.optim import MasterAdamW, MasterWeights
from launcher.util import free_port


def checkpointer(
    spec: CheckpointSpec, *, rank: int = 0, world: int = 1, accum: int = 1, elastic_batch="keep"
) -> Checkpointer:
    data = source("gpt", vocab=64, seq=8, micro=2, accum=accum, seed=0, rank=rank, world=world)
    return Checkpointer(spec, rank=rank, data=data, elastic_batch=elastic_batch)


def save_complete(spec: CheckpointSpec, step: int, *state) -> None:
    """Save ``state`` (model, optimizer, scheduler[, scaler]) as step ``step``, to completion."""
    ckpt = checkpointer(spec)
    ckpt.save(step, *state)
    ckpt.wait()  # written in the background (train.checkpoint.async)


def _small_training():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)


def _one_step(model, opt, sched):
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def test_latest_complete_checkpoint_wins(tmp_path: Path):
    assert latest_checkpoint(None) is None and latest_checkpoint(tmp_path / "absent") is None
    for step, complete in [(10, True), (20, True), (30, False), (100, True)]:
        path = step_dir(tmp_path, step)
        path.mkdir()
        if complete:
            (path / MARKER).write_text(f"{step}\n")
    (tmp_path / "step_junk").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000100"
    (tmp_path / "step_00000100" / MARKER).unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000020"


def test_checkpoints_are_due_every_n_steps_and_at_the_end(tmp_path: Path):
    every = checkpointer(CheckpointSpec(dir=tmp_path, every_steps=25))
    assert [s for s in range(1, 61) if every.due(s, 60)] == [25, 50, 60]
    end_only = checkpointer(CheckpointSpec(dir=tmp_path))
    assert [s for s in range(1, 61) if end_only.due(s, 60)] == [60]
    assert not any(checkpointer(CheckpointSpec()).due(s, 60) for s in range(1, 61))


def test_resume_puts_the_data_at_the_next_sample_and_checks_the_global_batch(tmp_path: Path):
    """``train`` as DCP hands it back (the model and optimizer load is integration's)."""
    keep = checkpointer(CheckpointSpec(dir=tmp_path), world=2, accum=3)  # global batch 12
    written = {"step": 5, "samples": 60, "world_size": 3, "global_batch": 12}
    resumed = keep._continue_data(tmp_path, written)
    assert (resumed.step, resumed.samples, resumed.world_size) == (5, 60, 3)
    assert keep.data.first_sample(6) == 60 and keep.data.first_sample(7) == 72
    pattern = r"global batch of 12 samples \(3 ranks\).*train.grad_accum: 6"
    with pytest.raises(ResumeError, match=pattern):
        checkpointer(CheckpointSpec(dir=tmp_path), world=1)._continue_data(tmp_path, written)
    with pytest.raises(ResumeError, match="whose product with the world size equals it"):
        checkpointer(CheckpointSpec(dir=tmp_path), world=5)._continue_data(tmp_path, written)
    scaled = checkpointer(CheckpointSpec(dir=tmp_path), world=2, accum=1, elastic_batch="scale")
    scaled._continue_data(tmp_path, written)  # global batch 4 from here on
    assert scaled.data.first_sample(6) == 60 and scaled.data.first_sample(7) == 64


def test_a_checkpoint_of_bf16_weights_resumes_with_fp32_weights_and_back(tmp_path: Path):
    """DCP in one process: a run with bf16 weights saves its fp32 masters as the model's weights
    and AdamW's moments in torch's format; a run with fp32 weights (torch's fused AdamW) resumes
    from it exactly and stays fused, and so does another run with bf16 weights."""

    def build(weights: str):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
        )
        groups = param_groups(model, 0.1)
        if weights == "bf16":
            opt = MasterAdamW(groups, MasterWeights(list(model.parameters())), lr=1e-2)
        else:
            opt = torch.optim.AdamW(groups, lr=1e-2, fused=True)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)

    model, opt, sched = build("bf16")
    for step in range(3):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step)).to(p.dtype)
        opt.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
    spec = CheckpointSpec(dir=tmp_path, resume="auto")
    save_complete(spec, 3, model, opt, sched)
    masters = {i: opt.masters.master_of(p).clone() for i, p in enumerate(model.parameters())}
    moments = {i: opt.state[p]["exp_avg_sq"].clone() for i, p in enumerate(model.parameters())}

    def resumed(weights: str):
        model, opt, sched = build(weights)
        assert checkpointer(spec).maybe_resume(model, opt, sched) == 3
        return model, opt

    fp32, fused = resumed("fp32")
    for i, p in enumerate(fp32.parameters()):
        assert p.dtype == torch.float32 and torch.equal(p.detach(), masters[i])
        assert torch.equal(fused.state[p]["exp_avg_sq"], moments[i])
        assert float(fused.state[p]["step"]) == 3
    assert all(g["fused"] is True for g in fused.param_groups)

    bf16, again = resumed("bf16")
    for i, p in enumerate(bf16.parameters()):
        assert torch.equal(again.masters.master_of(p), masters[i])
        assert torch.equal(p.detach(), masters[i].bfloat16())
        assert torch.equal(again.state[p]["exp_avg_sq"], moments[i]) and int(again._step) == 3


def test_a_resume_with_gradients_kept_in_place_keeps_adamw_state(
    one_process_trainer_env, monkeypatch, tmp_path: Path
):
    """``train.cuda_graphs`` with ``grad_accum`` above 1 keeps every gradient in its own memory
    (``Trainer.grads_in_place``), allocated after the resume: torch builds a fresh optimizer's
    state to load into only while no gradient exists. Graphs need a GPU: the spec's check is
    bypassed here (``model_copy``), which on the CPU leaves just the gradients' allocation."""
    ckpt = {"dir": str(tmp_path / "ckpt"), "every_steps": 2}
    job = JobSpec.model_validate(tiny_job(steps=4, grad_accum=2, log_every=1, checkpoint=ckpt))
    in_place = job.model_copy(update={"train": job.train.model_copy(update={"cuda_graphs": True})})

    def run(spec: JobSpec, *, stop_at: int | None = None) -> Trainer:
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        with Trainer(spec) as trainer:
            assert trainer.grads_in_place
            assert all(p.grad is not None for p in trainer.trained_params)
            if stop_at is None:
                trainer.train()
            else:
                for step in range(1, stop_at + 1):
                    trainer.train_step(step)
                trainer.checkpointer.save(
                    stop_at, trainer.model, trainer.optimizer, trainer.scheduler
                )
        return trainer

    first = run(in_place, stop_at=2)
    saved = {
        i: {k: v.clone() for k, v in first.optimizer.state[p].items()}
        for i, p in enumerate(first.trained_params)
    }
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with Trainer(in_place) as resumed:
        assert resumed.start_step == 2
        assert all(p.grad is not None for p in resumed.trained_params)
        assert len(resumed.optimizer.state) == len(saved)
        for i, p in enumerate(resumed.trained_params):
            state = resumed.optimizer.state[p]
            assert float(state["step"]) == 2, i
            assert torch.equal(state["exp_avg"], saved[i]["exp_avg"]), i
            assert torch.equal(state["exp_avg_sq"], saved[i]["exp_avg_sq"]), i
        resumed.train()
        after_resume = {k: v.clone() for k, v in resumed.model.state_dict().items()}

    straight = in_place.model_copy(
        update={"train": in_place.train.model_copy(update={"checkpoint": CheckpointSpec()})}
    )
    whole = run(straight)
    for name, value in whole.model.state_dict().items():
        assert torch.equal(value, after_resume[name]), name


def test_fp16_loss_scale_is_saved_and_resumed(tmp_path: Path):
    """fp16's GradScaler goes on at the loss scale and growth tracker it had; a checkpoint without
    one (not fp16) leaves a scaler at its initial scale, and one with a scaler loads into a run
    without one. GradScaler("cpu") keeps the same state as on CUDA."""

    def build():
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=10)
        return (*_small_training(), scaler)

    model, opt, sched, scaler = build()
    for step in range(5):
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).sum()
        scaler.scale(loss * (float("inf") if step in (0, 1) else 1.0)).backward()  # two overflows
        scaler.step(opt)
        scaler.update()
        sched.step()
    assert scaler.get_scale() == 2.0**14 and scaler._get_growth_tracker() == 3
    spec = CheckpointSpec(dir=tmp_path / "fp16", resume="auto")
    save_complete(spec, 5, model, opt, sched, scaler)

    model, opt, sched, fresh = build()
    assert checkpointer(spec).maybe_resume(model, opt, sched, fresh) == 5
    assert fresh.get_scale() == 2.0**14 and fresh._get_growth_tracker() == 3
    assert fresh.state_dict() == scaler.state_dict()
    model, opt, sched, _ = build()
    assert checkpointer(spec).maybe_resume(model, opt, sched) == 5  # e.g. bf16 from here on

    older = CheckpointSpec(dir=tmp_path / "older", resume="auto")
    save_complete(older, 5, model, opt, sched)
    model, opt, sched, fresh = build()
    assert checkpointer(older).maybe_resume(model, opt, sched, fresh) == 5
    assert fresh.get_scale() == 2.0**16


def _resume_worker(
    rank: int, world: int, port: int, base: str, roots: dict[int, list[int]]
) -> None:
    """One gloo rank: save steps 2 and 4 to a shared folder, copy into each rank's own folder
    the steps ``roots`` gives it (a node-local view), resume there; the outcome to a file."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}"
    )
    try:
        model, opt, sched = _small_training()
        _one_step(model, opt, sched)
        shared = checkpointer(CheckpointSpec(dir=Path(base, "shared")), rank=rank, world=world)
        for step in (2, 4):
            shared.save(step, model, opt, sched)
        shared.wait()
        if rank == 0:
            for r, steps in roots.items():
                for step in steps:
                    shutil.copytree(
                        step_dir(Path(base, "shared"), step), step_dir(Path(base, f"rank{r}"), step)
                    )
        dist.barrier()
        spec = CheckpointSpec(dir=Path(base, f"rank{rank}"), resume="auto")
        mine = checkpointer(spec, rank=rank, world=world)
        try:
            outcome = str(mine.maybe_resume(model, opt, sched))
        except ResumeError as err:
            outcome = f"ResumeError: {err}"
        Path(base, f"outcome{rank}.txt").write_text(outcome)
    finally:
        dist.destroy_process_group()


def _resume_in_two_ranks(base: Path, roots: dict[int, list[int]]) -> list[str]:
    run_ranks(_resume_worker, 2, str(base), roots)  # fails when one rank waits for the other
    return [(base / f"outcome{rank}.txt").read_text() for rank in range(2)]


@pytest.mark.processes
def test_every_rank_resumes_from_the_checkpoint_rank_0_picks(tmp_path: Path):
    """Real gloo ranks whose checkpoint folders differ (a node-local folder on several nodes, or
    a marker one node sees before another): every rank loads rank 0's latest, or every rank
    refuses with a ResumeError where one does not have it."""
    newer_elsewhere = _resume_in_two_ranks(tmp_path / "a", {0: [2], 1: [2, 4]})
    assert newer_elsewhere == ["2", "2"]
    missing = _resume_in_two_ranks(tmp_path / "b", {0: [2, 4], 1: [2]})
    for outcome in missing:
        assert outcome.startswith("ResumeError: rank 0 resumes from "), outcome
        assert "step_00000004, which rank(s) 1 do not find complete" in outcome
        assert "one folder every node shares" in outcome


def test_a_checkpoint_others_may_change_is_refused_before_anything_is_unpickled(tmp_path: Path):
    """Resuming unpickles DCP's .metadata and the train state: a folder or file that another
    user may write is refused by the trainer (exit 4 for the job) and, where the launcher's
    machine sees the folder, by the launcher before anything starts (exit 2)."""
    from launcher.errors import UntrustedCheckpoint
    from launcher.orchestrate.run import checked_code
    from launcher.spec import ClusterSpec

    model, opt, sched = _small_training()
    spec = CheckpointSpec(dir=tmp_path / "ckpt", resume="auto")
    save_complete(spec, 3, model, opt, sched)
    assert checkpointer(spec).maybe_resume(model, opt, sched) == 3
    job = JobSpec.model_validate({"name": "t", "train": {"checkpoint": spec.model_dump()}})
    local = ClusterSpec.model_validate({"nodes": [{"name": "local", "host": "localhost"}]})
    checked_code(job, local)  # private: accepted
    planted = step_dir(spec.dir, 3) / ".metadata"
    for loose in (planted, spec.dir):
        loose.chmod(0o666 if loose.is_file() else 0o777)
        with pytest.raises(ResumeError, match="refusing to resume") as err:
            checkpointer(spec).maybe_resume(model, opt, sched)
        assert str(loose) in str(err.value) and "chmod -R go-w" in str(err.value)
        with pytest.raises(UntrustedCheckpoint) as refused:
            checked_code(job, local)
        assert refused.value.exit_code == 2 and str(loose) in str(refused.value)
        loose.chmod(0o600 if loose.is_file() else 0o700)
    never = JobSpec.model_validate(
        {"name": "t", "train": {"checkpoint": {**spec.model_dump(), "resume": "never"}}}
    )
    spec.dir.chmod(0o777)
    checked_code(never, local)  # nothing is resumed: nothing to refuse


def test_an_async_checkpoint_resumes_bit_identically_to_a_synchronous_one(
    one_process_trainer_env: Path, monkeypatch, tmp_path: Path
):
    """Two runs of one job, checkpoints every 3 of 6 steps, one written in the background while
    steps 4-6 change the weights. Resumed from step 3, both hold the same weights and AdamW state
    bit for bit, and both end where the uninterrupted run ended. The background run has its host
    copy from step 1 on, before its first save (``Checkpointer.prepare``)."""

    def trainer(job) -> Trainer:
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        return Trainer(job)

    def cloned(state: dict) -> dict:
        return {k: v.clone() for k, v in state.items()}

    finals, resumed_state = {}, {}
    for mode, background in (("sync", False), ("async", True)):
        checkpoint = {"dir": str(tmp_path / mode), "every_steps": 3, "async": background}
        job = JobSpec.model_validate(tiny_job(steps=6, log_every=1, checkpoint=checkpoint))
        with trainer(job) as whole:
            assert whole.checkpointer.async_save is background
            prepared: dict[int, bool] = {}

            def after(step: int, whole=whole, prepared=prepared) -> None:  # made after step 1
                prepared[step] = whole.checkpointer._stager is not None

            whole.train(on_step=after)
            assert prepared[1] is background and prepared[2] is background
        assert latest_checkpoint(tmp_path / mode) == step_dir(tmp_path / mode, 6)
        shutil.rmtree(step_dir(tmp_path / mode, 6))  # resume from step 3
        with trainer(job) as again:
            assert again.start_step == 3
            optim = [cloned(again.optimizer.state[p]) for p in again.trained_params]
            resumed_state[mode] = (cloned(again.model.state_dict()), optim)
            again.train()
            finals[mode] = cloned(again.model.state_dict())
        if mode == "sync":
            uninterrupted = cloned(whole.model.state_dict())
    sync_model, sync_optim = resumed_state["sync"]
    async_model, async_optim = resumed_state["async"]
    assert sync_model.keys() == async_model.keys()
    for name in sync_model:
        assert torch.equal(sync_model[name], async_model[name]), name
    for a, b in zip(sync_optim, async_optim, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name, value in uninterrupted.items():
        assert torch.equal(finals["sync"][name], value), name
        assert torch.equal(finals["async"][name], value), name
    records = read_records(one_process_trainer_env.with_name("rank0.jsonl"))
    saves = [r for r in records if r["type"] == "checkpoint"]
    both_modes = {(step, mode) for step in (3, 6) for mode in (True, False)}
    assert {(r["step"], r["async"]) for r in saves} >= both_modes
    assert all(r["blocking_s"] >= 0 for r in saves)
    for r in saves:  # the parts of the hold: a copy in the background, the write in the foreground
        parts = {"wait_s", "state_s", "other_s"} | (
            {"setup_s", "stage_s"} if r["async"] else {"write_s"}
        )
        assert set(r) - {"type", "step", "async", "blocking_s", "rank", "time"} == parts, r
        assert sum(r[k] for k in parts) == pytest.approx(r["blocking_s"], abs=2e-3), r
    assert sorted(r["step"] for r in records if r["type"] == "checkpoint_complete") == [3, 6, 6]


def test_a_failed_background_save_leaves_the_last_complete_checkpoint_loadable(
    tmp_path: Path, monkeypatch
):
    """The writer fails half-way through step 2's files (a full disk): waiting on it raises
    CheckpointFailed naming step 2 and the checkpoint still complete; step 2 never gets its
    marker, step 1's files are untouched, and a resume loads step 1's weights."""
    from torch.distributed.checkpoint import FileSystemWriter

    from launcher.train.checkpoint import CheckpointFailed

    spec = CheckpointSpec(dir=tmp_path, resume="auto", every_steps=1)
    assert spec.async_save
    ckpt = checkpointer(spec)
    model, opt, sched = _small_training()
    _one_step(model, opt, sched)
    ckpt.save(1, model, opt, sched)
    ckpt.wait()
    step1 = step_dir(tmp_path, 1)
    assert (step1 / MARKER).is_file()
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    def digest() -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(step1.iterdir())}

    before = digest()
    real_write = FileSystemWriter.write_data

    def full_disk(self, plan, planner):
        real_write(self, plan, planner).wait()  # the data files are written, then it fails
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    _one_step(model, opt, sched)
    ckpt.save(2, model, opt, sched)
    _one_step(model, opt, sched)  # training goes on while it is written
    with pytest.raises(CheckpointFailed, match=r"step 2 .*No space left.*step_00000001"):
        ckpt.wait()
    step2 = step_dir(tmp_path, 2)
    assert step2.is_dir() and not (step2 / MARKER).exists()
    assert latest_checkpoint(tmp_path) == step1 and digest() == before
    monkeypatch.undo()
    fresh, fresh_opt, fresh_sched = _small_training()
    for p in fresh.parameters():
        p.data.add_(1.0)
    assert checkpointer(spec).maybe_resume(fresh, fresh_opt, fresh_sched) == 1
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, saved[name]), name
    ckpt.close()


def test_the_host_copy_reuses_its_buffers_and_copies_any_python_object():
    """HostCopy deep-copies plain objects in the state (torch's own stager fails on some) and
    copies tensors into buffers kept between saves."""
    from launcher.train.checkpoint import HostCopy

    @dataclasses.dataclass
    class Leaf:
        a: int

    weight = torch.randn(3)
    state = {"model": {"w": weight}, "other": [Leaf(1), (torch.ones(2), b"x")]}
    stager = HostCopy()
    first = stager.stage(state)
    assert torch.equal(first["model"]["w"], weight) and first["model"]["w"] is not weight
    assert first["other"][0] == Leaf(1) and first["other"][0] is not state["other"][0]
    weight.add_(1.0)  # training goes on; the next save copies into the same buffer
    second = stager.stage(state)
    assert second["model"]["w"] is first["model"]["w"] and torch.equal(second["model"]["w"], weight)
    stager.close()


def test_prepare_allocates_the_host_copy_beside_training_and_the_first_save_reuses_it(
    tmp_path: Path, monkeypatch
):
    """After the first step ``prepare`` allocates a host buffer per tensor on a thread; the
    first save copies into exactly those buffers (nothing allocated in training's path), its
    record splits the hold into parts that add up, and the checkpoint loads back."""
    import launcher.train.checkpoint as checkpoint

    records: list[dict] = []
    monkeypatch.setattr(checkpoint, "write_record", records.append)
    ckpt = checkpointer(CheckpointSpec(dir=tmp_path, every_steps=1))
    model, opt, sched = _small_training()
    ckpt.prepare(model, opt, sched)  # no optimizer state yet: nothing to size, nothing made
    assert ckpt._stager is None and not opt.state
    _one_step(model, opt, sched)
    ckpt.prepare(model, opt, sched)
    ckpt._reserving.join()
    stager = ckpt._stager
    tensors = len(model.state_dict()) + sum(
        isinstance(v, torch.Tensor) for state in opt.state.values() for v in state.values()
    )
    buffers = dict(stager._buffers)
    assert len(buffers) == tensors
    ckpt.save(1, model, opt, sched)
    assert stager.alloc_s == 0 and all(stager._buffers[k] is b for k, b in buffers.items())
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _one_step(model, opt, sched)  # training goes on while step 1 is written
    ckpt.close()
    assert len(list(step_dir(tmp_path, 1).glob("*.distcp"))) == 4  # write_threads' default
    (rec,) = records[:1]
    assert rec["type"] == "checkpoint" and rec["async"] is True
    parts = [rec[f"{part}_s"] for part in ("wait", "state", "setup", "stage", "other")]
    assert "write_s" not in rec and all(t >= 0 for t in parts)
    assert sum(parts) == pytest.approx(rec["blocking_s"], abs=2e-3)
    fresh, fresh_opt, fresh_sched = _small_training()
    again = checkpointer(CheckpointSpec(dir=tmp_path))
    assert again.maybe_resume(fresh, fresh_opt, fresh_sched) == 1
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, saved[name]), name


def test_a_save_without_prepare_counts_the_allocation_as_setup(tmp_path: Path, monkeypatch):
    """Unprepared, the first save allocates its host copy itself: that time is the record's
    setup, not its copy; the second save allocates nothing. Each save is written by
    ``write_threads`` threads, a file each."""
    import launcher.train.checkpoint as checkpoint

    records: list[dict] = []
    monkeypatch.setattr(checkpoint, "write_record", records.append)
    allocs: list[float] = []
    real_stage = checkpoint.HostCopy.stage

    def stage(self, state):
        copied = real_stage(self, state)
        allocs.append(self.alloc_s)
        return copied

    monkeypatch.setattr(checkpoint.HostCopy, "stage", stage)
    ckpt = checkpointer(CheckpointSpec(dir=tmp_path, every_steps=1, write_threads=2))
    model, opt, sched = _small_training()
    for step in (1, 2):
        _one_step(model, opt, sched)
        ckpt.save(step, model, opt, sched)
    ckpt.close()
    first, second = (r for r in records if r["type"] == "checkpoint")
    assert allocs[0] > 0 and allocs[1] == 0
    assert first["setup_s"] >= round(allocs[0], 4)
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 2)
    for step in (1, 2):
        assert len(list(step_dir(tmp_path, step).glob("*.distcp"))) == 2
