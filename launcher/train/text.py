"""Text in: tokenized once, in parallel, into a cached token file that every rank memory-maps."""

from __future__ import annotations

import array
import hashlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from launcher.spec.hf import FolderError, load_tokenizer, special_ids, special_names
from launcher.spec.job import DataSpec, JobSpec
from launcher.train.data import DataError
from launcher.train.tokens import TokenFileBatches

log = logging.getLogger(__name__)

FORMAT = 1
SUFFIXES = (".txt", ".jsonl")
BATCH_CHARS = 1 << 22  # text per encode_batch call (~4 MB): enough to keep every thread busy


def prepare(data: DataSpec, arch: str, *, poll_s: float = 0.2) -> dict[str, Any]:
    """The cached token file's metadata for this job, tokenizing first where needed.

    Local rank 0 tokenizes (when the cache misses); the other local ranks wait for its result.
    """
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        return tokenize(data, arch)
    meta_path = cache_paths(data, arch)[1]
    while not meta_path.is_file():  # torchrun stops this rank should local rank 0 fail
        time.sleep(poll_s)
    return read_meta(meta_path)


def tokenize(data: DataSpec, arch: str, *, progress: bool = True) -> dict[str, Any]:
    """Tokenize ``data`` into the cache unless it is there; returns the token file's metadata."""
    bin_path, meta_path = cache_paths(data, arch)
    if meta_path.is_file() and bin_path.is_file():
        meta = read_meta(meta_path)
        log.info("tokenized text from the cache: %s (%d tokens)", bin_path, meta["tokens"])
        return meta
    files = text_files(data.path)
    assert data.tokenizer is not None
    tokenizer = load_tokenizer(data.tokenizer)
    special = special_ids(data.tokenizer, tokenizer, arch)
    separator = special["sep" if arch == "bert" else "eos"]
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    # A vocabulary with gaps in its ids has ids at or above its size: the file's type must hold them.
    id_bound = max(vocab, max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1)
    code, dtype = ("H", "uint16") if id_bound <= 1 << 16 else ("i", "int32")
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = bin_path.with_name(f"{bin_path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    began = time.monotonic()
    n_tokens = n_docs = 0
    try:
        with open(tmp, "wb") as out, _progress(files, progress) as bar:
            for texts, ends, size in _batches(files, data.text_field):
                ids = array.array(code)
                for enc, end in zip(
                    tokenizer.encode_batch(texts, add_special_tokens=False), ends, strict=True
                ):
                    ids.extend(enc.ids)
                    if end:
                        ids.append(separator)
                ids.tofile(out)
                n_tokens += len(ids)
                n_docs += sum(ends)
                bar.update(size)
        if n_tokens == 0:
            raise DataError(f"data.path {data.path} holds no text (no non-empty document)")
        os.replace(tmp, bin_path)
    finally:
        tmp.unlink(missing_ok=True)
    meta = {
        "format": FORMAT,
        "arch": arch,
        "dtype": dtype,
        "tokens": n_tokens,
        "documents": n_docs,
        "vocab_size": vocab,
        "special": special,
        "tokenizer": str(data.tokenizer),
        "files": [str(f) for f in files],
        "seconds": round(time.monotonic() - began, 3),
    }
    tmp_meta = meta_path.with_name(tmp.name + ".json")
    tmp_meta.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp_meta, meta_path)
    log.info(
        "tokenized %d documents into %d tokens in %.1f s: %s",
        n_docs,
        n_tokens,
        meta["seconds"],
        bin_path,
    )
    return read_meta(meta_path)


def read_meta(meta_path: Path) -> dict[str, Any]:
    meta = json.loads(meta_path.read_text())
    meta["path"] = str(meta_path.with_suffix(".bin"))
    return meta


def cache_paths(data: DataSpec, arch: str) -> tuple[Path, Path]:
    """(token file, metadata) in the cache for this text, tokenizer and arch."""
    assert data.path is not None and data.tokenizer is not None
    key = hashlib.sha256()
    names = special_names(data.tokenizer, arch)
    key.update(json.dumps([FORMAT, arch, data.text_field, sorted(names.items())]).encode())
    key.update(file_sha256(data.tokenizer / "tokenizer.json").encode())
    for path in text_files(data.path):
        key.update(file_sha256(path).encode())
    root = (
        data.cache_dir
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "launcher" / "tokens"
    )
    stem = f"{arch}-{key.hexdigest()[:32]}"
    return root / f"{stem}.bin", root / f"{stem}.json"


