"""What a local Hugging Face model folder holds, and how its tensors map to the built-in models.

Read without torch, so the launcher checks a folder before any worker starts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.util import first_line

CONFIG = "config.json"
# Weight files in the order Hugging Face prefers them; an index names the shards of a split file.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
INSTALL_HINT = "pip install -e '.[hf]' in the launcher's folder"
BERT_TYPE_VOCAB = 2
FIELD = "model.init_from"


class FolderError(ValueError):
    """A folder that cannot be used as asked; the loader turns it into a SpecError (exit 2)."""

    def __init__(self, message: str, *, field: str = FIELD):
        super().__init__(message)
        self.field = field


# -- config.json ----------------------------------------------------------------------------


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise FolderError(
            f"{folder} has no {CONFIG}; a Hugging Face model folder holds config.json "
            f"and model.safetensors (or pytorch_model.bin)"
        ) from None
    except (OSError, ValueError) as err:
        raise FolderError(f"cannot read {path}: {err}") from None
    if not isinstance(config, dict):
        raise FolderError(f"{path} is not a JSON object")
    return config


def shape_from_config(folder: Path) -> tuple[str, dict[str, int]]:
    """The built-in arch (bert|gpt) and its dims from ``config.json``; features the built-in
    models do not have (another activation, LayerNorm epsilon, untied decoder, ...) are refused."""
    config = read_config(folder)
    kind = config.get("model_type")
    if kind == "bert":
        arch = "bert"
        keys = {
            "n_layers": "num_hidden_layers",
            "d_model": "hidden_size",
            "n_heads": "num_attention_heads",
            "d_ff": "intermediate_size",
            "vocab_size": "vocab_size",
            "max_positions": "max_position_embeddings",
        }
        must = {
            "hidden_act": "gelu",
            "layer_norm_eps": 1e-12,
            "type_vocab_size": BERT_TYPE_VOCAB,
            "position_embedding_type": "absolute",
            "is_decoder": False,
            "add_cross_attention": False,
            "tie_word_embeddings": True,
        }
    elif kind == "gpt2":
        arch = "gpt"
        keys = {
            "n_layers": "n_layer",
            "d_model": "n_embd",
            "n_heads": "n_head",
            "d_ff": "n_inner",
            "vocab_size": "vocab_size",
            "max_positions": "n_positions",
        }
        must = {
            "layer_norm_epsilon": 1e-5,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "add_cross_attention": False,
            "tie_word_embeddings": True,
        }
        # gelu_new and gelu_pytorch_tanh are the same function (GELU's tanh approximation).
        act = config.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise FolderError(
                f"{folder / CONFIG} has activation_function {act!r}; the built-in GPT "
                f"uses GELU's tanh approximation (gelu_new)"
            )
    else:
        raise FolderError(
            f"{folder / CONFIG} has model_type {kind!r}; model.init_from loads BERT "
            f"(model_type bert) and GPT-2 (model_type gpt2) folders"
        )
    for key, want in must.items():
        if key in config and config[key] != want:
            raise FolderError(
                f"{folder / CONFIG} has {key} {config[key]!r}; the built-in {arch.upper()} "
                f"has {want!r} and would compute a different function"
            )
    dims: dict[str, int] = {}
    for ours, theirs in keys.items():
        value = config.get(theirs)
        if value is None and arch == "gpt":  # GPT-2's n_inner null: 4 x n_embd; older: n_ctx
            if ours == "d_ff" and isinstance(config.get("n_embd"), int):
                value = 4 * config["n_embd"]
            elif ours == "max_positions":
                value = config.get("n_ctx")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise FolderError(f"{folder / CONFIG} needs a positive integer {theirs}, has {value!r}")
        dims[ours] = value
    return arch, dims


# -- tensor names and shapes ----------------------------------------------------------------


def weight_files(folder: Path) -> list[Path]:
    """The files holding the weights: one file, or the shards an index names."""
    for name in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        if not name.endswith(".index.json"):
            return [path]
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise FolderError(f"cannot read the shard index {path}: {err!r}") from None
        return [folder / shard for shard in sorted(set(weight_map.values()))]
    raise FolderError(f"{folder} holds no weights: expected one of {', '.join(WEIGHT_FILES)}")


def tensor_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape (safetensors headers read directly; .bin via torch, mmap)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        if not path.is_file():
            raise FolderError(f"{path} is missing (named by the shard index)")
        if path.suffix == ".safetensors":
            shapes.update(_safetensors_shapes(path))
        else:
            shapes.update({k: tuple(v.shape) for k, v in load_bin(path).items()})
    return shapes


def load_bin(path: Path) -> dict[str, Any]:
    """A ``pytorch_model.bin``'s tensors on the CPU (tensors only: ``weights_only``),
    memory-mapped where the file is torch's zip format; files from before it (2018's
    bert-base-uncased) are read whole."""
    import torch

    # not a torch file, a truncated one, or one holding more than tensors (weights_only refuses)
    unreadable = (RuntimeError, OSError, ValueError, EOFError, pickle.UnpicklingError)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except unreadable as err:
        if not (isinstance(err, RuntimeError) and "mmap" in str(err)):
            raise FolderError(f"cannot read {path}: {first_line(err)}") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except unreadable as err:
        raise FolderError(f"cannot read {path}: {first_line(err)}") from None


SAFETENSORS_MAX_HEADER = 100_000_000  # bytes: what the safetensors library itself reads


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    try:
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > min(SAFETENSORS_MAX_HEADER, os.fstat(fh.fileno()).st_size - 8):
                raise ValueError(
                    f"its header length {length} is more than the file holds (or than "
                    f"{SAFETENSORS_MAX_HEADER} bytes)"
                )
            header = json.loads(fh.read(length))
    except (OSError, ValueError, struct.error) as err:
        raise FolderError(f"{path} is not a readable safetensors file: {err}") from None
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


@dataclass(frozen=True)
class Rule:
    """One built-in parameter and the Hugging Face tensor(s) it is made of."""

    ours: str
    hf: tuple[str, ...]  # several: concatenated along dim 0 (BERT's query, key, value: the QKV)
    shape: tuple[int, ...]  # each Hugging Face tensor's
    transpose: bool = False  # GPT-2's Conv1D stores (in, out), nn.Linear (out, in)
    head: bool = False  # part of the MLM head, which a BertModel folder lacks


def rules(arch: str, dims: dict[str, int]) -> list[Rule]:
    """Every built-in parameter's source, in the built-in model's parameter order."""
    d, ff, vocab, pos = dims["d_model"], dims["d_ff"], dims["vocab_size"], dims["max_positions"]
    out: list[Rule] = []

    def add(ours: str, hf: str | tuple[str, ...], shape: tuple[int, ...], **kw: bool) -> None:
        out.append(Rule(ours, (hf,) if isinstance(hf, str) else hf, shape, **kw))

    def linear(ours: str, hf: str | tuple[str, ...], n_out: int, n_in: int, **kw: bool) -> None:
        """A weight and its bias; n_out and n_in of each Hugging Face part."""
        names = (hf,) if isinstance(hf, str) else hf
        shape = (n_in, n_out) if kw.get("transpose") else (n_out, n_in)
        add(f"{ours}.weight", tuple(f"{n}.weight" for n in names), shape, **kw)
        add(f"{ours}.bias", tuple(f"{n}.bias" for n in names), (n_out,), **kw)

    def norm(ours: str, hf: str, **kw: bool) -> None:
        add(f"{ours}.weight", f"{hf}.weight", (d,), **kw)
        add(f"{ours}.bias", f"{hf}.bias", (d,), **kw)

    if arch == "bert":
        add("embed.tok.weight", "embeddings.word_embeddings.weight", (vocab, d))
        add("embed.pos.weight", "embeddings.position_embeddings.weight", (pos, d))
        add(
            "embed.tok_type.weight", "embeddings.token_type_embeddings.weight", (BERT_TYPE_VOCAB, d)
        )
        norm("embed.ln", "embeddings.LayerNorm")
        for i in range(dims["n_layers"]):
            p, o = f"encoder.layer.{i}.", f"blocks.{i}."
            qkv = tuple(p + f"attention.self.{n}" for n in ("query", "key", "value"))
            linear(o + "attn.qkv", qkv, d, d)
            linear(o + "attn.proj", p + "attention.output.dense", d, d)
            norm(o + "ln1", p + "attention.output.LayerNorm")
            linear(o + "mlp.fc", p + "intermediate.dense", ff, d)
            linear(o + "mlp.proj", p + "output.dense", d, ff)
            norm(o + "ln2", p + "output.LayerNorm")
        linear("head.dense", "cls.predictions.transform.dense", d, d, head=True)
        norm("head.ln", "cls.predictions.transform.LayerNorm", head=True)
        add("head.bias", "cls.predictions.bias", (vocab,), head=True)
        return out
    add("embed.tok.weight", "wte.weight", (vocab, d))
    add("embed.pos.weight", "wpe.weight", (pos, d))
    for i in range(dims["n_layers"]):
        p, o = f"h.{i}.", f"blocks.{i}."
        norm(o + "ln1", p + "ln_1")
        linear(o + "attn.qkv", p + "attn.c_attn", 3 * d, d, transpose=True)
        linear(o + "attn.proj", p + "attn.c_proj", d, d, transpose=True)
        norm(o + "ln2", p + "ln_2")
        linear(o + "mlp.fc", p + "mlp.c_fc", ff, d, transpose=True)
        linear(o + "mlp.proj", p + "mlp.c_proj", d, ff, transpose=True)
    norm("head.ln", "ln_f")
    return out


# The model-class prefix of the body's tensors (BertForMaskedLM's "bert.", GPT2LMHeadModel's
# "transformer."); the exporter writes it, the loader accepts files with and without it.
PREFIX = {"bert": "bert.", "gpt": "transformer."}
# The decoder tied to the word embeddings (written only by older versions, equal to it).
TIED = {"bert": "cls.predictions.decoder.weight", "gpt": "lm_head.weight"}
# BERT's decoder bias is the same parameter as cls.predictions.bias under a second name.
BERT_BIAS_ALIAS = "cls.predictions.decoder.bias"
# Tensors the built-in models have no use for: buffers, BERT's pooler and next-sentence head.
IGNORED = {
    "bert": re.compile(r"^(embeddings\.position_ids|pooler\..*|cls\.seq_relationship\..*)$"),
    "gpt": re.compile(r"^h\.\d+\.attn\.(masked_)?bias$"),
}


def normalize(arch: str, name: str) -> str:
    """A file's tensor name without the model prefix, with today's LayerNorm names."""
    name = name.removeprefix(PREFIX[arch])
    if ".LayerNorm." in name or name.startswith("LayerNorm."):
        name = re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", name))
    return name


@dataclass
class Matched:
    """Where each Hugging Face tensor a rule needs is in the file (normalized name → file name)."""

    source: dict[str, str]
    fresh_head: bool = False  # a BertModel folder: the MLM head starts from a random init
    tied: str | None = None  # the file's name of a stored tied decoder, to check it equals wte
    ignored: list[str] = field(default_factory=list)


def match_tensors(
    arch: str, dims: dict[str, int], shapes: dict[str, tuple[int, ...]], *, folder: Path
) -> Matched:
    """Check a folder's tensors against the config's shape; every problem in one FolderError."""
    by_name: dict[str, str] = {}
    for name in shapes:
        by_name.setdefault(normalize(arch, name), name)
    table = rules(arch, dims)
    if arch == "bert" and "cls.predictions.bias" not in by_name and BERT_BIAS_ALIAS in by_name:
        by_name["cls.predictions.bias"] = by_name[BERT_BIAS_ALIAS]
    head_names = {n for r in table if r.head for n in r.hf}
    fresh_head = arch == "bert" and not any(n in by_name for n in head_names)
    expected = {n: r.shape for r in table if not (r.head and fresh_head) for n in r.hf}
    # Missing names are shown as the file would name them (with the prefix where it uses one).
    prefix = PREFIX[arch] if any(name.startswith(PREFIX[arch]) for name in shapes) else ""
    missing = [
        n if n.startswith(("cls.", "lm_head.")) else prefix + n
        for n in expected
        if n not in by_name
    ]
    with_tied = {**expected, TIED[arch]: (dims["vocab_size"], dims["d_model"])}
    wrong = [
        f"{by_name[n]} is {list(shapes[by_name[n]])}, config.json implies {list(want)}"
        for n, want in with_tied.items()
        if n in by_name and tuple(shapes[by_name[n]]) != want
    ]
    known = set(with_tied) | {BERT_BIAS_ALIAS if arch == "bert" else ""}
    ignored = sorted(n for n in by_name if n not in known and IGNORED[arch].match(n))
    extra = sorted(by_name[n] for n in by_name if n not in known and n not in ignored)
    problems = []
    if missing:
        problems.append(f"missing tensor{'s' if len(missing) > 1 else ''} {_few(missing)}")
    if extra:
        problems.append(
            f"tensor{'s' if len(extra) > 1 else ''} the built-in {arch.upper()} has no "
            f"place for: {_few(extra)}"
        )
    problems.extend(wrong)
    if problems:
        raise FolderError(
            f"{folder} does not fit the {arch.upper()} its config.json describes: "
            + "; ".join(problems)
            + ". Check that the folder's weights and config.json "
            "belong together (a task head such as a classifier is not supported)"
        )
    return Matched(
        source={n: by_name[n] for n in expected},
        fresh_head=fresh_head,
        tied=by_name.get(TIED[arch]),
        ignored=[by_name[n] for n in ignored],
    )


def _few(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_folder(folder: Path) -> tuple[str, dict[str, int]]:
    """config.json → (arch, dims), with every tensor's name and shape checked against it."""
    arch, dims = shape_from_config(folder)
    files = weight_files(folder)
    safetensors = any(f.suffix == ".safetensors" for f in files)
    if safetensors and importlib.util.find_spec("safetensors") is None:
        raise FolderError(
            f"loading {files[0].name} needs the 'safetensors' package, which is not installed; "
            f"install the hf extra: {INSTALL_HINT}"
        )
    match_tensors(arch, dims, tensor_shapes(files), folder=folder)
    return arch, dims


