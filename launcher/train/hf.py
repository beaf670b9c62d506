"""Hugging Face weights into the built-in models (``model.init_from``) and back out (export);
the name table lives in ``launcher.spec.hf``.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from launcher.spec import hf as fmt
from launcher.spec.job import ModelSpec
from launcher.train.model import INIT_STD, MLMHead

log = logging.getLogger(__name__)

# Files of a tokenizer that the exporter copies next to the weights when it finds them.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
)


def load_pretrained(
    model: nn.Module, spec: ModelSpec, *, device: torch.device, every_rank: bool = False
) -> None:
    """Fill ``model`` (plain, DDP or FSDP; parameters may be on the meta device) from
    ``spec.init_from``: read on rank 0 and broadcast (a collective when a process group is
    up: call it on every rank), or, with ``every_rank``, read by each rank for its own
    unwrapped model (FSDP with CPU offload, before sharding)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    assert spec.init_from is not None
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
    distributed = dist.is_available() and dist.is_initialized() and not every_rank
    rank0 = not distributed or dist.get_rank() == 0
    state: dict[str, Any] = hf_state_dict(spec.init_from, spec) if rank0 else {}
    if not distributed:
        model.load_state_dict(state, strict=True)
        return
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    set_model_state_dict(model, state, options=options)


