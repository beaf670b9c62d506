"""BERT (masked LM) and GPT (causal LM), written for throughput.

Both have ``embed``, ``blocks`` and ``head``, so parallelisation treats them alike;
``model(input_ids, labels, mask_pos)`` returns the mean cross-entropy.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from launcher.spec.job import SIZE_PRESETS, ModelSpec
from launcher.train import fused
from launcher.train.attention import packed_attention, sdpa_attention
from launcher.train.loss import linear_cross_entropy

BERT_LN_EPS = 1e-12
GPT_LN_EPS = 1e-5
INIT_STD = 0.02


def build_model(spec: ModelSpec) -> LanguageModel:
    """The model a job asks for, initialised (call under ``torch.device(...)`` to place it)."""
    dims = spec.dims()
    if spec.arch == "bert":
        return BertForMaskedLM(**dims, dropout=spec.dropout, bias=spec.bias)
    return GPT(**dims, dropout=spec.dropout, bias=spec.bias)


def mask_count(seq_len: int, mask_prob: float) -> int:
    """Masked positions per BERT sequence: round(mask_prob * seq_len), at least 1."""
    return max(1, min(seq_len, round(mask_prob * seq_len)))


def count_params(model: nn.Module) -> int:
    """Distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def describe(spec: ModelSpec, n_params: int) -> str:
    """``bert tiny, 4.4M params``; a shape no preset has is given by its dims."""
    d = spec.dims()
    shape = (d["n_layers"], d["d_model"], d["n_heads"])
    size = spec.size if SIZE_PRESETS[spec.size] == shape else f"{shape[0]}x{shape[1]}"
    count = f"{n_params / 1e6:.1f}M" if n_params >= 1e6 else f"{n_params / 1e3:.1f}K"
    return f"{spec.arch} {size}, {count} params"


def matmul_params_per_token(spec: ModelSpec, *, seq_len: int, mask_prob: float) -> float:
    """N in FLOPs/token = 6·N + attention: the weights each token multiplies by (blocks and
    the LM head; BERT's head on the masked fraction only; no embeddings, biases or norms)."""
    d = spec.dims()
    per_block = 4 * d["d_model"] ** 2 + 2 * d["d_model"] * d["d_ff"]
    body = d["n_layers"] * per_block
    if spec.arch == "gpt":
        return float(body + d["vocab_size"] * d["d_model"])
    frac = mask_count(seq_len, mask_prob) / seq_len
    return body + frac * (d["d_model"] ** 2 + d["vocab_size"] * d["d_model"])


