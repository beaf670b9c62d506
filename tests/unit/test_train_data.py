"""Batches: determinism, rank/world equivalence, MLM masking, token files, the worker thread
that makes them ahead (CPU)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from fixtures.batching import equals_one_at_a_time, recording, source, token_file, write_npy
from fixtures.tiny_job import tiny_job
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.spec.job import JobSpec
from launcher.train.data import Batches, global_index, hash_ints, mask_token_id
from launcher.train.loop import Trainer
from launcher.train.tokens import open_token_file


def step_samples(make, world: int, accum: int, step: int, key: str = "input_ids") -> torch.Tensor:
    """Everything one step feeds, in global-index order."""
    parts = [make(rank=r).batch(step, a)[key] for a in range(accum) for r in range(world)]
    return torch.cat(parts)


@given(world=st.integers(1, 4), micro=st.integers(1, 4), accum=st.integers(1, 3))
@settings(max_examples=50, deadline=None)
def test_global_indices_tile_the_step_without_overlap(world: int, micro: int, accum: int):
    seen = [
        global_index(a, r, j, world_size=world, micro_batch=micro)
        for a in range(accum)
        for r in range(world)
        for j in range(micro)
    ]
    assert seen == list(range(world * micro * accum))


@pytest.mark.parametrize("arch", ["bert", "gpt"])
@pytest.mark.parametrize("key", ["input_ids", "labels"])
def test_two_ranks_see_what_one_process_sees(arch: str, key: str):
    def make(world, micro, accum):
        return lambda rank: source(arch, rank=rank, world=world, micro=micro, accum=accum)

    for step in (1, 7):
        one_big = step_samples(make(1, 8, 1), 1, 1, step, key)
        two_ranks = step_samples(make(2, 4, 1), 2, 1, step, key)
        accumulated = step_samples(make(1, 4, 2), 1, 2, step, key)
        four_by_two = step_samples(make(2, 2, 2), 2, 2, step, key)
        assert torch.equal(one_big, two_ranks) and torch.equal(one_big, accumulated)
        assert torch.equal(one_big, four_by_two)


def test_batches_are_deterministic_and_differ_by_step_and_seed():
    a, b = source().batch(5), source().batch(5)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["input_ids"], source().batch(6)["input_ids"])
    assert not torch.equal(a["input_ids"], source(seed=4).batch(5)["input_ids"])


def test_hash_is_the_same_for_ints_and_tensors_and_stays_32_bit():
    x = hash_ints(1, 2, torch.arange(1000))
    assert x.dtype == torch.int64 and int(x.min()) >= 0 and int(x.max()) < 2**32
    assert int(hash_ints(1, 2, torch.tensor(17))) == int(x[17])
    assert len(set(x.tolist())) == 1000


def test_synthetic_tokens_follow_a_noisy_chain():
    gen = source("gpt", micro=16, seq=256)
    ids = gen.batch(1)["input_ids"]
    assert int(ids.min()) >= gen.first_token and int(ids.max()) < gen.first_token + gen.n_states
    state = ((ids - gen.first_token) * pow(gen.stride, -1, gen.n_states)) % gen.n_states
    follows = ((state[:, 1:] - state[:, :-1]) % gen.n_states == 1).float().mean().item()
    assert 0.85 < follows < 0.95  # 10% restarts


def test_gpt_labels_are_the_next_tokens():
    batch = source("gpt").batch(2)
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 32)
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])


def test_mlm_masks_a_fixed_count_with_80_10_10():
    gen = source(micro=64, seq=128, vocab=30522)
    clean = gen.tokens(gen.first_sample(3) + torch.arange(64).unsqueeze(1))[:, :128]
    batch = gen.batch(3)
    pos, labels, ids = batch["mask_pos"], batch["labels"], batch["input_ids"]
    assert pos.shape == labels.shape == (64, round(0.15 * 128))
    assert all(len(set(row.tolist())) == pos.shape[1] for row in pos)
    assert torch.equal(pos, pos.sort(dim=1).values)
    assert torch.equal(labels, clean.gather(1, pos))
    unmasked = torch.ones_like(ids, dtype=torch.bool).scatter(1, pos, False)
    assert torch.equal(ids[unmasked], clean[unmasked])
    at = ids.gather(1, pos)
    n = at.numel()
    as_mask = (at == mask_token_id(30522)).sum().item() / n
    kept = (at == labels).sum().item() / n
    assert 0.76 < as_mask < 0.84 and 0.07 < kept < 0.14


@pytest.mark.parametrize(
    ("dtype", "descr"), [(torch.uint16, "<u2"), (torch.int32, "<i4"), (torch.int64, "<i8")]
)
def test_npy_and_raw_token_files_are_memory_mapped(tmp_path: Path, dtype: torch.dtype, descr: str):
    ids = torch.arange(1000, dtype=torch.int64).to(dtype)
    write_npy(tmp_path / "t.npy", ids, descr)
    (tmp_path / "t.bin").write_bytes(bytes(ids.view(torch.uint8).tolist()))
    raw_name = {torch.uint16: "uint16", torch.int32: "int32", torch.int64: "int64"}[dtype]
    for tokens in (
        open_token_file(tmp_path / "t.npy", "uint16"),
        open_token_file(tmp_path / "t.bin", raw_name),
    ):
        assert tokens.dtype == dtype and tokens.numel() == 1000
        assert torch.equal(tokens.to(torch.int64), torch.arange(1000))


def test_token_windows_are_sharded_by_rank_and_match_one_process(tmp_path: Path):
    ids = torch.arange(10_000, dtype=torch.int32) % 1000
    write_npy(tmp_path / "t.npy", ids, "<i4")

    def make(rank: int, world: int = 2, micro: int = 4):
        return token_file(tmp_path / "t.npy", rank=rank, world=world, micro=micro)

    r0, r1 = make(0).batch(1), make(1).batch(1)
    assert torch.equal(r0["input_ids"][:, 0], torch.tensor([0, 16, 32, 48]))
    assert torch.equal(r1["input_ids"][:, 0], torch.tensor([64, 80, 96, 112]))
    one = make(0, world=1, micro=8).batch(1)["input_ids"]
    assert torch.equal(one, torch.cat([r0["input_ids"], r1["input_ids"]]))
    assert torch.equal(make(0).batch(2)["input_ids"][0, 0], torch.tensor(128))


def test_token_file_errors_name_the_fix(tmp_path: Path):
    """Too short and above the vocabulary: test_token_vocab.py."""
    padded = torch.arange(100, dtype=torch.int32)
    padded[5] = -1  # padding by a negative id: CUDA's embedding would fail with a device assert
    write_npy(tmp_path / "padded.npy", padded, "<i4")
    with pytest.raises(ValueError, match="token id -1 at position 5 .*token ids run from 0"):
        token_file(tmp_path / "padded.npy", micro=1)
    write_npy(tmp_path / "float.npy", torch.zeros(100, dtype=torch.float32), "<f4")
    with pytest.raises(ValueError, match="uint8, uint16, uint32, int32 or int64"):
        token_file(tmp_path / "float.npy")


def test_steps_ahead_is_bounded_by_the_chunk_size():
    assert source(micro=64, seq=8192).steps_ahead == 7
    assert source(micro=1024, seq=8192).steps_ahead == 1


@pytest.mark.parametrize("arch", ["bert", "gpt"])
def test_token_file_batches_made_ahead_equal_batches_made_one_at_a_time(tmp_path: Path, arch: str):
    write_npy(tmp_path / "t.npy", torch.arange(5_000, dtype=torch.int32) % 1000, "<i4")
    ahead = token_file(tmp_path / "t.npy", arch, rank=1, world=2, accum=2)
    assert ahead.steps_ahead == 16
    # across a chunk boundary and past the file's end (windows wrap around), then a jump back
    for step, micro in [(s, a) for s in range(1, 40) for a in range(2)] + [(3, 1)]:
        assert equals_one_at_a_time(ahead, step, micro), (step, micro)


@pytest.mark.parametrize(
    ("dtype", "descr", "bits"),
    [(torch.uint16, "<u2", 16), (torch.uint32, "<u4", 32), (torch.uint8, "|u1", 8)],
)
def test_unsigned_token_ids_above_the_signed_range_read_back_exactly(
    tmp_path: Path, dtype, descr: str, bits: int
):
    top = 1 << bits
    ids = (torch.arange(2_000, dtype=torch.int64) * 37 + top // 2 - 100) % top
    write_npy(tmp_path / "t.npy", ids.to(dtype), descr)
    batches = token_file(tmp_path / "t.npy", micro=2, vocab=top)
    b = batches.batch(1)
    assert torch.equal(b["input_ids"], torch.stack([ids[0:16], ids[16:32]]))
    assert int(ids[:32].max()) >= top // 2  # above the signed type's range


def run_samples(make, world: int, accum: int, steps: range, key: str = "input_ids") -> torch.Tensor:
    """Every sample of ``steps``, in global order, from ``world`` ranks made by ``make(rank)``."""
    return torch.cat([step_samples(make, world, accum, step, key) for step in steps])


def resumed(make, rank: int, after_step: int, at_sample: int):
    data = make(rank=rank)
    data.continue_at(after_step, at_sample)
    return data


@pytest.mark.parametrize("arch", ["bert", "gpt"])
@pytest.mark.parametrize("key", ["input_ids", "labels"])
def test_a_restart_at_a_new_world_size_and_the_same_global_batch_sees_the_uninterrupted_samples(
    arch: str, key: str
):
    """3 ranks for 4 steps, then 2 ranks (grad_accum 3 instead of 2) for 4 more: the samples of
    every step are those of one uninterrupted process, in the same order."""

    def make(world, accum):
        return lambda rank: source(arch, rank=rank, world=world, micro=2, accum=accum)

    uninterrupted = run_samples(make(1, 6), 1, 6, range(1, 9), key)
    before = run_samples(make(3, 2), 3, 2, range(1, 5), key)
    after = run_samples(lambda rank: resumed(make(2, 3), rank, 4, 4 * 12), 2, 3, range(5, 9), key)
    assert torch.equal(torch.cat([before, after]), uninterrupted)


@pytest.mark.parametrize("arch", ["bert", "gpt"])
def test_a_restart_that_scales_the_global_batch_repeats_and_skips_no_sample(arch: str):
    """3 ranks x 4 for 3 steps (12 samples a step), then 2 ranks x 4 (8 a step) for 3 more: the
    36 + 24 samples are samples 0..59 of the run, each once, in order (a one-sample-per-step
    source yields sample n at step n + 1)."""
    one = source(arch, micro=1)
    every = torch.cat([one.batch(n + 1)["input_ids"] for n in range(60)])

    def make(world: int):
        return lambda rank: source(arch, rank=rank, world=world)

    before = run_samples(make(3), 3, 1, range(1, 4))
    after = run_samples(lambda rank: resumed(make(2), rank, 3, 36), 2, 1, range(4, 7))
    assert torch.equal(torch.cat([before, after]), every)


def test_a_restarted_token_file_reads_on_from_the_next_window(tmp_path: Path):
    """Window n is global sample n, whatever the world size before and after."""
    write_npy(tmp_path / "t.npy", torch.arange(10_000, dtype=torch.int32) % 1000, "<i4")

    def make(world: int, rank: int):
        return token_file(tmp_path / "t.npy", rank=rank, world=world, micro=2)

    before = run_samples(lambda rank: make(3, rank), 3, 1, range(1, 3))  # 2 steps of 6 samples
    after = run_samples(
        lambda rank: resumed(lambda rank: make(2, rank), rank, 2, 12), 2, 1, range(3, 6)
    )
    starts = torch.cat([before, after])[:, 0]
    assert torch.equal(starts, torch.arange(12 + 3 * 4) * 16)


def test_sample_indices_above_two_to_the_32_stay_distinct():
    """The index's high bits are hashed too: samples 2^32 apart are different samples."""
    late = source()
    late.continue_at(0, 1 << 32)
    assert not torch.equal(late.batch(1)["input_ids"], source().batch(1)["input_ids"])
    ahead = late.batch(1)
    assert all(torch.equal(ahead[k], Batches.batch(late, 1)[k]) for k in ahead)


