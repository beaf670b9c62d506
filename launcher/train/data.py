"""Batches: synthetic, windows of a token file (``launcher.train.tokens``) or of tokenized text
(``launcher.train.text``), with MLM masking, made on the host ahead of the steps that use them.

Sample n is a pure function of (seed, n), so the data do not depend on how the global batch is
split over ranks and micro-batches.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from launcher.spec.job import JobSpec

_M32 = 0xFFFFFFFF
# Salts keep the hash streams of different uses apart.
_SALT_RESET, _SALT_START, _SALT_MASK, _SALT_ACTION, _SALT_RANDOM, _SALT_VAL = 1, 2, 3, 4, 5, 6
RESET_PER_MILLE = 100
MAX_STATES = 256

INIT_FROM_VOCAB = "the vocab_size of model.init_from's "  # vocab_origin: weights fix the vocabulary

log = logging.getLogger(__name__)


class DataError(ValueError):
    """Data the trainer cannot use, found before the first step (the worker exits 2);
    ``field``: the job field it names."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


def build_data(
    job: JobSpec, *, rank: int, world_size: int, device: torch.device, held_out: bool = False
) -> Batches:
    """The batch source a job asks for: its training data, or (``held_out``) the data its
    evaluations read, one micro-batch a step: ``data.val_path``, the end of ``data.path`` that
    ``data.val_fraction`` keeps out of training, or synthetic samples of another seed."""
    dims = job.model.dims()
    data = job.data
    common: dict[str, Any] = dict(
        arch=job.model.arch,
        vocab_size=dims["vocab_size"],
        seq_len=data.seq_len,
        micro_batch=job.train.micro_batch,
        grad_accum=1 if held_out else job.train.grad_accum,
        mask_prob=data.mask_prob,
        seed=val_seed(job.train.seed) if held_out else job.train.seed,
        rank=rank,
        world_size=world_size,
        device=device,
    )
    if data.source != "synthetic":
        if held_out and data.val_path is not None:
            data = data.model_copy(update={"path": data.val_path})
        elif data.val_fraction:
            cut = 1.0 - data.val_fraction
            common["span"] = (cut, 1.0) if held_out else (0.0, cut)
    if data.source == "tokens":
        from launcher.train.tokens import TokenFileBatches

        assert data.path is not None
        return TokenFileBatches(
            path=data.path, token_dtype=data.token_dtype, vocab_origin=vocab_origin(job), **common
        )
    if data.source == "text":
        from launcher.train.text import TextBatches, prepare

        return TextBatches(
            meta=prepare(data, job.model.arch), vocab_origin=vocab_origin(job), **common
        )
    return SyntheticBatches(**common)


def build_val_batches(
    job: JobSpec, *, rank: int, world_size: int, device: torch.device
) -> list[dict[str, torch.Tensor]]:
    """This rank's ``train.eval_steps`` held-out micro-batches (``build_data(held_out=True)``),
    made once and kept on the device: every evaluation reads the same samples, so its losses
    compare over the run. The ranks' samples are disjoint."""
    source = build_data(job, rank=rank, world_size=world_size, device=device, held_out=True)
    try:
        return [source.batch(i + 1) for i in range(job.train.eval_steps)]
    finally:
        source.close()


def val_seed(seed: int) -> int:
    """The seed of the held-out synthetic samples: a stream apart from ``seed``'s."""
    return int(hash_ints(torch.tensor(seed), _SALT_VAL))


def vocab_origin(job: JobSpec) -> str:
    """Where the model's vocabulary size comes from, for messages about it (``INIT_FROM_VOCAB``
    first where a model folder's weights fix it)."""
    model = job.model
    if model.init_from is not None:
        return f"{INIT_FROM_VOCAB}{model.init_from / 'config.json'}"
    if model.vocab_size is not None:
        return "model.vocab_size"
    return f"model.vocab_size unset: the {model.arch} default"


def mask_token_id(vocab_size: int) -> int:
    """[MASK]: 103 as in BERT's uncased vocabulary, or the last id of a small vocabulary."""
    return 103 if vocab_size > 103 else vocab_size - 1


def hash_ints(*keys: torch.Tensor | int) -> torch.Tensor:
    """A 32-bit integer hash of the keys (broadcast together; one at least a tensor), as
    int64 in [0, 2^32): xor and a murmur-style finaliser, never overflowing int64."""
    h: torch.Tensor | int = 0x2545F491
    for key in keys:
        h = _mix(h ^ (key & _M32))
    assert isinstance(h, torch.Tensor), "hash_ints needs at least one tensor key"
    return h


def _mix(x):
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _M32
    x = ((x ^ (x >> 15)) * 0x46CA68B5) & _M32
    return x ^ (x >> 16)


