"""bert-base's and GPT-2 124M's shapes on the GPU in bf16: the built-in model loaded from a
Hugging Face folder (random weights, saved here) against transformers' own model.

    python -m pytest -m gpu tests/integration/test_gpu_hf_parity.py

Both bf16 models are measured against Hugging Face in fp32: the built-in model's error is
within bf16's reach and at most twice Hugging Face's own; in fp32 the two agree to 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="builds Hugging Face models (test extra)")
pytest.importorskip("safetensors", reason="Hugging Face folders hold model.safetensors (hf extra)")

from fixtures.batching import source  # noqa: E402
from fixtures.numerics import rel_err  # noqa: E402

from launcher.spec.hf import check_folder  # noqa: E402
from launcher.spec.job import ModelSpec  # noqa: E402
from launcher.train.hf import load_pretrained  # noqa: E402
from launcher.train.model import build_model  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def compare(
    folder: Path, hf: torch.nn.Module, *, arch: str, seq: int, batch: int = 8
) -> dict[str, float]:
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf.save_pretrained(folder)
    arch_read, dims = check_folder(folder)
    assert arch_read == arch
    spec = ModelSpec(arch=arch, **dims, init_from=folder)
    with torch.device(dev):
        ours = build_model(spec)
    load_pretrained(ours, spec, device=dev)
    ours.eval()
    hf = hf.to(dev).eval()
    data = source(arch, vocab=dims["vocab_size"], seq=seq, micro=batch, seed=7, device=dev)
    b = data.batch(1)
    if arch == "bert":
        hf_in = {
            "input_ids": b["input_ids"],
            "labels": torch.full_like(b["input_ids"], -100).scatter(1, b["mask_pos"], b["labels"]),
        }
    else:
        tokens = torch.cat([b["input_ids"], b["labels"][:, -1:]], dim=1)
        hf_in = {"input_ids": tokens, "labels": tokens}

    def hf_out():
        out = hf(**hf_in)
        logits = out.logits if arch == "bert" else out.logits[:, :-1]
        return logits.float(), out.loss.float()

    with torch.no_grad():
        ref_logits, ref_loss = hf_out()
        fp32_err = rel_err(ours.logits(b["input_ids"]), ref_logits)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hf_logits, hf_loss = hf_out()
            our_logits, our_loss = ours.logits(b["input_ids"]), ours(**b)
    return {
        "fp32": fp32_err,
        "ours_bf16": rel_err(our_logits, ref_logits),
        "hf_bf16": rel_err(hf_logits, ref_logits),
        "ours_loss": abs(float(our_loss) - float(ref_loss)) / float(ref_loss),
        "hf_loss": abs(float(hf_loss) - float(ref_loss)) / float(ref_loss),
    }


def check(errors: dict[str, float]) -> None:
    print(errors)
    assert errors["fp32"] < 1e-4, errors
    assert errors["ours_bf16"] < 2e-2, errors
    assert errors["ours_bf16"] <= 2 * errors["hf_bf16"] + 1e-3, errors
    assert errors["ours_loss"] < 1e-2, errors


def test_bert_base_matches_hugging_face_in_bf16(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    hf = BertForMaskedLM(BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    check(compare(tmp_path / "bert-base", hf, arch="bert", seq=512))


def test_gpt2_124m_matches_hugging_face_in_bf16(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    check(compare(tmp_path / "gpt2", hf, arch="gpt", seq=1023))


@pytest.mark.parametrize("cpu_offload", [False, True])
def test_fsdp_on_the_gpu_loads_the_folder_exactly(tmp_path, one_process_trainer_env, cpu_offload):
    """The trainer's own path (one rank, NCCL): FSDP from the meta device with the broadcast,
    or, with CPU offload, loaded on the CPU before sharding; the parameters equal the folder's."""
    import yaml
    from fixtures.hf_assets import save_bert

    from launcher.spec import load_job
    from launcher.train.hf import hf_state_dict
    from launcher.train.loop import Trainer

    save_bert(tmp_path / "bert")
    spec = {
        "name": "gpu-load",
        "model": {"init_from": str(tmp_path / "bert")},
        "data": {"seq_len": 16},
        "train": {"steps": 2, "warmup_steps": 1},
        "parallel": {"strategy": "fsdp", "fsdp": {"cpu_offload": cpu_offload}},
        "resources": {"device": "cuda", "nproc_per_node": 1},
    }
    file = tmp_path / "job.yaml"
    file.write_text(yaml.safe_dump(spec))
    job = load_job(file)
    with Trainer(job) as trainer:  # a world of one in this process (one_process_trainer_env)
        got = trainer.full_state_dict()
    want = hf_state_dict(tmp_path / "bert", job.model)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key].cpu(), value), key