@pytest.mark.parametrize("arch", ["bert", "gpt"])
def test_chunks_made_by_the_worker_thread_equal_batches_made_one_at_a_time(arch: str):
    """In order across chunk boundaries, then a jump back, one past the next chunk and one
    within; Batches.batch is the one-batch path (the step a Python int in the hash)."""
    data = source(arch, rank=1, world=2, accum=3)
    assert data.steps_ahead == 16
    made = recording(data)
    assert all(equals_one_at_a_time(data, s, a) for s in range(1, 16 * 4 + 1) for a in range(3))
    assert [start for start, _ in made[:4]] == [1, 17, 33, 49]
    assert made[0][1] is threading.main_thread()  # the first chunk: nothing was made ahead
    assert {thread.name.split("_")[0] for _, thread in made[1:4]} == {"launcher-data"}
    assert all(equals_one_at_a_time(data, s, a) for s, a in [(5, 2), (40, 0), (41, 1)])
    data.close()


def test_continue_at_drops_the_chunk_made_ahead_for_the_old_position():
    data = source("gpt")
    made = recording(data)
    data.batch(1)  # the worker makes steps 17-32 at the old position
    data.continue_at(16, 5000)
    assert all(equals_one_at_a_time(data, step) for step in range(17, 40))
    assert made[2] == (17, threading.main_thread())  # made again, for the new position
    data.close()