def flops_per_token(spec: ModelSpec, *, seq_len: int, mask_prob: float) -> float:
    """Training FLOPs per token, model FLOPs only (MFU, not HFU): ``6·N + 12·L·d·S``, GPT's
    causal attention counted half (``6·L·d·S``)."""
    d = spec.dims()
    attn = 12 * d["n_layers"] * d["d_model"] * seq_len
    if spec.arch == "gpt":
        attn //= 2
    return 6 * matmul_params_per_token(spec, seq_len=seq_len, mask_prob=mask_prob) + attn


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` whose output has its input's dtype (autocast would return fp32); the
    statistics are still fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float, causal: bool, bias: bool = True):
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.causal = causal
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)
        self.packed = False  # the trainer sets it from train.attention (cudnn-fa4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.n_heads, d // self.n_heads)
        dropout = self.dropout if self.training else 0.0
        if self.packed and dropout == 0:
            y = packed_attention(qkv, self.causal)
        else:
            y = sdpa_attention(qkv, self.causal, dropout)
        return self.proj(y.reshape(b, s, d))  # y: (batch, seq, heads, head_dim)


class MLP(nn.Module):
    """fc, GELU, proj. With ``fused`` (the trainer sets it from ``train.kernels``) and on CUDA,
    the fc's bias and the GELU run as ``launcher.train.fused.bias_gelu``'s Triton kernels. An
    fc that is not a plain ``nn.Linear`` (torchao's float8 layer) keeps its own forward."""

    def __init__(self, d_model: int, d_ff: int, approximate: str, bias: bool = True):
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff, bias=bias)
        self.proj = nn.Linear(d_ff, d_model, bias=bias)
        self.approximate = approximate
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and fused.available(x) and type(self.fc) is nn.Linear:
            h = fused.bias_gelu(F.linear(x, self.fc.weight), self.fc.bias, self.approximate)
        else:
            h = F.gelu(self.fc(x), approximate=self.approximate)
        return self.proj(h)


class Block(nn.Module):
    """One Transformer block: post-LN (BERT) or pre-LN (GPT). ``checkpoint_activations``
    recomputes its activations in backward, inside ``forward`` (names unchanged)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float,
        *,
        pre_ln: bool,
        bias: bool = True,
    ):
        super().__init__()
        self.pre_ln = pre_ln
        self.checkpoint_activations = False
        eps = GPT_LN_EPS if pre_ln else BERT_LN_EPS
        self.attn = Attention(d_model, n_heads, dropout, causal=pre_ln, bias=bias)
        self.ln1 = LayerNorm(d_model, eps=eps, bias=bias)
        self.mlp = MLP(d_model, d_ff, approximate="tanh" if pre_ln else "none", bias=bias)
        self.ln2 = LayerNorm(d_model, eps=eps, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_activations and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_ln:
            x = x + self.drop(self.attn(self.ln1(x)))
            return x + self.drop(self.mlp(self.ln2(x)))
        x = self.ln1(x + self.drop(self.attn(x)))
        return self.ln2(x + self.drop(self.mlp(x)))


class Embeddings(nn.Module):
    """Word + learned position (+ token type 0 for BERT), then LayerNorm for BERT.
    ``out_dtype`` (``precision.activations``; None: the weights') is the hidden states'."""

    def __init__(
        self,
        vocab_size: int,
        max_positions: int,
        d_model: int,
        dropout: float,
        *,
        bert: bool,
        bias: bool = True,
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_positions, d_model)
        self.tok_type = nn.Embedding(2, d_model) if bert else None
        self.ln = LayerNorm(d_model, eps=BERT_LN_EPS, bias=bias) if bert else None
        self.drop = nn.Dropout(dropout)
        self.out_dtype: torch.dtype | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids) + self.pos.weight[: input_ids.shape[1]]
        if self.tok_type is not None:
            x = x + self.tok_type.weight[0]
        if self.out_dtype is not None:
            x = x.to(self.out_dtype)
        if self.ln is not None:
            x = self.ln(x)
        return self.drop(x)


class MLMHead(nn.Module):
    """BERT's MLM head and loss on the masked positions only."""

    def __init__(self, d_model: int, vocab_size: int, bias: bool = True):
        super().__init__()
        self.dense = nn.Linear(d_model, d_model, bias=bias)
        self.ln = LayerNorm(d_model, eps=BERT_LN_EPS, bias=bias)
        self.bias = nn.Parameter(torch.zeros(vocab_size)) if bias else None
        self.fused = True

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        mask_pos: torch.Tensor,
        decoder: torch.Tensor,
    ) -> torch.Tensor:
        d = hidden.shape[-1]
        picked = hidden.gather(1, mask_pos.unsqueeze(-1).expand(-1, -1, d))
        return linear_cross_entropy(self.transform(picked), decoder, self.bias, labels, self.fused)

    def transform(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ln(F.gelu(self.dense(hidden)))

    def logits(self, hidden: torch.Tensor, decoder: torch.Tensor) -> torch.Tensor:
        return F.linear(self.transform(hidden), decoder, self.bias)


class LMHead(nn.Module):
    """GPT's final LayerNorm, the decoder tied to the word embedding, and the loss."""

    def __init__(self, d_model: int, bias: bool = True):
        super().__init__()
        self.ln = LayerNorm(d_model, eps=GPT_LN_EPS, bias=bias)
        self.fused = True

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        mask_pos: torch.Tensor | None,
        decoder: torch.Tensor,
    ) -> torch.Tensor:
        return linear_cross_entropy(self.ln(hidden), decoder, None, labels, self.fused)

    def logits(self, hidden: torch.Tensor, decoder: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln(hidden), decoder)


class LanguageModel(nn.Module):
    """The trunk BERT and GPT share: embeddings, blocks, a head."""

    bert: bool  # post-LN with token types and an MLM head, else pre-LN with a tied LM head
    embed: Embeddings
    blocks: nn.ModuleList
    head: LMHead | MLMHead

    def __init__(
        self,
        n_layers: int,
        d_model: int,
        n_heads: int,
        d_ff: int,
        vocab_size: int,
        max_positions: int,
        dropout: float = 0.0,
        bias: bool = True,
    ):
        super().__init__()
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, d_ff, dropout, pre_ln=not self.bert, bias=bias)
            for _ in range(n_layers)
        )
        self.embed = Embeddings(
            vocab_size, max_positions, d_model, dropout, bert=self.bert, bias=bias
        )
        self.head = MLMHead(d_model, vocab_size, bias=bias) if self.bert else LMHead(d_model, bias)
        # GPT-2 scales the residual projections by 1/sqrt(2·layers).
        self._init_weights(INIT_STD if self.bert else INIT_STD / math.sqrt(2 * n_layers))

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, mask_pos: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.head(self.hidden(input_ids), labels, mask_pos, self.embed.tok.weight)

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The last block's output, (batch, seq, d_model)."""
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return x

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Every position's logits, (batch, seq, vocab): what Hugging Face's models return.
        Training does not need them (BERT's loss runs the head on the masked positions only)."""
        return self.head.logits(self.hidden(input_ids), self.embed.tok.weight)

    def _init_weights(self, residual_std: float) -> None:
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(".proj") else INIT_STD
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=INIT_STD)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
            if isinstance(module, (nn.Linear, nn.LayerNorm)) and module.bias is not None:
                nn.init.zeros_(module.bias)


class BertForMaskedLM(LanguageModel):
    """Post-LN encoder, learned positions and token types, GELU; MLM head on masked tokens."""

    bert = True


class GPT(LanguageModel):
    """Pre-LN causal decoder with learned positions and a tied LM head (GPT-2 shape)."""

    bert = False
