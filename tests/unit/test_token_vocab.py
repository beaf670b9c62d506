"""A token file's ids are checked against the model's vocabulary when the data are opened,
before the first step: a clear error naming the file, the id, its position and the vocabulary
(not a device-side assert or an IndexError in the embedding steps later). CPU."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import yaml

from launcher.train import data as data_module
from launcher.train.data import TokenFileBatches

CPU = torch.device("cpu")


def write_npy(path: Path, ids: torch.Tensor, descr: str) -> Path:
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': ({ids.numel()},), }}"
    header += " " * (-(10 + len(header) + 1) % 64) + "\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode()
                     + ids.contiguous().numpy().tobytes())
    return path


def batches(path: Path, vocab: int, *, arch: str = "gpt", seq: int = 16, **kw) -> TokenFileBatches:
    return TokenFileBatches(path=path, token_dtype="uint16", arch=arch, vocab_size=vocab, seq_len=seq,
                            micro_batch=2, grad_accum=1, mask_prob=0.15, seed=1, rank=0, world_size=1,
                            device=CPU, **kw)


def gpt2_ids(n: int) -> torch.Tensor:
    """uint16 ids spread over GPT-2's 50257 (most above the int16 range)."""
    return ((torch.arange(n, dtype=torch.int64) * 7919) % 50257).to(torch.uint16)


def test_an_id_outside_the_vocabulary_stops_the_worker_before_any_step(tmp_path: Path, monkeypatch,
                                                                        one_process_trainer_env: Path, capfd):
    """Through the trainer's entry point: exit 2, one paragraph naming file, id, position and
    vocabulary, and no step run."""
    from launcher.train import __main__ as entry
    from launcher.train.loop import Trainer

    ids = gpt2_ids(5_000)
    ids[3210] = 50300  # a GPT-2 vocabulary padded to 50304 by the writer, say
    tokens = write_npy(tmp_path / "tokens.npy", ids, "<u2")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "name": "vocab", "model": {"arch": "gpt", "size": "tiny", "vocab_size": 50257},
        "data": {"source": "tokens", "path": "tokens.npy", "seq_len": 16},
        "train": {"steps": 2, "warmup_steps": 0, "micro_batch": 2, "compile": False},
        "precision": {"dtype": "fp32"}, "resources": {"device": "cpu", "nodes": 1, "nproc_per_node": 1},
    }))
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
    assert not records.exists() or not any("step" in json.loads(line) for line in records.read_text().splitlines())


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_an_in_range_file_opens_and_its_batches_come_out(tmp_path: Path, monkeypatch, arch: str):
    ids = gpt2_ids(3_000)
    ids[1234] = 50256  # the last id of the vocabulary, above the int16 range
    seen: list[int] = []
    xor = torch.bitwise_xor
    monkeypatch.setattr(torch, "bitwise_xor", lambda t, *a, **k: seen.append(t.numel()) or xor(t, *a, **k))
    data = batches(write_npy(tmp_path / "t.npy", ids, "<u2"), 50257, arch=arch)
    assert sum(seen) == 3_000  # every id checked (in unsigned order: most read negative as int16)
    b = data.batch(1)
    assert int(b["input_ids"].max()) < 50257
    if arch == "gpt":
        assert torch.equal(b["input_ids"][0], ids[:16].to(torch.int64))
    data.close()


@pytest.mark.parametrize(("dtype", "descr", "vocab", "bad"), [
    (torch.uint16, "<u2", 50257, 50257),   # vocabulary past 2^15: compared in unsigned order
    (torch.uint16, "<u2", 30522, 40000),   # BERT's: an id past 2^15 reads negative in int16
    (torch.int32, "<i4", 1000, 1000),
    (torch.int32, "<i4", 1000, -100),      # an ignore-index written into the file
    (torch.int64, "<i8", 1000, 1 << 40),
])
def test_the_scan_is_chunked_and_finds_an_id_in_a_later_chunk(tmp_path: Path, monkeypatch, dtype, descr,
                                                                vocab: int, bad: int):
    chunk, n, at = 1_000, 10_500, 7_321  # eleven chunks, the last short; the bad id in the eighth
    ids = (torch.arange(n, dtype=torch.int64) * 7919 % vocab).to(dtype)
    ids[at] = bad
    path = write_npy(tmp_path / "t.npy", ids, descr)
    monkeypatch.setattr(data_module, "SCAN_CHUNK", chunk, raising=False)
    seen: list[int] = []  # the size of every tensor the scan reduces
    for name in ("aminmax", "bitwise_xor"):
        op = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda t, *a, _op=op, **k: seen.append(t.numel()) or _op(t, *a, **k))

    with pytest.raises(ValueError) as err:
        batches(path, vocab)
    assert seen == [chunk] * 10 + [n - 10 * chunk]  # every chunk read, none larger than SCAN_CHUNK
    message = str(err.value)
    assert f"holds token id {bad} at position {at} " in message
    assert f"the model's vocabulary has {vocab} entries" in message
    assert isinstance(err.value, data_module.DataError) and err.value.field == "data.path"


