"""model.init_from: Hugging Face BERT and GPT-2 weights in the built-in models compute the same
function (logits within 1e-5, equal loss; fp32, CPU, dropout off), every tensor is accounted
for, and export writes them back bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from fixtures.batching import source

pytest.importorskip(
    "transformers", reason="the parity tests build Hugging Face models (test extra)"
)
pytest.importorskip("safetensors", reason="Hugging Face folders hold model.safetensors (hf extra)")

from fixtures.hf_assets import TINY, save_bert, save_gpt2  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from launcher.errors import SpecError  # noqa: E402
from launcher.spec import load_job  # noqa: E402
from launcher.spec.hf import FolderError  # noqa: E402
from launcher.train.hf import hf_state_dict, load_pretrained, save_pretrained  # noqa: E402
from launcher.train.model import build_model  # noqa: E402

SEQ = 24


def model_spec(tmp_path: Path, **model):
    """The model spec of a job with ``model``, loaded (so checked) as the launcher loads it."""
    cpu = {"resources": {"device": "cpu"}, "precision": {"dtype": "fp32"}}
    job = {"name": "hf", "model": model, "data": {"seq_len": SEQ}, **cpu}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return load_job(tmp_path / "job.yaml").model


def built_in(tmp_path: Path, folder: Path, **model):
    """The job's model spec (shape from config.json) and the built-in model loaded from ``folder``."""
    spec = model_spec(tmp_path, init_from=str(folder), **model)
    torch.manual_seed(1)
    ours = build_model(spec)
    load_pretrained(ours, spec, device=torch.device("cpu"))
    return spec, ours.eval()


def batch(arch: str, seed: int = 3) -> dict[str, torch.Tensor]:
    data = source(arch, vocab=TINY["vocab_size"], seq=SEQ, micro=3, seed=seed)
    return data.batch(1)


def test_bert_mlm_logits_and_loss_match_hugging_face(tmp_path):
    hf = save_bert(tmp_path / "bert")
    spec, ours = built_in(tmp_path, tmp_path / "bert")
    dims = dict(n_layers=2, d_model=32, n_heads=4, d_ff=64, vocab_size=96, max_positions=40)
    assert spec.arch == "bert" and spec.dims() == dims
    b = batch("bert")
    hf_labels = torch.full_like(b["input_ids"], -100).scatter(1, b["mask_pos"], b["labels"])
    with torch.no_grad():
        theirs = hf(input_ids=b["input_ids"], labels=hf_labels)
        logits = ours.logits(b["input_ids"])
        loss = ours(**b)
    torch.testing.assert_close(logits, theirs.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, theirs.loss, atol=1e-6, rtol=1e-6)