def text_files(path: Path | None) -> list[Path]:
    """The text files of data.path: the file itself, or a folder's .txt/.jsonl files, sorted."""
    assert path is not None
    if path.is_file():
        return [path]
    files = sorted(
        p
        for p in path.rglob("*")
        if p.suffix in SUFFIXES
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise DataError(f"data.path {path} holds no .txt or .jsonl file")
    return files


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def documents(path: Path, text_field: str) -> Iterator[tuple[str, int, bool]]:
    """(text, bytes of the file it took, whether a document ends there) for a text file.

    A paragraph longer than BATCH_CHARS comes in pieces cut at line ends, the last one ending
    the document, so a file without blank lines is not held in memory whole.
    """
    with open(path, "rb") as fh:
        if path.suffix == ".jsonl":
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    yield "", len(line), False
                    continue
                try:
                    text = json.loads(line)[text_field]
                except (ValueError, KeyError, TypeError):
                    raise DataError(
                        f"{path} line {number} is not a JSON object with a "
                        f"{text_field!r} string; fix the line or set data.text_field"
                    ) from None
                if not isinstance(text, str):
                    raise DataError(f"{path} line {number}: {text_field!r} is not a string")
                yield text, len(line), bool(text)
            return
        lines: list[str] = []
        chars = size = 0
        for line in fh:
            text = line.decode("utf-8", errors="replace").rstrip("\r\n")
            if text.strip():
                if chars >= BATCH_CHARS:  # the paragraph goes on: hand over what it has so far
                    yield "\n".join(lines), size, False
                    lines, chars, size = [], 0, 0
                lines.append(text)
                chars += len(text)
            size += len(line)
            if not text.strip() and lines:
                yield "\n".join(lines), size, True
                lines, chars, size = [], 0, 0
        yield "\n".join(lines), size, bool(lines)


def _batches(files: list[Path], text_field: str) -> Iterator[tuple[list[str], list[bool], int]]:
    """Texts in groups of about BATCH_CHARS characters, whether each ends a document, and the
    bytes of the files they took."""
    texts: list[str] = []
    ends: list[bool] = []
    chars = size = 0
    for path in files:
        for text, used, end in documents(path, text_field):
            size += used
            if text:
                texts.append(text)
                ends.append(end)
                chars += len(text)
            if chars >= BATCH_CHARS:
                yield texts, ends, size
                texts, ends, chars, size = [], [], 0, 0
    if texts or size:
        yield texts, ends, size


def _progress(files: list[Path], enabled: bool):  # noqa: ANN202
    from tqdm import tqdm

    total = sum(f.stat().st_size for f in files)
    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="tokenizing",
        file=sys.stderr,
        disable=not enabled,
        mininterval=1.0,
    )


class TextBatches(TokenFileBatches):
    """Batches of tokenized text (see the module doc): GPT windows as from a token file, BERT
    samples framed by [CLS] and [SEP] and masked with the tokenizer's own special tokens."""

    def __init__(self, *, meta: dict[str, Any], **kwargs: Any):
        bert = kwargs["arch"] == "bert"
        if meta["vocab_size"] > kwargs["vocab_size"]:  # before the ids are checked against it
            raise DataError(
                f"the tokenizer has {meta['vocab_size']} tokens, more than the model's vocabulary "
                f"of {kwargs['vocab_size']}; set model.vocab_size: {meta['vocab_size']} (or more)"
            )
        outside = {role: i for role, i in meta["special"].items() if i >= kwargs["vocab_size"]}
        if outside:  # a tokenizer with gaps in its ids; the file's own ids are checked next
            raise DataError(
                f"the tokenizer {meta['tokenizer']} gives its special tokens the ids "
                f"{', '.join(f'{role} {i}' for role, i in outside.items())}, outside the model's "
                f"vocabulary of {kwargs['vocab_size']} (ids 0 to {kwargs['vocab_size'] - 1}); set "
                f"model.vocab_size: {max(outside.values()) + 1} (or more)",
                field="model.vocab_size",
            )
        self.meta = meta
        super().__init__(
            path=meta["path"],
            token_dtype=meta["dtype"],
            row_len=kwargs["seq_len"] - 2 if bert else None,
            **kwargs,
        )
        self.special = meta["special"]
        self.random_vocab = meta["vocab_size"]
        if bert:
            self.mask_id = self.special["mask"]
            self.never_mask = torch.tensor([self.special["cls"], self.special["sep"]])

    def describe(self) -> str:
        return (
            f"the tokenized text {self.path}{self.part()} (data.path tokenized with the tokenizer "
            f"{self.meta['tokenizer']}, of {self.meta['vocab_size']} tokens)"
        )

    def frame(self, rows: torch.Tensor) -> torch.Tensor:
        if self.arch != "bert":
            return rows
        n = rows.shape[0]
        cls = torch.full((n, 1), self.special["cls"], dtype=rows.dtype)
        sep = torch.full((n, 1), self.special["sep"], dtype=rows.dtype)
        return torch.cat([cls, rows, sep], dim=1)


def tokenize_command(job: JobSpec, *, source: str) -> int:
    """``launch tokenize JOB.yaml``: fill the cache for the job's text (and its held-out text)
    and say where it is."""
    from launcher.errors import SpecError

    if job.data.source != "text":
        raise SpecError(
            f"data.source is {job.data.source!r}; launch tokenize works on data.source text",
            source=source,
            field="data.source",
        )
    texts = [("data.path", job.data)]
    if job.data.val_path is not None:  # the held-out text has a cache file of its own
        texts.append(("data.val_path", job.data.model_copy(update={"path": job.data.val_path})))
    for field, data in texts:
        try:
            meta = tokenize(data, job.model.arch)
        except (DataError, FolderError) as err:
            raise SpecError(str(err), source=source, field=getattr(err, "field", field)) from None
        print(
            f"{meta['path']}: {meta['tokens']} tokens from {meta['documents']} documents "
            f"({len(meta['files'])} files, vocabulary {meta['vocab_size']})"
        )
    return 0
