"""A token file's ids are checked against the model's vocabulary when the data are opened,
before the first step: a clear error naming the file, the id, its position and the vocabulary
(not a device-side assert or an IndexError in the embedding steps later). CPU."""

from __future__ import annotations

import json
import logging
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from fixtures.batching import source, token_file, write_npy
from fixtures.ranks import run_ranks
from fixtures.tiny_job import tiny_job

from launcher.spec.job import DataSpec
from launcher.train import __main__ as entry
from launcher.train import data as data_module
from launcher.train import text
from launcher.train import tokens as tokens_module
from launcher.train.loop import Trainer
from launcher.train.tokens import TokenFileBatches


def batches(path: Path, vocab: int, *, arch: str = "gpt", seq: int = 16, **kw) -> TokenFileBatches:
    return token_file(path, arch, vocab=vocab, seq=seq, micro=2, seed=1, **kw)


def reductions(monkeypatch, names=("aminmax", "bitwise_xor")) -> list[int]:
    """The size of every tensor the scan reduces through ``torch.<name>``, as it runs."""
    seen: list[int] = []
    for name in names:
        op = getattr(torch, name)
        monkeypatch.setattr(
            torch, name, lambda t, *a, _op=op, **k: seen.append(t.numel()) or _op(t, *a, **k)
        )
    return seen


def gpt2_ids(n: int) -> torch.Tensor:
    """uint16 ids spread over GPT-2's 50257 (most above the int16 range)."""
    return ((torch.arange(n, dtype=torch.int64) * 7919) % 50257).to(torch.uint16)


def test_an_id_outside_the_vocabulary_stops_the_worker_before_any_step(
    tmp_path: Path, monkeypatch, one_process_trainer_env: Path, capfd
):
    """Through the trainer's entry point: exit 2, one paragraph naming file, id, position and
    vocabulary, and no step run."""
    ids = gpt2_ids(5_000)
    ids[3210] = 50300  # a GPT-2 vocabulary padded to 50304 by the writer, say
    tokens = write_npy(tmp_path / "tokens.npy", ids, "<u2")
    spec = tiny_job(model={"vocab_size": 50257}, data={"source": "tokens", "path": "tokens.npy"})
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))

    def no_step(self, step: int):
        raise AssertionError(f"step {step} ran: the bad id was not found before the first step")

    monkeypatch.setattr(Trainer, "train_step", no_step)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # main's basicConfig(force=True)
    monkeypatch.setattr(root, "level", root.level)

    assert entry.main(["--job", str(job)]) == 2
    err = capfd.readouterr().err.strip()
    assert "\n" not in err  # one paragraph, no traceback
    assert f"token file {tokens.resolve()} holds token id 50300 at position 3210" in err
    assert "the model's vocabulary has 50257 entries, ids 0 to 50256 (model.vocab_size)" in err
    assert "ids outside 0..50256: 1 of the file's 5000, the largest 50300" in err
    assert "set model.vocab_size: 50301 (or more)" in err
    assert err.startswith(f"{job}, field 'data.path': ")
    records = one_process_trainer_env.with_name("rank0.jsonl")
    assert not records.exists() or not any(
        "step" in json.loads(line) for line in records.read_text().splitlines()
    )


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_an_in_range_file_opens_and_its_batches_come_out(tmp_path: Path, monkeypatch, arch: str):
    ids = gpt2_ids(3_000)
    ids[1234] = 50256  # the last id of the vocabulary, above the int16 range
    seen = reductions(monkeypatch, ["bitwise_xor"])
    data = batches(write_npy(tmp_path / "t.npy", ids, "<u2"), 50257, arch=arch)
    assert sum(seen) == 3_000  # every id checked (in unsigned order: most read negative as int16)
    b = data.batch(1)
    assert int(b["input_ids"].max()) < 50257
    if arch == "gpt":
        assert torch.equal(b["input_ids"][0], ids[:16].to(torch.int64))
    data.close()