def test_an_error_in_the_worker_is_raised_by_the_batch_that_needs_its_chunk(tmp_path: Path):
    ids = torch.arange(2_000, dtype=torch.int32) % 1000
    ids[20 * 16 + 3] = 999_999  # in window 20: step 21's sample with one sample a step
    write_npy(tmp_path / "t.npy", ids, "<i4")
    data = token_file(tmp_path / "t.npy", micro=1, vocab=1 << 20)

    def frame(rows: torch.Tensor) -> torch.Tensor:  # the error: one that making a batch can meet
        if bool((rows == 999_999).any()):
            raise ValueError("id 999999 is outside the model's vocabulary")
        return rows

    data.frame = frame
    made = recording(data)
    for step in range(1, 17):
        data.batch(step)
    with pytest.raises(ValueError) as worker_error:
        data.batch(17)
    assert made[1][1] is not threading.main_thread()
    with pytest.raises(ValueError) as one_at_a_time:
        Batches.batch(data, 21)
    assert str(worker_error.value) == str(one_at_a_time.value)
    assert "outside the model's vocabulary" in str(worker_error.value)
    data.close()


def test_close_stops_the_worker_without_waiting_for_its_chunk():
    data = source("gpt")
    started, release = threading.Event(), threading.Event()
    workers, make = [], data._make

    def slow_make(steps: range):
        if threading.current_thread() is not threading.main_thread():
            workers.append(threading.current_thread())
            started.set()
            release.wait(30)
        return make(steps)

    data._make = slow_make
    data.batch(1)
    assert started.wait(10)
    began = time.monotonic()
    data.close()
    data.close()  # twice is fine
    assert time.monotonic() - began < 5
    release.set()
    workers[0].join(5)
    assert not workers[0].is_alive()


