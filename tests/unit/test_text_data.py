"""data.source text: documents, the token cache and its key, BERT and GPT packing and masking."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("tokenizers", reason="text data needs the tokenizers library (hf extra)")

from fixtures.batching import equals_one_at_a_time, recording  # noqa: E402
from fixtures.hf_assets import make_assets  # noqa: E402
from fixtures.tiny_job import tiny_job  # noqa: E402

from launcher.cli import main as cli_main  # noqa: E402
from launcher.errors import SpecError  # noqa: E402
from launcher.spec import load_job  # noqa: E402
from launcher.spec.hf import load_tokenizer  # noqa: E402
from launcher.train import text  # noqa: E402
from launcher.train.data import build_data, build_val_batches  # noqa: E402

SEQ = 32


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    """Generated text (~200 KB), a WordPiece tokenizer (BERT) and a byte-level BPE (GPT)."""
    root = tmp_path_factory.mktemp("text")
    m = make_assets()
    corpus = m.write_text(root / "text" / "corpus.txt", n_bytes=200_000)
    return {
        "root": root,
        "corpus": corpus,
        "bert_tok": m.train_tokenizer([corpus], root / "wordpiece", vocab_size=300),
        "gpt_tok": m.train_tokenizer([corpus], root / "bpe", kind="bpe", vocab_size=400),
    }


def job(
    tmp_path: Path, assets: dict[str, Path], arch: str = "bert", path: Path | None = None, **data
):
    """A job on ``path`` (the corpus) with its arch's tokenizer, loaded from job.yaml."""
    data = {
        "source": "text",
        "seq_len": SEQ,
        "path": str(path or assets["corpus"]),
        "tokenizer": str(assets["bert_tok" if arch == "bert" else "gpt_tok"]),
        "cache_dir": str(tmp_path / "cache"),
        **data,
    }
    spec = tiny_job(arch, model={"vocab_size": 512}, data=data, micro_batch=4, grad_accum=2)
    file = tmp_path / "job.yaml"
    file.write_text(yaml.safe_dump(spec))
    return load_job(file)


def stream(meta: dict) -> torch.Tensor:
    """The tokenized text's ids (uint16), widened."""
    return torch.from_file(meta["path"], size=meta["tokens"], dtype=torch.uint16).long()