def hf_state_dict(folder: Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The built-in model's parameters (plain names, fp32, CPU) from a Hugging Face folder."""
    dims = spec.dims()
    files = fmt.weight_files(folder)
    tensors = read_tensors(files)
    matched = fmt.match_tensors(
        spec.arch, dims, {k: tuple(v.shape) for k, v in tensors.items()}, folder=folder
    )
    if matched.ignored:
        log.info(
            "init_from %s: not used by the built-in %s: %s",
            folder,
            spec.arch.upper(),
            ", ".join(matched.ignored),
        )
    out: dict[str, torch.Tensor] = {}
    for rule in fmt.rules(spec.arch, dims):
        if rule.head and matched.fresh_head:
            continue
        parts = [tensors[matched.source[name]].float() for name in rule.hf]
        value = torch.cat(parts) if len(parts) > 1 else parts[0]
        out[rule.ours] = (value.t() if rule.transpose else value).contiguous()
    if matched.tied is not None and not torch.equal(
        tensors[matched.tied].float(), out["embed.tok.weight"]
    ):
        raise fmt.FolderError(
            f"{folder}: {matched.tied} differs from the word embeddings; the built-in model ties "
            f"its decoder to them, so an untied checkpoint cannot be loaded faithfully"
        )
    if matched.fresh_head:
        log.info(
            "init_from %s: no MLM head in the folder (a BertModel); it starts from a random init",
            folder,
        )
        out.update(_fresh_mlm_head(dims["d_model"], dims["vocab_size"]))
    return out


def read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """All tensors of the weight files, on the CPU."""
    out: dict[str, torch.Tensor] = {}
    for path in files:
        if path.suffix == ".safetensors":
            try:
                from safetensors.torch import load_file
            except ImportError:
                raise fmt.FolderError(
                    f"reading {path} needs the safetensors package: {fmt.INSTALL_HINT}"
                ) from None
            out.update(load_file(str(path), device="cpu"))
        else:
            out.update(fmt.load_bin(path))
    return out


def _fresh_mlm_head(d_model: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """An MLM head initialised as the built-in BERT initialises its own."""
    head = MLMHead(d_model, vocab_size)
    nn.init.normal_(head.dense.weight, std=INIT_STD)
    nn.init.zeros_(head.dense.bias)
    return {f"head.{k}": v.detach() for k, v in head.state_dict().items()}


# -- out ------------------------------------------------------------------------------------


def to_hf(state: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors (``BertForMaskedLM`` / ``GPT2LMHeadModel`` names) of the
    built-in parameters ``state`` (plain names); zeros for the biases of a ``model.bias:
    false`` model, which Hugging Face's classes always have."""
    dims = spec.dims()
    table = fmt.rules(spec.arch, dims)
    if not spec.bias:  # a model without biases is one whose biases are zero
        state = {
            **state,
            **{
                r.ours: torch.zeros(len(r.hf) * r.shape[0])
                for r in table
                if r.ours.endswith("bias") and r.ours not in state
            },
        }
    names = {r.ours for r in table}
    if set(state) != names:
        missing, extra = sorted(names - set(state)), sorted(set(state) - names)
        raise ValueError(
            f"the checkpoint does not hold the {spec.arch.upper()} its job describes: "
            f"missing {missing[:6]}, unexpected {extra[:6]}"
        )
    out: dict[str, torch.Tensor] = {}
    prefix = fmt.PREFIX[spec.arch]
    for rule in table:
        value = state[rule.ours].detach().cpu()
        value = value.t() if rule.transpose else value
        for name, part in zip(rule.hf, value.chunk(len(rule.hf)), strict=True):
            if tuple(part.shape) != rule.shape:
                raise ValueError(
                    f"{rule.ours} has shape {list(state[rule.ours].shape)}; the job's "
                    f"model implies {name} {list(rule.shape)}"
                )
            full = name if name.startswith("cls.") else prefix + name
            out[full] = part.contiguous().clone()
    return out


def hf_config(spec: ModelSpec, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` for the exported model: ``base`` (the init_from folder's config, which
    keeps keys such as pad_token_id) with the built-in model's shape and function written in."""
    d = spec.dims()
    if spec.arch == "bert":
        shape = {
            "architectures": ["BertForMaskedLM"],
            "model_type": "bert",
            "vocab_size": d["vocab_size"],
            "hidden_size": d["d_model"],
            "num_hidden_layers": d["n_layers"],
            "num_attention_heads": d["n_heads"],
            "intermediate_size": d["d_ff"],
            "max_position_embeddings": d["max_positions"],
            "type_vocab_size": fmt.BERT_TYPE_VOCAB,
            "hidden_act": "gelu",
            "layer_norm_eps": 1e-12,
            "position_embedding_type": "absolute",
            "hidden_dropout_prob": spec.dropout,
            "attention_probs_dropout_prob": spec.dropout,
        }
    else:
        shape = {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": d["vocab_size"],
            "n_embd": d["d_model"],
            "n_layer": d["n_layers"],
            "n_head": d["n_heads"],
            "n_inner": d["d_ff"],
            "n_positions": d["max_positions"],
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5,
            "resid_pdrop": spec.dropout,
            "embd_pdrop": spec.dropout,
            "attn_pdrop": spec.dropout,
        }
    out = {
        "initializer_range": INIT_STD,
        **(base or {}),
        **shape,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    out.pop("dtype", None)  # newer transformers write "dtype"; one of the two is enough
    return out


def save_pretrained(
    state: dict[str, torch.Tensor], spec: ModelSpec, out: Path, *, tokenizer: Path | None = None
) -> list[Path]:
    """Write ``config.json`` and ``model.safetensors`` (and the tokenizer's files, when given)
    into ``out``; returns the files written."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise fmt.FolderError(
            f"writing model.safetensors needs the safetensors package: {fmt.INSTALL_HINT}",
            field="out",
        ) from None
    base = None
    if spec.init_from is not None and (spec.init_from / fmt.CONFIG).is_file():
        base = json.loads((spec.init_from / fmt.CONFIG).read_text())
    out.mkdir(parents=True, exist_ok=True)
    written = [out / fmt.CONFIG, out / "model.safetensors"]
    save_file(to_hf(state, spec), str(written[1]), metadata={"format": "pt"})
    written[0].write_text(json.dumps(hf_config(spec, base), indent=2, sort_keys=True) + "\n")
    # safetensors writes 0600; give it the mode of every other file here (the umask's: 0644).
    os.chmod(written[1], stat.S_IMODE(written[0].stat().st_mode))
    for folder in (tokenizer, spec.init_from):
        if folder is not None and (folder / "tokenizer.json").is_file():
            for name in TOKENIZER_FILES:
                if (folder / name).is_file():
                    (out / name).write_bytes((folder / name).read_bytes())
                    written.append(out / name)
            break
    return written