def test_scan_reports_the_first_bad_id_how_many_and_the_extremes():
    ids = torch.tensor([5, 9, -3, 2, 12, 0, -7, 11], dtype=torch.int32)
    found = data_module.scan_ids(ids, 10, chunk=3)
    assert found == (2, -3, 4, 12, -7)
    assert data_module.scan_ids(ids.clamp(0, 9), 10, chunk=3) is None


def test_a_model_folders_vocabulary_says_to_use_its_tokenizer(tmp_path: Path):
    ids = torch.arange(100, dtype=torch.int32)
    data_path = write_npy(tmp_path / "t.npy", ids, "<i4")
    with pytest.raises(ValueError, match=r"\(the vocab_size of model.init_from's /m/config.json\).*"
                                        r"write the file with the tokenizer of the model in model.init_from"):
        batches(data_path, 64, vocab_origin="the vocab_size of model.init_from's /m/config.json")


def test_a_file_shorter_than_one_sample_is_a_data_error(tmp_path: Path):
    with pytest.raises(ValueError, match="holds 10 tokens, fewer than the 17 of one sample") as err:
        batches(write_npy(tmp_path / "t.npy", torch.arange(10, dtype=torch.int32), "<i4"), 64)
    assert isinstance(err.value, data_module.DataError)  # reported by the worker as one paragraph


def test_tokenized_text_is_checked_the_same_way(tmp_path: Path):
    """Text ids exceed the model's vocabulary only for a tokenizer with gaps in its ids (its size,
    checked against the model's, is then below its largest id)."""
    from launcher.train.text import TextBatches, TextError

    ids = torch.arange(200, dtype=torch.int64) % 50
    ids[77] = 600
    (tmp_path / "c.bin").write_bytes(ids.to(torch.int32).numpy().tobytes())
    meta = {"path": str(tmp_path / "c.bin"), "dtype": "int32", "vocab_size": 60, "tokenizer": "/tok",
            "special": {"eos": 3}}
    common = dict(arch="gpt", vocab_size=512, seq_len=16, micro_batch=2, grad_accum=1, mask_prob=0.15,
                  seed=1, rank=0, world_size=1, device=CPU)
    with pytest.raises(TextError, match=r"the tokenized text .*c.bin \(data.path tokenized with the tokenizer "
                                        r"/tok, of 60 tokens\) holds token id 600 at position 77"):
        TextBatches(meta=meta, **common)
    with pytest.raises(TextError, match="special tokens the ids eos 700, outside the model's vocabulary of 512"):
        TextBatches(meta={**meta, "special": {"eos": 700}}, **common)
    assert TextError is data_module.DataError  # what launcher.train.__main__ reports as one paragraph


def test_a_tokenizer_with_ids_past_its_size_tokenizes_and_is_refused_clearly(tmp_path: Path):
    tokenizers = pytest.importorskip("tokenizers")
    from launcher.spec.job import DataSpec
    from launcher.train import text

    folder = tmp_path / "tok"
    folder.mkdir()
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {"[UNK]": 0, "a": 1, "<|endoftext|>": 2, "b": 70_000}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (tmp_path / "c.txt").write_text("a a a a b a\n\n" * 10)
    spec = DataSpec(source="text", seq_len=8, path=tmp_path / "c.txt", tokenizer=folder,
                    cache_dir=tmp_path / "cache")
    meta = text.tokenize(spec, "gpt", progress=False)  # 4 tokens, an id of 70000: int32, not uint16
    assert meta["dtype"] == "int32" and meta["vocab_size"] == 4
    with pytest.raises(text.TextError, match="holds token id 70000 at position 4 "):
        text.TextBatches(meta=meta, arch="gpt", vocab_size=512, seq_len=8, micro_batch=2, grad_accum=1,
                         mask_prob=0.15, seed=1, rank=0, world_size=1, device=CPU)