def test_gpt2_logits_and_loss_match_hugging_face(tmp_path):
    hf = save_gpt2(tmp_path / "gpt2")
    spec, ours = built_in(tmp_path, tmp_path / "gpt2")
    assert spec.arch == "gpt" and spec.dims()["d_ff"] == 64 and spec.dims()["max_positions"] == 40
    b = batch("gpt")
    # HF shifts labels itself: on the seq_len + 1 tokens it predicts the same seq_len positions.
    tokens = torch.cat([b["input_ids"], b["labels"][:, -1:]], dim=1)
    with torch.no_grad():
        theirs = hf(input_ids=tokens, labels=tokens)
        logits = ours.logits(b["input_ids"])
        loss = ours(**b)
    torch.testing.assert_close(logits, theirs.logits[:, :-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, theirs.loss, atol=1e-6, rtol=1e-6)


def test_a_bert_model_folder_loads_the_encoder_and_starts_the_head_fresh(tmp_path):
    hf = save_bert(tmp_path / "enc", model_cls="BertModel")
    _, ours = built_in(tmp_path, tmp_path / "enc")
    ids = batch("bert")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(
            ours.hidden(ids), hf(input_ids=ids).last_hidden_state, atol=1e-5, rtol=0
        )
    assert torch.equal(ours.head.bias, torch.zeros(TINY["vocab_size"]))


def test_older_file_layouts_load_the_same_weights(tmp_path):
    """pytorch_model.bin (also torch's pre-zip format) without the model prefix, LayerNorm
    gamma/beta, the stored tied decoder, BERT's pooler and next-sentence head, GPT-2's mask
    buffers."""
    save_bert(tmp_path / "bert")
    new = hf_state_dict(tmp_path / "bert", built_in(tmp_path, tmp_path / "bert")[0])
    tensors = load_file(tmp_path / "bert/model.safetensors")
    old = {
        k.removeprefix("bert.")
        .replace("LayerNorm.weight", "LayerNorm.gamma")
        .replace("LayerNorm.bias", "LayerNorm.beta"): v
        for k, v in tensors.items()
    }
    old["cls.predictions.decoder.weight"] = tensors["bert.embeddings.word_embeddings.weight"]
    old["cls.predictions.decoder.bias"] = tensors["cls.predictions.bias"]
    old["pooler.dense.weight"], old["pooler.dense.bias"] = torch.zeros(32, 32), torch.zeros(32)
    old["cls.seq_relationship.weight"] = torch.zeros(2, 32)
    old["cls.seq_relationship.bias"] = torch.zeros(2)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "config.json").write_text((tmp_path / "bert/config.json").read_text())
    torch.save(old, legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)  # 2018's
    spec, _ = built_in(tmp_path, legacy)
    assert {k: v.tolist() for k, v in hf_state_dict(legacy, spec).items()} == {
        k: v.tolist() for k, v in new.items()
    }

    save_gpt2(tmp_path / "gpt2")
    tensors = load_file(tmp_path / "gpt2/model.safetensors")
    old = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    old["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 40, 40))
    old["lm_head.weight"] = tensors["transformer.wte.weight"]
    (tmp_path / "gpt2/model.safetensors").unlink()
    torch.save(old, tmp_path / "gpt2/pytorch_model.bin")
    spec, ours = built_in(tmp_path, tmp_path / "gpt2")
    assert torch.equal(
        ours.blocks[0].attn.qkv.weight, tensors["transformer.h.0.attn.c_attn.weight"].t()
    )


def test_a_folder_of_shards_loads_like_one_file(tmp_path):
    save_gpt2(tmp_path / "gpt2")
    spec, ours = built_in(tmp_path, tmp_path / "gpt2")
    tensors = load_file(tmp_path / "gpt2/model.safetensors")
    (tmp_path / "gpt2/model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, part in shards.items():
        save_file({k: tensors[k] for k in part}, tmp_path / "gpt2" / file)
    index = {"metadata": {}, "weight_map": {k: file for file, part in shards.items() for k in part}}
    (tmp_path / "gpt2/model.safetensors.index.json").write_text(json.dumps(index))
    _, sharded = built_in(tmp_path, tmp_path / "gpt2")
    for (name, a), b in zip(ours.state_dict().items(), sharded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_export_writes_the_hugging_face_tensors_back_exactly(tmp_path):
    from transformers import BertForMaskedLM, GPT2LMHeadModel

    for name, save, cls in (
        ("bert", save_bert, BertForMaskedLM),
        ("gpt2", save_gpt2, GPT2LMHeadModel),
    ):
        hf = save(tmp_path / name)
        spec, ours = built_in(tmp_path, tmp_path / name)
        save_pretrained(ours.state_dict(), spec, tmp_path / f"{name}-out")
        back = cls.from_pretrained(tmp_path / f"{name}-out")
        theirs, again = hf.state_dict(), back.state_dict()
        assert sorted(theirs) == sorted(again)
        for key, value in theirs.items():
            assert torch.equal(value, again[key]), key
        config = json.loads((tmp_path / f"{name}-out/config.json").read_text())
        assert config["architectures"] == [cls.__name__] and config["tie_word_embeddings"] is True


def test_an_explicit_shape_that_disagrees_is_refused_naming_both(tmp_path):
    save_bert(tmp_path / "bert")
    for model, expect in (
        ({"size": "base"}, "model.size base (config.json: 2x32x4"),
        ({"n_layers": 4}, "model.n_layers 4 (config.json: 2)"),
        ({"arch": "gpt"}, "model.arch gpt (the folder holds a bert)"),
        ({"bias": False}, "model.bias false (the folder's weights have biases)"),
    ):
        with pytest.raises(SpecError) as err:
            model_spec(tmp_path, init_from=str(tmp_path / "bert"), **model)
        assert err.value.exit_code == 2 and expect in str(err.value), str(err.value)
    # Agreeing dims are fine, and a size whose dims are all given explicitly decides nothing.
    dims = {"size": "base", "n_layers": 2, "d_model": 32, "n_heads": 4}
    assert model_spec(tmp_path, init_from=str(tmp_path / "bert"), **dims).dims()["d_model"] == 32


def test_missing_extra_and_misshaped_tensors_are_named(tmp_path):
    save_bert(tmp_path / "bert")
    path = tmp_path / "bert/model.safetensors"
    good = load_file(path)

    def refused(tensors: dict[str, torch.Tensor]) -> str:
        save_file(tensors, path)
        with pytest.raises(SpecError) as err:
            model_spec(tmp_path, init_from=str(tmp_path / "bert"))
        assert err.value.exit_code == 2 and "model.init_from" in str(err.value)
        return str(err.value)

    gone = {k: v for k, v in good.items() if k != "bert.encoder.layer.1.attention.self.key.weight"}
    assert "missing tensor bert.encoder.layer.1.attention.self.key.weight" in refused(gone)
    extra = {**good, "classifier.weight": torch.zeros(2, 32)}
    assert "no place for: classifier.weight" in refused(extra)
    bent = {**good, "bert.encoder.layer.0.intermediate.dense.weight": torch.zeros(65, 32)}
    assert (
        "bert.encoder.layer.0.intermediate.dense.weight is [65, 32], config.json implies [64, 32]"
        in refused(bent)
    )


def test_an_untied_decoder_is_refused(tmp_path):
    save_bert(tmp_path / "bert")
    path = tmp_path / "bert/model.safetensors"
    tensors = load_file(path)
    tensors["cls.predictions.decoder.weight"] = torch.randn(96, 32)
    save_file(tensors, path)
    spec = model_spec(tmp_path, init_from=str(tmp_path / "bert"))
    with pytest.raises(FolderError, match="differs from the word embeddings"):
        hf_state_dict(tmp_path / "bert", spec)


def test_unsupported_configs_are_refused(tmp_path):
    save_bert(tmp_path / "bert")
    config = json.loads((tmp_path / "bert/config.json").read_text())
    for key, value in (("hidden_act", "relu"), ("layer_norm_eps", 1e-5), ("model_type", "roberta")):
        (tmp_path / "bert/config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(SpecError, match=key) as err:
            model_spec(tmp_path, init_from=str(tmp_path / "bert"))
        assert err.value.exit_code == 2


def test_a_name_that_is_not_a_local_folder_says_to_download_it_first(tmp_path):
    with pytest.raises(SpecError) as err:
        model_spec(tmp_path, init_from="bert-base-uncased")
    text = str(err.value)
    assert err.value.exit_code == 2 and "is not a local folder" in text
    assert "hf download bert-base-uncased --local-dir" in text and "never downloads" in text


def test_a_model_without_biases_exports_zero_biases_and_the_same_function(tmp_path):
    from transformers import GPT2LMHeadModel

    spec = model_spec(
        tmp_path, arch="gpt", size="tiny", bias=False, vocab_size=96, max_positions=40
    )
    torch.manual_seed(4)
    ours = build_model(spec).eval()
    assert not [n for n, _ in ours.named_parameters() if n.endswith("bias")]
    save_pretrained(ours.state_dict(), spec, tmp_path / "out")
    theirs = GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    state = theirs.state_dict()
    biases = [v for k, v in state.items() if k.endswith(".bias") and ".attn.bias" not in k]
    assert biases and all(not v.any() for v in biases)
    ids = batch("gpt")["input_ids"][:, :16]
    with torch.no_grad():
        torch.testing.assert_close(
            ours.logits(ids), theirs(input_ids=ids).logits, atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("content", ["garbage", "more than tensors"])
def test_an_unreadable_pytorch_model_bin_is_a_folder_error(tmp_path, content: str):
    from launcher.spec.hf import load_bin

    path = tmp_path / "pytorch_model.bin"
    if content == "garbage":
        path.write_bytes(b"not a torch file\x00\x01")
    else:  # weights_only refuses any object but tensors and plain containers
        torch.save({"w": torch.zeros(2), "where": Path("/x")}, path)
    with pytest.raises(FolderError, match=f"cannot read {path}"):
        load_bin(path)
