"""Token files as batches: windows of a memory-mapped .npy or raw .bin of token ids, every id
checked against the model's vocabulary before the first step (the scan split over the ranks)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from launcher.tokenfile import npy_layout
from launcher.train.data import INIT_FROM_VOCAB, DataError, MadeAhead

log = logging.getLogger(__name__)

SCAN_CHUNK = 1 << 22  # token ids per step of a token file's vocabulary check (8-32 MB of it)


class TokenFileBatches(MadeAhead):
    """Windows of seq_len+1 tokens from a memory-mapped file of token ids (.npy or raw .bin):
    global sample n reads window n mod n_windows. Opening the file checks it (``check_ids``);
    ``span`` is the part of its tokens read, as fractions (``data.val_fraction``)."""

    def __init__(
        self,
        *,
        path: str | os.PathLike[str],
        token_dtype: str,
        row_len: int | None = None,
        vocab_origin: str = "model.vocab_size",
        span: tuple[float, float] = (0.0, 1.0),
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.path = Path(path)
        self.vocab_origin = vocab_origin
        self.ids = open_token_file(self.path, token_dtype)
        self.span = span
        if span != (0.0, 1.0):
            n = self.ids.numel()
            self.ids = self.ids[round(span[0] * n) : round(span[1] * n)]
        self.row_len = row_len or self.seq_len + 1
        self.stride = row_len or self.seq_len
        self.n_windows = (self.ids.numel() - self.row_len) // self.stride + 1
        self._offsets = torch.arange(self.row_len)
        # Wide unsigned ids through their signed view (older torch lacks their kernels).
        self._low_bits = None
        if self.ids.dtype in _SIGNED_VIEWS:
            view, self._low_bits = _SIGNED_VIEWS[self.ids.dtype]
            self.ids = self.ids.view(view)
        self.check_ids()

    def describe(self) -> str:
        """The file, as messages name it."""
        return f"token file {self.path}{self.part()}"

    def part(self) -> str:
        """The part of the file read, as messages name it ("" for all of it)."""
        lo, hi = self.span
        if (lo, hi) == (0.0, 1.0):
            return ""
        which = "held out" if lo > 0 else "trained on"
        return f" (the {which} {100 * (hi - lo):.3g}% of it, data.val_fraction {1 - lo if lo > 0 else 1 - hi:g})"

    def check_ids(self) -> None:
        """DataError unless the file holds at least one sample and every id in it is below
        vocab_size. The ranks scan a slice each and share one verdict, so all raise alike."""
        n = self.ids.numel()
        rank, world = self._scan_group()
        bad = None
        if n >= self.row_len and not ids_always_fit(
            self.ids.dtype, self.vocab_size, low_bits=self._low_bits
        ):
            began = time.monotonic()
            start, stop = scan_slice(n, rank, world)
            bad = scan_ids(
                self.ids, self.vocab_size, low_bits=self._low_bits, start=start, stop=stop
            )
            took = time.monotonic() - began
            if took >= 1.0:
                log.info(
                    "checked %d of the %d token ids of %s against the vocabulary of %d in %.1f s",
                    stop - start,
                    n,
                    self.path,
                    self.vocab_size,
                    took,
                )
        if world > 1:
            gathered: list[tuple[int, BadIds | None] | None] = [None] * world
            dist.all_gather_object(gathered, (n, bad))
            seen = [entry for entry in gathered if entry is not None]
            sizes = [size for size, _ in seen]
            if len(set(sizes)) > 1:
                other = next(r for r, size in enumerate(sizes) if size != sizes[0])
                raise DataError(
                    f"{self.describe()} holds {sizes[0]} token ids on rank 0 but {sizes[other]} on rank "
                    f"{other}: every node must see the same file at data.path",
                    field="data.path",
                )
            found = [b for _, b in seen if b is not None]
            bad = min(found, key=lambda b: b.position) if found else None
        if n < self.row_len:
            raise DataError(
                f"{self.describe()} holds {n} tokens, fewer than the {self.row_len} of one "
                f"sample (data.seq_len {self.seq_len}); use more data or a shorter seq_len",
                field="data.path",
            )
        if bad is None:
            return
        v = self.vocab_size
        where = (
            f"{self.describe()} holds token id {bad.id} at position {bad.position} (counting the "
            f"file's token ids from 0)"
        )
        whole = bad.start == 0 and bad.span == n
        others = (
            f"ids outside 0..{v - 1}: {bad.outside} of the file's {n}"
            if whole
            else f"ids outside 0..{v - 1}: {bad.outside} of the {bad.span} from position {bad.start} (the "
            f"check stops at the first chunk of {bad.span} ids that holds one)"
        )
        others += (f", the largest {bad.top}" if bad.top is not None else "") + (
            f", the smallest {bad.low}" if bad.low is not None else ""
        )
        if bad.id < 0:
            fix = (
                "token ids run from 0 to model.vocab_size - 1: padding or an ignore-index marked by a "
                "negative id has no place in a token file; drop it when writing the file"
            )
        elif self.vocab_origin.startswith(INIT_FROM_VOCAB):
            fix = (
                "write the file with the tokenizer of the model in model.init_from (its vocabulary "
                "is fixed by its weights)"
            )
        else:
            least = bad.top + 1 if bad.top is not None else bad.id + 1
            size = (
                f"set model.vocab_size: {least} (or more)"
                if whole
                else f"set model.vocab_size above the file's largest id (at least {least}; the ids after "
                f"position {bad.start + bad.span - 1} were not checked)"
            )
            fix = (
                f"write the file with the tokenizer the model is meant for, or {size} to train a "
                f"vocabulary that holds every id of the file"
            )
        raise DataError(
            f"{where}, but the model's vocabulary has {v} entries, ids 0 to {v - 1} ({self.vocab_origin}); "
            f"{others}. Training would fail at the embedding (on a GPU with a device-side assert); {fix}.",
            field="data.path",
        )

    def _scan_group(self) -> tuple[int, int]:
        """This rank and the world size that split the scan: the default process group's where
        one is initialized with this data's world size (the trainer's, ``Trainer.init_distributed``
        runs before ``build_data``), else (0, 1): this process scans the whole file alone."""
        if (
            self.world_size > 1
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() == self.world_size
        ):
            return dist.get_rank(), self.world_size
        return 0, 1

    def tokens(self, sample: torch.Tensor) -> torch.Tensor:
        return self._rows(sample.view(-1))

    def _rows(self, windows: torch.Tensor) -> torch.Tensor:
        """The rows of the given window numbers (any, wrapped around); their ids were checked
        when the file was opened (``check_ids``)."""
        starts = (windows % self.n_windows) * self.stride
        batch = self.ids[starts.unsqueeze(1) + self._offsets].to(torch.int64)
        return self.frame(batch & self._low_bits if self._low_bits is not None else batch)

    def frame(self, rows: torch.Tensor) -> torch.Tensor:
        """The samples made of rows read from the file (on the host): the rows themselves."""
        return rows


class BadIds(NamedTuple):
    """Token ids outside a vocabulary (``scan_ids``): the first one's index and value, and within
    the chunk that holds it (``span`` ids from index ``start``; the scan stops there): how many
    there are, the largest (if any is above the vocabulary) and the smallest (if any is negative)."""

    position: int
    id: int
    outside: int
    top: int | None
    low: int | None
    start: int
    span: int


def ids_always_fit(dtype: torch.dtype, vocab_size: int, *, low_bits: int | None = None) -> bool:
    """Whether every value of the type is an id of the vocabulary, so no scan is needed
    (unsigned types whose largest value is below ``vocab_size``)."""
    largest = low_bits if low_bits is not None else 0xFF if dtype == torch.uint8 else None
    return largest is not None and largest < vocab_size


def scan_slice(n: int, rank: int, world_size: int, *, chunk: int | None = None) -> tuple[int, int]:
    """The ids [start, stop) that ``rank`` of ``world_size`` scans of a file of ``n``: whole
    chunks dealt out in order, so the ranks' slices cover every id exactly once."""
    chunk = chunk or SCAN_CHUNK
    chunks = -(-n // chunk)
    first, last = rank * chunks // world_size, (rank + 1) * chunks // world_size
    return min(first * chunk, n), min(last * chunk, n)


def scan_ids(
    ids: torch.Tensor,
    vocab_size: int,
    *,
    low_bits: int | None = None,
    chunk: int | None = None,
    start: int = 0,
    stop: int | None = None,
) -> BadIds | None:
    """The first id of ids[start:stop] outside 0..vocab_size - 1, or None; one reduction per
    ``chunk`` ids, in bounded memory. ``low_bits``: the tensor is the signed view of unsigned
    ids (``_SIGNED_VIEWS``)."""
    chunk = chunk or SCAN_CHUNK
    stop = ids.numel() if stop is None else stop
    if stop <= start or ids_always_fit(ids.dtype, vocab_size, low_bits=low_bits):
        return None
    # uint16 ids read as int16, a vocabulary past 2^15: ids 2^15..vocab_size-1 read negative but
    # are valid, so compare in unsigned order (x ^ -2^15 is order-preserving from uint16 to int16).
    flip = low_bits == 0xFFFF and vocab_size > 1 << 15
    buffer = torch.empty(min(chunk, stop - start), dtype=ids.dtype) if flip else None
    for begin in range(start, stop, chunk):
        part = ids[begin : min(begin + chunk, stop)]
        if buffer is not None:
            flipped = torch.bitwise_xor(part, -(1 << 15), out=buffer[: part.numel()])
            if int(flipped.max()) < vocab_size - (1 << 15):
                continue
        else:
            lo, hi = (int(v) for v in torch.aminmax(part))
            if lo >= 0 and hi < vocab_size:
                continue
        # The bad ids, found in the file's own type; only they are widened, not the chunk.
        if vocab_size <= torch.iinfo(part.dtype).max:
            outside = (part >= vocab_size) | (part < 0)
        elif low_bits is not None:
            outside = (part < 0) & (part >= vocab_size - (low_bits + 1))
        else:
            outside = part < 0
        values = part[outside].to(torch.int64)
        # unsigned ids past the signed range, all inside a vocabulary as large
        if not values.numel():
            continue
        if low_bits is not None:
            values &= low_bits
        top, low = int(values.max()), int(values.min())
        return BadIds(
            position=begin + int(outside.view(torch.uint8).argmax()),
            id=int(values[0]),
            outside=values.numel(),
            top=top if top >= vocab_size else None,
            low=low if low < 0 else None,
            start=begin,
            span=part.numel(),
        )
    return None


_NPY_DTYPES = {
    "<u2": torch.uint16,
    "<i4": torch.int32,
    "<i8": torch.int64,
    "|u1": torch.uint8,
    "<u4": torch.uint32,
}
_SIGNED_VIEWS = {torch.uint16: (torch.int16, 0xFFFF), torch.uint32: (torch.int32, 0xFFFF_FFFF)}
_RAW_DTYPES = {"uint16": torch.uint16, "int32": torch.int32, "int64": torch.int64}


def open_token_file(path: Path, token_dtype: str) -> torch.Tensor:
    """A 1-D memory-mapped tensor of token ids (the file is not read into memory)."""
    size = path.stat().st_size
    offset, dtype = 0, _RAW_DTYPES[token_dtype]
    if path.suffix == ".npy":  # the job's loader checked its header already
        offset, descr = npy_layout(path)
        dtype = _NPY_DTYPES[descr]
    count = (size - offset) // dtype.itemsize
    raw = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    return raw[offset : offset + count * dtype.itemsize].view(dtype)