# -- tokenizer folders ----------------------------------------------------------------------

TOKENIZER_FIELD = "data.tokenizer"
# The special tokens each packing needs, by role, and their names when the folder names none.
DEFAULT_SPECIAL = {
    "bert": {"cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"},
    "gpt": {"eos": "<|endoftext|>"},
}


def load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer.json (``tokenizers``), truncation and padding off: text is packed."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise FolderError(
            f"data.source text needs the tokenizers package: {INSTALL_HINT}", field=TOKENIZER_FIELD
        ) from None
    try:
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as err:  # the library raises its own exception types for a bad file
        raise FolderError(
            f"cannot load {folder / 'tokenizer.json'}: {err}", field=TOKENIZER_FIELD
        ) from None
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def special_names(folder: Path, arch: str) -> dict[str, str]:
    """The special tokens' names, by role, that a tokenizer folder declares in
    tokenizer_config.json (or special_tokens_map.json), else the usual ones."""
    roles = DEFAULT_SPECIAL[arch]
    found = dict(roles)
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        path = folder / name
        if not path.is_file():
            continue
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise FolderError(f"cannot read {path}: {err}", field=TOKENIZER_FIELD) from None
        for role in roles:
            value = config.get(f"{role}_token") if isinstance(config, dict) else None
            if isinstance(value, dict):  # {"content": "[CLS]", ...} in older files
                value = value.get("content")
            if isinstance(value, str):
                found[role] = value
    return found


def special_ids(folder: Path, tokenizer: Any, arch: str) -> dict[str, int]:
    """The ids of the special tokens the arch's packing needs ([CLS] [SEP] [MASK], or EOS)."""
    ids = {}
    for role, token in special_names(folder, arch).items():
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise FolderError(
                f"{folder}: packing text for {arch.upper()} needs a {role} token, and {token!r} is "
                f"not in the tokenizer's vocabulary; name the right one as {role}_token in the "
                f"folder's tokenizer_config.json",
                field=TOKENIZER_FIELD,
            )
        ids[role] = token_id
    return ids


def check_tokenizer(folder: Path, arch: str, model_vocab: int) -> None:
    """The tokenizer loads, has the special tokens the arch needs and fits the model's vocabulary."""
    tokenizer = load_tokenizer(folder)
    special_ids(folder, tokenizer, arch)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > model_vocab:
        raise FolderError(
            f"the tokenizer in {folder} has {size} tokens, more than the model's "
            f"vocabulary of {model_vocab}; set model.vocab_size: {size} (or more)",
            field="model.vocab_size",
        )
