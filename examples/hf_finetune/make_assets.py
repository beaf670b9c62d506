"""Make what examples/hf_finetune/job.yaml reads: a text corpus, a tokenizer and a tiny BERT
saved as a Hugging Face folder. Nothing is downloaded.

    pip install -e '.[hf]'
    python examples/hf_finetune/make_assets.py          # writes examples/hf_finetune/assets/
    launch examples/hf_finetune/job.yaml

``assets/text/corpus.txt``: ~300 KB of generated sentences, a blank line between paragraphs
(documents); ``assets/tokenizer/``: a WordPiece tokenizer trained on it; ``assets/bert-tiny/``:
a random 2-layer BERT written as ``launch export`` writes one (transformers loads it). Any
local BertForMaskedLM folder (e.g. a downloaded bert-base-uncased) can take its place. The
tests reuse these functions (with a BPE tokenizer for GPT).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUBJECTS = [
    "the cat",
    "a dog",
    "my friend",
    "the teacher",
    "our neighbour",
    "the old man",
    "a child",
    "the engineer",
    "her brother",
    "the farmer",
    "a bird",
    "the pilot",
]
VERBS = [
    "sees",
    "likes",
    "follows",
    "paints",
    "builds",
    "finds",
    "carries",
    "watches",
    "helps",
    "visits",
    "remembers",
    "draws",
]
OBJECTS = [
    "a red house",
    "the green river",
    "an apple",
    "the small boat",
    "a long letter",
    "the quiet garden",
    "a bright lamp",
    "the wooden table",
    "a new bicycle",
    "the blue door",
]
PLACES = [
    "in the morning",
    "near the station",
    "after dinner",
    "on the hill",
    "by the sea",
    "under the bridge",
    "at school",
    "in the city",
]
BERT_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
GPT_EOS = "<|endoftext|>"


def write_text(path: Path, *, n_bytes: int = 300_000, seed: int = 0) -> Path:
    """Generated sentences (subject verb object [place].), 2-6 per paragraph, until n_bytes."""
    rng = random.Random(seed)
    paragraphs: list[str] = []
    size = 0
    while size < n_bytes:
        sentences = []
        for _ in range(rng.randint(2, 6)):
            words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
            if rng.random() < 0.5:
                words.append(rng.choice(PLACES))
            sentences.append(" ".join(words).capitalize() + ".")
        paragraphs.append(" ".join(sentences))
        size += len(paragraphs[-1]) + 2
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(paragraphs) + "\n")
    return path


def train_tokenizer(
    files: list[Path], out: Path, *, kind: str = "wordpiece", vocab_size: int = 512
) -> Path:
    """A WordPiece (BERT, lower-cased) or byte-level BPE (GPT-2 style) tokenizer, saved to ``out``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if kind == "wordpiece":
        tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=BERT_SPECIAL)
        config = {
            "cls_token": "[CLS]",
            "sep_token": "[SEP]",
            "mask_token": "[MASK]",
            "pad_token": "[PAD]",
            "unk_token": "[UNK]",
            "do_lower_case": True,
            "tokenizer_class": "BertTokenizerFast",
        }
    else:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[GPT_EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        config = {
            "eos_token": GPT_EOS,
            "bos_token": GPT_EOS,
            "tokenizer_class": "GPT2TokenizerFast",
        }
    tokenizer.train([str(f) for f in files], trainer)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


def make_bert(out: Path, *, vocab_size: int, seed: int = 0) -> Path:
    """A randomly initialised tiny BERT as a Hugging Face folder (config.json, model.safetensors)."""
    import torch

    from launcher.spec.job import ModelSpec
    from launcher.train.hf import save_pretrained
    from launcher.train.model import build_model

    spec = ModelSpec(
        arch="bert",
        n_layers=2,
        d_model=64,
        n_heads=2,
        d_ff=256,
        vocab_size=vocab_size,
        max_positions=128,
    )
    torch.manual_seed(seed)
    model = build_model(spec)
    save_pretrained(model.state_dict(), spec, out)
    return out


def require_hf() -> None:
    """Exit with the install command when the hf extra is missing."""
    try:
        import safetensors  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as err:
        raise SystemExit(
            f"make_assets.py needs the hf extra ({err.name} is not installed): "
            f"pip install -e '.[hf]' in the launcher's folder"
        ) from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=HERE / "assets", help="where to write (default: %(default)s)"
    )
    parser.add_argument(
        "--text-mb", type=float, default=0.3, help="size of the corpus (default: %(default)s MB)"
    )
    args = parser.parse_args()
    require_hf()
    text = write_text(args.out / "text" / "corpus.txt", n_bytes=int(args.text_mb * 1e6))
    tokenizer = train_tokenizer([text], args.out / "tokenizer", vocab_size=1024)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer / "tokenizer.json")).get_vocab_size(
        with_added_tokens=True
    )
    make_bert(args.out / "bert-tiny", vocab_size=vocab)
    print(f"wrote {text}, {tokenizer} ({vocab} tokens) and {args.out / 'bert-tiny'}")


if __name__ == "__main__":
    main()