def test_documents_are_paragraphs_or_jsonl_lines(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("one\ntwo\n\n\nthree\n\nfour")
    docs = [(d, end) for d, _, end in text.documents(txt, "text")]
    assert docs == [("one\ntwo", True), ("three", True), ("four", True)]
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text('{"body": "x y"}\n\n{"body": "z", "id": 3}\n')
    assert [d for d, _, end in text.documents(jsonl, "body") if end] == ["x y", "z"]
    jsonl.write_text('{"text": "x"}\n')
    with pytest.raises(text.DataError, match="line 1 is not a JSON object with a 'body' string"):
        list(text.documents(jsonl, "body"))


def test_the_stream_is_each_document_then_a_separator(tmp_path, assets):
    j = job(tmp_path, assets)
    meta = text.tokenize(j.data, "bert", progress=False)
    ids = stream(meta).tolist()
    tok = load_tokenizer(assets["bert_tok"])
    sep = meta["special"]["sep"]
    docs = [d for d, _, _ in text.documents(assets["corpus"], "text")]
    want = [i for d in docs for i in [*tok.encode(d, add_special_tokens=False).ids, sep]]
    assert ids == want and meta["documents"] == len(docs) and ids.count(sep) == len(docs)
    cls, mask = tok.token_to_id("[CLS]"), tok.token_to_id("[MASK]")
    assert meta["special"] == {"cls": cls, "sep": sep, "mask": mask}


def test_a_long_paragraph_is_tokenized_in_pieces_with_the_same_ids(tmp_path, assets, monkeypatch):
    one = tmp_path / "one"
    one.mkdir()
    (one / "long.txt").write_text("\n".join(["the cat sees a red house"] * 400))  # no blank line
    whole = text.tokenize(job(tmp_path, assets, path=one).data, "bert", progress=False)
    monkeypatch.setattr(text, "BATCH_CHARS", 1000)
    pieces = text.tokenize(
        job(tmp_path, assets, path=one, cache_dir=str(tmp_path / "c2")).data, "bert", progress=False
    )
    assert Path(whole["path"]).read_bytes() == Path(pieces["path"]).read_bytes()
    assert whole["documents"] == pieces["documents"] == 1


def test_the_cache_is_reused_and_keyed_by_text_and_tokenizer(tmp_path, assets):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(assets["corpus"].read_text()[:20_000])
    (folder / "sub" / "b.jsonl").write_text(json.dumps({"text": "the cat sees a red house"}) + "\n")
    (folder / ".hidden.txt").write_text("never read")
    j = job(tmp_path, assets, path=folder)
    first = text.tokenize(j.data, "bert", progress=False)
    assert first["files"] == [str(folder / "a.txt"), str(folder / "sub" / "b.jsonl")]
    stamp = os.stat(first["path"]).st_mtime_ns
    again = text.tokenize(j.data, "bert", progress=False)
    assert again["path"] == first["path"] and os.stat(again["path"]).st_mtime_ns == stamp
    (folder / "sub" / "b.jsonl").write_text(json.dumps({"text": "a dog likes an apple"}) + "\n")
    changed = text.tokenize(j.data, "bert", progress=False)
    assert changed["path"] != first["path"]
    config = assets["bert_tok"] / "tokenizer_config.json"
    saved = config.read_text()
    try:  # another special token name is another tokenization
        config.write_text(json.dumps({**json.loads(saved), "sep_token": "[PAD]"}))
        assert text.cache_paths(j.data, "bert")[0] != Path(changed["path"])
    finally:
        config.write_text(saved)
    assert text.cache_paths(j.data, "gpt")[0] != Path(changed["path"])


def test_bert_samples_are_framed_and_never_mask_specials(tmp_path, assets):
    j = job(tmp_path, assets)
    meta = text.tokenize(j.data, "bert", progress=False)
    data = build_data(j, rank=0, world_size=1, device=torch.device("cpu"))
    cls, sep, mask = (meta["special"][k] for k in ("cls", "sep", "mask"))
    ids_in_file = stream(meta)
    for step in (1, 2):
        for micro in (0, 1):
            b = data.batch(step, micro)
            ids, pos, labels = b["input_ids"], b["mask_pos"], b["labels"]
            assert ids.shape == (4, SEQ) and pos.shape == (4, data.n_mask)
            original = ids.scatter(1, pos, labels)
            assert (original[:, 0] == cls).all() and (original[:, -1] == sep).all()
            for g, row in enumerate(original, start=micro * 4):  # window g of the step
                start = ((step - 1) * 8 + g) * (SEQ - 2)
                assert torch.equal(row[1:-1], ids_in_file[start : start + SEQ - 2])
            assert not torch.isin(labels, torch.tensor([cls])).any()  # [CLS] is never a target
            assert not ((pos == 0) | (pos == SEQ - 1)).any()
            assert (ids.gather(1, pos) == mask).float().mean() > 0.5  # 80% [MASK]
            assert int(ids.max()) < meta["vocab_size"]


@pytest.mark.parametrize("arch", ["bert", "gpt"])
def test_text_chunks_made_by_the_worker_thread_equal_batches_made_one_at_a_time(
    tmp_path, assets, arch
):
    data = build_data(job(tmp_path, assets, arch), rank=1, world_size=2, device=torch.device("cpu"))
    assert data.steps_ahead == 16
    made = recording(data)
    for step, micro in [(s, a) for s in range(1, 16 * 3 + 1) for a in range(2)]:
        assert equals_one_at_a_time(data, step, micro), (step, micro)
    threads = [thread.name for _, thread in made]
    assert threads[0] == "MainThread" and all(t.startswith("launcher-data") for t in threads[1:3])
    assert equals_one_at_a_time(data, 2, 0)  # a jump back
    data.close()


def test_gpt_windows_shift_by_one_over_eos_separated_text(tmp_path, assets):
    j = job(tmp_path, assets, arch="gpt")
    meta = text.tokenize(j.data, "gpt", progress=False)
    eos = load_tokenizer(assets["gpt_tok"]).token_to_id("<|endoftext|>")
    assert meta["special"] == {"eos": eos}
    data = build_data(j, rank=1, world_size=2, device=torch.device("cpu"))
    ids = stream(meta)
    b = data.batch(3, 1)
    assert torch.equal(b["input_ids"][:, 1:], b["labels"][:, :-1])
    g = 1 * (2 * 4) + 1 * 4  # micro 1, rank 1 of 2, micro-batch 4: global index of row 0
    start = (2 * 16 + g) * SEQ
    assert torch.equal(b["input_ids"][0], ids[start : start + SEQ])
    assert (ids == eos).sum() == meta["documents"]


def test_other_local_ranks_wait_for_local_rank_0(tmp_path, assets, monkeypatch):
    j = job(tmp_path, assets)
    monkeypatch.setenv("LOCAL_RANK", "1")
    found: dict = {}
    waiter = threading.Thread(
        target=lambda: found.update(text.prepare(j.data, "bert", poll_s=0.02))
    )
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive() and not found  # nothing tokenized yet: rank 1 waits
    made = text.tokenize(j.data, "bert", progress=False)
    waiter.join(timeout=10)
    assert not waiter.is_alive() and found["path"] == made["path"]


@pytest.mark.parametrize(
    ("path", "tokenizer", "model", "refusal"),
    [
        (
            "corpus",
            "bert-base-uncased",
            {},
            "data.tokenizer 'bert-base-uncased' is not a local folder",
        ),
        (
            "corpus",
            "bert_tok",
            {"vocab_size": 64},
            "{size} tokens, more than the model's vocabulary of 64; set model.vocab_size: {size}",
        ),
        ("empty", "bert_tok", {}, "neither a .txt or .jsonl file nor a folder holding some"),
        (
            "corpus",
            "bert_tok",
            {"arch": "gpt"},
            "packing text for GPT needs a eos token, and '<|endoftext|>'",
        ),
    ],
)
def test_text_specs_are_checked_when_the_job_loads(
    tmp_path, assets, path, tokenizer, model, refusal
):
    (tmp_path / "empty").mkdir()
    data = {"source": "text", "seq_len": SEQ, "path": str(assets.get(path, tmp_path / path))}
    data["tokenizer"] = str(assets.get(tokenizer, tokenizer))
    model = {"arch": "bert", "size": "tiny", "vocab_size": 512, **model}
    file = tmp_path / "bad.yaml"
    file.write_text(
        yaml.safe_dump({"name": "t", "model": model, "data": data, "resources": {"device": "cpu"}})
    )
    size = load_tokenizer(assets["bert_tok"]).get_vocab_size()
    with pytest.raises(SpecError, match=refusal.format(size=size)):
        load_job(file)


def test_launch_tokenize_fills_the_caches_of_the_text_and_held_out_text(tmp_path, assets, capsys):
    held_out = tmp_path / "val.txt"
    held_out.write_text("One held-out paragraph.\n\nAnd another, a little longer than it.\n" * 20)
    j = job(tmp_path, assets, val_path=str(held_out))
    file = tmp_path / "job.yaml"
    assert cli_main(["tokenize", str(file)]) == 0
    out = capsys.readouterr().out
    for data in (j.data, j.data.model_copy(update={"path": held_out})):
        bin_path, meta_path = text.cache_paths(data, "bert")
        assert meta_path.is_file() and f"{bin_path}: " in out
    synthetic = {**yaml.safe_load(file.read_text()), "data": {"source": "synthetic"}}
    file.write_text(yaml.safe_dump(synthetic))
    assert cli_main(["tokenize", str(file)]) == 2
    assert "launch tokenize works on data.source text" in capsys.readouterr().err


def test_text_goes_on_at_the_next_sample_after_a_restart_at_another_world_size(tmp_path, assets):
    """BERT on text: 2 ranks x grad_accum 2 for 3 steps, then 1 rank x grad_accum 4 resumed
    after step 3: every step's samples (words and masks) are an uninterrupted 1-rank run's."""

    def samples(world: int, accum: int, steps: range, resume: bool = False) -> torch.Tensor:
        j = job(tmp_path, assets)
        j = j.model_copy(update={"train": j.train.model_copy(update={"grad_accum": accum})})
        parts = []
        for rank in range(world):
            data = build_data(j, rank=rank, world_size=world, device=torch.device("cpu"))
            if resume:
                data.continue_at(steps.start - 1, (steps.start - 1) * 16)
            parts.append([data.batch(s, a)["input_ids"] for s in steps for a in range(accum)])
        # global order: step, micro-batch, rank
        return torch.cat([parts[r][i] for i in range(len(steps) * accum) for r in range(world)])

    uninterrupted = samples(1, 4, range(1, 7))
    restarted = torch.cat([samples(2, 2, range(1, 4)), samples(1, 4, range(4, 7), resume=True)])
    assert torch.equal(restarted, uninterrupted)


def test_held_out_text_is_the_end_of_the_stream_or_a_file_of_its_own(tmp_path, assets):
    """data.val_fraction: training reads the first 90% of the tokenized text, evaluations the
    last 10%; data.val_path: evaluations read another text, tokenized into its own cache file."""
    j = job(tmp_path, assets, arch="gpt", val_fraction=0.1)
    meta = text.tokenize(j.data, "gpt", progress=False)
    ids = stream(meta)
    cut = round(0.9 * meta["tokens"])
    cpu = torch.device("cpu")
    trained = build_data(j, rank=0, world_size=1, device=cpu)
    held_out = build_data(j, rank=0, world_size=1, device=cpu, held_out=True)
    try:
        assert trained.ids.numel() == cut and held_out.ids.numel() == meta["tokens"] - cut
        assert torch.equal(held_out.batch(1)["input_ids"][0], ids[cut : cut + SEQ])
        assert "data.val_fraction 0.1" in held_out.describe()
        last = trained.n_windows - 1  # the last training window ends before the cut
        assert last * SEQ + SEQ + 1 <= cut
    finally:
        trained.close()
        held_out.close()
    other = tmp_path / "val.txt"
    other.write_text(
        "A held-out paragraph of its own.\n\nAnd a second one, a little longer.\n" * 40
    )
    k = job(tmp_path, assets, arch="gpt", val_path=str(other))
    k = k.model_copy(update={"train": k.train.model_copy(update={"eval_steps": 2})})
    batches = build_val_batches(k, rank=0, world_size=1, device=cpu)
    other_meta = text.tokenize(k.data.model_copy(update={"path": other}), "gpt", progress=False)
    assert other_meta["path"] != meta["path"] and len(batches) == 2
    assert torch.equal(batches[0]["input_ids"][0], stream(other_meta)[:SEQ])