def global_index(micro, rank: int, j, *, world_size: int, micro_batch: int):
    """``g = a·(W·m) + r·m + j``, a sample's offset in its step (see the module doc), for
    ints or tensors of micro and j."""
    return micro * (world_size * micro_batch) + rank * micro_batch + j


@dataclasses.dataclass(eq=False, kw_only=True)
class Batches(abc.ABC):
    """A rank's batches: ``batch(step, micro)`` → dict of ``input_ids``, ``labels`` and,
    for BERT, ``mask_pos`` (the masked positions, ``n_mask`` per sequence, sorted)."""

    arch: str
    vocab_size: int
    seq_len: int
    micro_batch: int
    grad_accum: int
    mask_prob: float
    seed: int
    rank: int
    world_size: int
    device: torch.device

    def __post_init__(self) -> None:
        self.global_batch = self.world_size * self.micro_batch * self.grad_accum
        # The data go on after step start_step at global sample start_sample (continue_at).
        self.start_step = self.start_sample = 0
        self.n_mask = max(1, min(self.seq_len, round(self.mask_prob * self.seq_len)))
        self.mask_id = mask_token_id(self.vocab_size)
        self.random_vocab = self.vocab_size  # BERT's random replacements: ids below this
        self.never_mask: torch.Tensor | None = None  # ids never picked for masking ([CLS], [SEP])
        self.positions = torch.arange(self.seq_len + 1)

    def continue_at(self, step: int, sample: int) -> None:
        """Resume after optimizer step ``step`` at global sample ``sample``: the samples the
        run that wrote the checkpoint used through ``step``, at whatever global batch it ran."""
        self.start_step, self.start_sample = step, sample

    def first_sample(self, step: int) -> int:
        """The global index of the first sample of optimizer step ``step`` (1-based)."""
        return self.start_sample + (step - self.start_step - 1) * self.global_batch

    def batch(self, step: int, micro: int = 0) -> dict[str, torch.Tensor]:
        """Micro-batch ``micro`` of optimizer step ``step`` (1-based) for this rank."""
        assert 0 <= micro < self.grad_accum
        m = self.micro_batch
        first = self.first_sample(step) + global_index(
            micro, self.rank, 0, world_size=self.world_size, micro_batch=m
        )
        sample = torch.arange(first, first + m).unsqueeze(1)
        batch = self.assemble(self.tokens(sample), sample)
        return {key: value.to(self.device) for key, value in batch.items()}

    def close(self) -> None:  # noqa: B027 (optional to override: most sources hold nothing)
        """Release what making batches holds (nothing here)."""

    @abc.abstractmethod
    def tokens(self, sample: torch.Tensor) -> torch.Tensor:
        """(rows, seq_len + 1) int64 token ids on the host for a column of global sample indices."""

    def assemble(self, tokens: torch.Tensor, sample: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's inputs from rows of seq_len + 1 tokens: shifted pairs (GPT) or masked (BERT)."""
        if self.arch == "gpt":
            return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
        return self.mask(tokens[:, : self.seq_len], sample)

    def hash(self, salt: int, sample: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The hash of (seed, salt, global sample index, position); the index's high 32 bits
        are a key of their own, so samples 2^32 apart differ."""
        return hash_ints(self.seed, salt, sample >> 32, sample, pos)

    def mask(self, tokens: torch.Tensor, sample: torch.Tensor) -> dict[str, torch.Tensor]:
        """BERT masking: n_mask distinct positions per sequence; 80% [MASK], 10% random, 10% kept."""
        pos = self.positions[: self.seq_len]
        # Unique keys (hash in the high bits, position in the low 20) make topk tie-free.
        keys = (self.hash(_SALT_MASK, sample, pos) << 20) | pos
        # below every other key: picked only if nothing else is left
        if self.never_mask is not None:
            keys = torch.where(torch.isin(tokens, self.never_mask), keys - (1 << 53), keys)
        mask_pos = keys.topk(self.n_mask, dim=1).indices.sort(dim=1).values
        labels = tokens.gather(1, mask_pos)
        action = self.hash(_SALT_ACTION, sample, mask_pos) % 10
        random_ids = self.hash(_SALT_RANDOM, sample, mask_pos) % self.random_vocab
        new = torch.where(
            action < 8,
            torch.full_like(labels, self.mask_id),
            torch.where(action == 8, random_ids, labels),
        )
        return {
            "input_ids": tokens.scatter(1, mask_pos, new),
            "labels": labels,
            "mask_pos": mask_pos,
        }


class MadeAhead(Batches):
    """Batches made ahead, ``steps_ahead`` optimizer steps at a time (a chunk, the numbers of
    ``Batches.batch``), the next chunk in a worker thread (pinned for a GPU); ``batch`` hands
    out views. A worker's error is raised by the ``batch`` that needs its chunk."""

    CHUNK_TOKENS = 1 << 22

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        rows_per_step = self.grad_accum * self.micro_batch
        self.steps_ahead = max(
            1, min(16, self.CHUNK_TOKENS // (rows_per_step * (self.seq_len + 1)))
        )
        self._chunk: dict[str, torch.Tensor] = {}
        self._chunk_steps = range(0)
        self._next: Future[dict[str, torch.Tensor]] | None = None  # the chunk after _chunk
        self._next_steps = range(0)
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="launcher-data", **_worker_setup(self.device)
        )

    def continue_at(self, step: int, sample: int) -> None:
        super().continue_at(step, sample)
        self._chunk_steps = range(0)  # made for the old position, and so is the next chunk
        self._drop_next()

    def batch(self, step: int, micro: int = 0) -> dict[str, torch.Tensor]:
        assert 0 <= micro < self.grad_accum
        if step not in self._chunk_steps:
            self._take_chunk(step)
        first = ((step - self._chunk_steps.start) * self.grad_accum + micro) * self.micro_batch
        return {key: value[first : first + self.micro_batch] for key, value in self._chunk.items()}

    def close(self) -> None:
        """Stop the worker (no batches are asked for after this); a chunk it is making is left
        to finish, not waited for."""
        self._drop_next()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _take_chunk(self, step: int) -> None:
        """Make the chunk holding ``step`` the current one and start making the one after it."""
        if step in self._next_steps:
            assert self._next is not None
            steps, chunk = self._next_steps, self._next.result()  # re-raises the worker's error
        else:
            steps = range(step, step + self.steps_ahead)
            chunk = self._made(steps)
        self._drop_next()
        self._chunk_steps = steps
        self._chunk = {
            key: value.to(self.device, non_blocking=True) for key, value in chunk.items()
        }
        self._next_steps = range(steps.stop, steps.stop + self.steps_ahead)
        self._next = self._pool.submit(self._made, self._next_steps)

    def _drop_next(self) -> None:
        """Forget the next chunk (cancelled if the worker has not begun it)."""
        if self._next is not None:
            self._next.cancel()
        self._next, self._next_steps = None, range(0)

    def _made(self, steps: range) -> dict[str, torch.Tensor]:
        """``_make(steps)``, pinned for an asynchronous copy when the device is a GPU."""
        chunk = self._make(steps)
        if self.device.type == "cuda":
            # contiguous first: a strided view (GPT's shifted pairs) would be copied to the
            # device through a pageable, synchronous staging copy
            chunk = {key: value.contiguous().pin_memory() for key, value in chunk.items()}
        return chunk

    def _make(self, steps: range) -> dict[str, torch.Tensor]:
        """Every micro-batch of this rank for ``steps``, on the host: rows ordered by (step,
        micro, sample)."""
        m = self.micro_batch
        per_step = self.grad_accum * m
        row = torch.arange(len(steps) * per_step).unsqueeze(1)  # a column: one sample a row
        micro, j = (row % per_step) // m, row % m
        offset = global_index(micro, self.rank, j, world_size=self.world_size, micro_batch=m)
        # first_sample(steps.start + k) = first_sample(steps.start) + k·G
        sample = self.first_sample(steps.start) + (row // per_step) * self.global_batch + offset
        return self.assemble(self.tokens(sample), sample)


def _worker_setup(device: torch.device) -> dict:
    """The worker thread's initializer: on a GPU, make the training thread's device current
    there too, or pinning from the new thread would create a context on GPU 0 on every rank."""
    if device.type != "cuda":
        return {}
    index = torch.cuda.current_device() if device.index is None else device.index
    return {"initializer": torch.cuda.set_device, "initargs": (index,)}


class SyntheticBatches(MadeAhead):
    """Structured random tokens (see the module doc), made ahead."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        special = 104 if self.vocab_size >= 104 + 8 else 0
        usable = (self.vocab_size if special else self.mask_id) - special
        self.first_token = special
        self.n_states = 1 << (min(usable, MAX_STATES).bit_length() - 1)
        self.stride = (0x9E3779B1 % self.n_states) | 1  # odd: a permutation of Z_{n_states}

    def tokens(self, sample: torch.Tensor) -> torch.Tensor:
        pos = self.positions
        reset = (self.hash(_SALT_RESET, sample, pos) % 1000 < RESET_PER_MILLE) | (pos == 0)
        start = self.hash(_SALT_START, sample, pos) % self.n_states
        last_reset = torch.where(reset, pos, torch.zeros_like(pos)).cummax(dim=1).values
        state = (start.gather(1, last_reset) + pos - last_reset) % self.n_states
        return self.first_token + (state * self.stride) % self.n_states