@pytest.mark.parametrize(
    ("dtype", "descr", "vocab", "bad"),
    [
        (torch.uint16, "<u2", 50257, 50257),  # vocabulary past 2^15: compared in unsigned order
        (torch.uint16, "<u2", 30522, 40000),  # BERT's: an id past 2^15 reads negative in int16
        (torch.int32, "<i4", 1000, 1000),
        (torch.int32, "<i4", 1000, -100),  # an ignore-index written into the file
        (torch.int64, "<i8", 1000, 1 << 40),
        (torch.uint32, "<u4", 1000, 3_000_000_000),  # read negative in int32
        (torch.uint16, "<u2", 50257, 65535),  # read as -1 in int16
    ],
)
def test_the_scan_is_chunked_and_finds_an_id_in_a_later_chunk(
    tmp_path: Path, monkeypatch, dtype, descr, vocab: int, bad: int
):
    chunk, n, at = 1_000, 10_500, 7_321  # eleven chunks, the last short; the bad id in the eighth
    ids = (torch.arange(n, dtype=torch.int64) * 7919 % vocab).to(dtype)
    ids[at] = bad
    path = write_npy(tmp_path / "t.npy", ids, descr)
    monkeypatch.setattr(tokens_module, "SCAN_CHUNK", chunk, raising=False)
    seen = reductions(monkeypatch)
    with pytest.raises(ValueError) as err:
        batches(path, vocab)
    assert seen == [chunk] * 8  # chunk by chunk, none larger than SCAN_CHUNK, up to the bad id's
    message = str(err.value)
    assert f"holds token id {bad} at position {at} " in message
    assert f"the model's vocabulary has {vocab} entries" in message
    assert f"1 of the {chunk} from position 7000 (the check stops at the first chunk" in message
    assert isinstance(err.value, data_module.DataError) and err.value.field == "data.path"
    ids[at] = 0
    seen.clear()
    batches(write_npy(tmp_path / "t.npy", ids, descr), vocab)
    assert seen == [chunk] * 10 + [n - 10 * chunk]  # a clean file: every chunk read


def test_scan_reports_the_first_bad_id_and_stops_at_its_chunk():
    ids = torch.tensor([5, 9, -3, 2, 12, 0, -7, 11], dtype=torch.int32)
    found = tokens_module.scan_ids(ids, 10, chunk=3)
    assert found == (2, -3, 1, None, -3, 0, 3)  # position, id, count, top, low, chunk start, span
    assert tokens_module.scan_ids(ids, 10, chunk=3, start=3) == (4, 12, 1, 12, None, 3, 3)
    assert tokens_module.scan_ids(ids, 10, chunk=8) == (2, -3, 4, 12, -7, 0, 8)
    assert tokens_module.scan_ids(ids.clamp(0, 9), 10, chunk=3) is None


@pytest.mark.parametrize(
    ("dtype", "vocab"),
    [
        (torch.uint16, 30522),
        (torch.uint16, 50257),
        (torch.uint16, 1 << 15),
        (torch.uint8, 200),
        (torch.int32, 1000),
        (torch.uint32, 1 << 31),
        (torch.int64, 1000),
    ],
)
def test_the_first_bad_chunk_is_read_as_the_widened_ids_say(dtype: torch.dtype, vocab: int):
    """The first bad chunk is searched in the file's type (uint16 and uint32 through their signed
    views): the same first id, count and extremes as reading it widened to int64."""
    gen = torch.Generator().manual_seed(vocab)
    top = min(torch.iinfo(dtype).max, 1 << 40)
    for trial in range(20):
        wide = torch.randint(0, vocab, (777,), generator=gen)
        picks = torch.randint(0, 777, (trial % 4,), generator=gen)
        wide[picks] = torch.randint(vocab, top + 1, (picks.numel(),), generator=gen)
        if dtype.is_signed and trial % 3 == 0:
            wide[picks[:1]] = -100
        ids = wide.to(dtype)
        low_bits = None
        if dtype in tokens_module._SIGNED_VIEWS:
            view, low_bits = tokens_module._SIGNED_VIEWS[dtype]
            ids = ids.view(view)
        found = tokens_module.scan_ids(ids, vocab, low_bits=low_bits, chunk=100)
        bad = ((wide >= vocab) | (wide < 0)).nonzero().view(-1)
        if not bad.numel():
            assert found is None
            continue
        begin = int(bad[0]) // 100 * 100
        part = wide[begin : begin + 100]
        outside = part[(part >= vocab) | (part < 0)]
        assert found == (
            int(bad[0]),
            int(wide[bad[0]]),
            outside.numel(),
            int(outside.max()) if bool((outside >= vocab).any()) else None,
            int(outside.min()) if bool((outside < 0).any()) else None,
            begin,
            part.numel(),
        )


def test_a_wrong_vocabulary_stops_the_scan_at_the_first_chunk(tmp_path: Path, monkeypatch):
    """Every chunk holds ids outside a vocabulary too small for the file: only the first is read,
    and of it only the bad ids are widened (widening every chunk cost ~18 ns an id); the message
    says where the check stopped."""
    chunk, n = 1_000, 10_500
    path = write_npy(tmp_path / "t.npy", gpt2_ids(n), "<u2")
    monkeypatch.setattr(tokens_module, "SCAN_CHUNK", chunk)
    widened: list[int] = []
    to = torch.Tensor.to
    monkeypatch.setattr(
        torch.Tensor,
        "to",
        lambda t, *a, **k: (
            (widened.append(t.numel()) if a and a[0] is torch.int64 else None) or to(t, *a, **k)
        ),
    )
    with pytest.raises(data_module.DataError) as err:
        batches(path, 30522)
    assert widened == [392]  # the first chunk's ids 30522 and up
    message = str(err.value)
    assert "holds token id 31676 at position 4 " in message  # 4 * 7919
    assert (
        "ids outside 0..30521: 392 of the 1000 from position 0 (the check stops at the first chunk"
        in message
    )
    assert (
        "set model.vocab_size above the file's largest id (at least 50211; the ids after position 999 "
        "were not checked)"
    ) in message