def test_for_a_gpu_the_worker_sets_the_device_then_pins_the_chunk(monkeypatch):
    """No GPU here: set_device and pin_memory are recorded; the chunk is made, not moved."""
    calls = []

    def record(*call):
        calls.append((*call, threading.current_thread().name.split("_")[0]))

    monkeypatch.setattr(torch.cuda, "set_device", lambda index: record("set_device", index))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: record("pin", t.is_contiguous()) or t)
    data = source("gpt", device=torch.device("cuda", 1))
    chunk = data._pool.submit(data._made, range(1, 17)).result()
    pins = [("pin", True, "launcher-data")] * len(chunk)
    assert calls == [("set_device", 1, "launcher-data"), *pins]
    data.close()


def test_a_closed_trainer_leaves_no_data_thread_running(one_process_trainer_env: Path):
    job = JobSpec.model_validate(tiny_job("bert", steps=3))
    before = set(threading.enumerate())
    started: set[threading.Thread] = set()

    def note_data_threads(step: int) -> None:
        new = set(threading.enumerate()) - before
        started.update(t for t in new if t.name.startswith("launcher-data"))

    with Trainer(job) as trainer:
        trainer.train(on_step=note_data_threads)
    assert started  # step 1 set the worker making steps 17-32
    for thread in started:
        thread.join(5)
    assert not any(thread.is_alive() for thread in started)