@pytest.mark.parametrize(
    ("dtype", "descr", "vocab"),
    [(torch.uint16, "<u2", 65536), (torch.uint16, "<u2", 100_000), (torch.uint8, "|u1", 256)],
)
def test_a_file_whose_type_cannot_hold_a_bad_id_is_not_read(
    tmp_path: Path, monkeypatch, dtype, descr, vocab
):
    ids = (torch.arange(3_000, dtype=torch.int64) * 7919 % 65536).to(dtype)
    ids[17] = -1 if dtype == torch.uint8 else 65535  # the type's largest id, inside the vocabulary
    path = write_npy(tmp_path / "t.npy", ids.to(dtype) if dtype == torch.uint8 else ids, descr)
    seen = reductions(monkeypatch)
    data = batches(path, vocab)
    assert seen == []
    assert int(data.batch(1)["input_ids"].max()) < vocab
    data.close()
    if vocab >= 1 << 16:
        top_ids = torch.full((5,), -1, dtype=torch.int16)  # 65535 as uint16
        assert tokens_module.scan_ids(top_ids, vocab, low_bits=0xFFFF) is None
    # Signed ids are read whatever the vocabulary: a negative id fits none.
    negative = tokens_module.scan_ids(torch.tensor([1, -100, 2], dtype=torch.int32), 1 << 31)
    assert negative == (1, -100, 1, None, -100, 0, 3)
    assert seen


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", [1, 7, 999, 1_000, 1_001, 2_999, 10_500, 12_345])
def test_the_ranks_slices_cover_every_chunk_once(world: int, n: int):
    chunk = 1_000
    slices = [tokens_module.scan_slice(n, rank, world, chunk=chunk) for rank in range(world)]
    assert slices[0][0] == 0 and slices[-1][1] == n
    for (_, stop), (start, _) in zip(slices, slices[1:], strict=False):
        assert stop == start  # back to back: every id once, in order
    chunks = -(-n // chunk)
    counts = [-(-(stop - start) // chunk) for start, stop in slices]
    assert sum(counts) == chunks and max(counts) - min(counts) <= 1  # whole chunks, dealt evenly
    assert all(start % chunk == 0 for start, _ in slices)  # on the whole file's chunk boundaries

    # A bad id in any chunk, at its start or end: exactly the rank whose slice holds it finds it,
    # as the whole file's scan does.
    ids = torch.arange(n, dtype=torch.int32) % 50
    for at in sorted(
        {p for c in range(chunks) for p in (c * chunk, min(c * chunk + chunk, n) - 1)}
    ):
        ids[at] = 77
        found = [
            tokens_module.scan_ids(ids, 50, chunk=chunk, start=start, stop=stop)
            for start, stop in slices
        ]
        assert [bad is not None for bad in found] == [start <= at < stop for start, stop in slices]
        assert min((b for b in found if b), key=lambda b: b.position) == tokens_module.scan_ids(
            ids, 50, chunk=chunk
        )
        ids[at] = at % 50


def _split_scan_worker(
    rank: int, world: int, port: int, paths: list[str], out: str, chunk: int
) -> None:
    tokens_module.SCAN_CHUNK = chunk  # this rank's process only
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    seen: list[int] = []
    aminmax = torch.aminmax
    torch.aminmax = lambda t, *a, **k: seen.append(t.numel()) or aminmax(t, *a, **k)
    try:
        batches(Path(paths[rank]), 1000, token_dtype="int32", rank=rank, world=world).close()
        result = {"error": None}
    except data_module.DataError as err:
        result = {"error": str(err), "field": err.field}
    finally:
        torch.aminmax = aminmax
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps({**result, "seen": seen}))


@pytest.mark.processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad_at", [[8_765], [1_234, 8_765], [], "sizes differ"])
def test_two_gloo_ranks_split_the_scan_and_raise_the_same_error(
    tmp_path: Path, monkeypatch, bad_at
):
    """Two processes of a gloo group each read half the chunks (0-4 and 5-10 of eleven) and
    agree: the file's first bad id (the one a lone process reports), raised by both ranks."""
    chunk, n = 1_000, 10_500
    ids = torch.arange(n, dtype=torch.int32) % 1000
    for at in bad_at if isinstance(bad_at, list) else []:
        ids[at] = 5_000 + at
    paths = [str(write_npy(tmp_path / "t.npy", ids, "<i4"))] * 2
    if bad_at == "sizes differ":
        paths[1] = str(write_npy(tmp_path / "other.npy", ids[:9_000], "<i4"))
    run_ranks(_split_scan_worker, 2, paths, str(tmp_path), chunk)
    monkeypatch.setattr(tokens_module, "SCAN_CHUNK", chunk)  # for the lone process's scan below
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    if bad_at == "sizes differ":  # (the nodes' data.path would be one path)
        for rank in range(2):
            assert got[rank]["error"].endswith(
                "holds 10500 token ids on rank 0 but 9000 on rank 1: every node "
                "must see the same file at data.path"
            )
        return
    assert got[0]["error"] == got[1]["error"]
    # rank 0: chunks 0-4, rank 1: chunks 5-10, each up to a bad one
    assert got[0]["seen"] == [chunk] * (2 if 1_234 in bad_at else 5)
    assert got[1]["seen"] == ([chunk] * 4 if bad_at else [chunk] * 5 + [500])
    if not bad_at:
        assert got[0]["error"] is None
        return
    with pytest.raises(data_module.DataError) as alone:
        batches(Path(paths[0]), 1000)
    assert got[0]["error"] == str(alone.value) and got[0]["field"] == "data.path"
    assert f"holds token id {5_000 + bad_at[0]} at position {bad_at[0]} " in got[0]["error"]


def test_a_model_folders_vocabulary_says_to_use_its_tokenizer(tmp_path: Path):
    ids = torch.arange(100, dtype=torch.int32)
    data_path = write_npy(tmp_path / "t.npy", ids, "<i4")
    with pytest.raises(
        ValueError,
        match=r"\(the vocab_size of model.init_from's /m/config.json\).*"
        r"write the file with the tokenizer of the model in model.init_from",
    ):
        batches(data_path, 64, vocab_origin="the vocab_size of model.init_from's /m/config.json")


def test_a_file_shorter_than_one_sample_is_a_data_error(tmp_path: Path):
    """A DataError: the worker reports it as one paragraph."""
    short = "holds 10 tokens, fewer than the 17 of one sample.*shorter seq_len"
    with pytest.raises(data_module.DataError, match=short):
        batches(write_npy(tmp_path / "t.npy", torch.arange(10, dtype=torch.int32), "<i4"), 64)


def test_tokenized_text_is_checked_the_same_way(tmp_path: Path):
    """Text ids exceed the model's vocabulary only for a tokenizer with gaps in its ids (its size,
    checked against the model's, is then below its largest id)."""
    ids = torch.arange(200, dtype=torch.int64) % 50
    ids[77] = 600
    (tmp_path / "c.bin").write_bytes(ids.to(torch.int32).numpy().tobytes())
    path = str(tmp_path / "c.bin")
    meta = dict(path=path, dtype="int32", vocab_size=60, tokenizer="/tok", special={"eos": 3})
    common = dict(arch="gpt", cls=text.TextBatches, vocab=512, seq=16, micro=2, seed=1)
    with pytest.raises(
        data_module.DataError,
        match=r"the tokenized text .*c.bin \(data.path tokenized with the tokenizer "
        r"/tok, of 60 tokens\) holds token id 600 at position 77",
    ):
        source(meta=meta, **common)
    pattern = "special tokens the ids eos 700, outside the model's vocabulary of 512"
    with pytest.raises(data_module.DataError, match=pattern):
        source(meta={**meta, "special": {"eos": 700}}, **common)
    assert data_module.DataError in entry.INPUT_ERRORS  # reported as one paragraph, exit 2


def test_a_tokenizer_with_ids_past_its_size_tokenizes_and_is_refused_clearly(tmp_path: Path):
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path / "tok"
    folder.mkdir()
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel(
            {"[UNK]": 0, "a": 1, "<|endoftext|>": 2, "b": 70_000}, unk_token="[UNK]"
        )
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (tmp_path / "c.txt").write_text("a a a a b a\n\n" * 10)
    spec = DataSpec(
        source="text",
        seq_len=8,
        path=tmp_path / "c.txt",
        tokenizer=folder,
        cache_dir=tmp_path / "cache",
    )
    meta = text.tokenize(spec, "gpt", progress=False)  # 4 tokens, an id of 70000: int32, not uint16
    assert meta["dtype"] == "int32" and meta["vocab_size"] == 4
    with pytest.raises(data_module.DataError, match="holds token id 70000 at position 4 "):
        source("gpt", cls=text.TextBatches, meta=meta, vocab=512, seq=8, micro=2, seed=1)
