"""The job spec: what to train and how (one YAML file, ``jobs/*.yaml``).

Keys that scripts and docs rely on are marked *pinned* in their descriptions; keep their
names and meaning. Cross-field checks live in ``JobSpec._cross_checks`` and each names the fix.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from launcher.spec.base import NAME_PATTERN, EnvDict, Port, Strict
from launcher.spec.envforward import DEFAULT_ENV_FORWARD, PATTERN
from launcher.spec.report import ReportSpec

Arch = Literal["bert", "gpt"]
Size = Literal["tiny", "mini", "small", "base", "large"]

# (layers, d_model, heads) per size; the same shapes for BERT and GPT (GPT "base" is GPT-2 124M).
SIZE_PRESETS: dict[str, tuple[int, int, int]] = {
    "tiny": (2, 128, 2),
    "mini": (4, 256, 4),
    "small": (4, 512, 8),
    "base": (12, 768, 12),
    "large": (24, 1024, 16),
}
ARCH_DEFAULTS: dict[str, dict[str, int]] = {
    "bert": {"vocab_size": 30522, "max_positions": 512},
    "gpt": {"vocab_size": 50304, "max_positions": 1024},
}


# Every optional package that can decide the built-in trainer's kernels (JobSpec.kernel_packages):
# cluster.yaml may set a parity policy for each, whether or not a run checks it.
KERNEL_PACKAGES = ("flash-attn-4", "triton", "torchao")
# precision.dtype values device cpu refuses, and the refusal
GPU_DTYPES = {
    "fp16": "fp16 on device cpu is not supported; use bf16 or fp32 (precision.dtype)",
    "tf32": "tf32 is a GPU matmul mode; on device cpu use fp32 or bf16 (precision.dtype)",
    "fp8": "fp8 needs GPUs with FP8 tensor cores (compute capability 8.9 or above); "
    "on device cpu use bf16 or fp32 (precision.dtype)",
}


class ModelSpec(Strict):
    arch: Arch = Field(
        "bert",
        description="pinned. bert: post-LN encoder trained with masked-LM; gpt: pre-LN causal decoder.",
    )
    size: Size = Field(
        "base",
        description="pinned. Preset shape: tiny (2x128), mini (4x256), small (4x512), base (12x768), large (24x1024). Explicit dims below override it.",
    )
    n_layers: int | None = Field(
        None, ge=1, le=256, description="Transformer blocks; overrides the preset."
    )
    d_model: int | None = Field(
        None,
        ge=8,
        le=65536,
        description="Hidden size; overrides the preset. Must divide by n_heads.",
    )
    n_heads: int | None = Field(
        None, ge=1, le=512, description="Attention heads; overrides the preset."
    )
    d_ff: int | None = Field(
        None, ge=8, description="Feed-forward inner size; default 4 x d_model."
    )
    vocab_size: int | None = Field(
        None,
        ge=8,
        le=1_048_576,
        description="Vocabulary size; default 30522 (bert) or 50304 (gpt).",
    )
    max_positions: int | None = Field(
        None,
        ge=8,
        le=1_048_576,
        description="Learned positions; default 512 (bert) or 1024 (gpt). data.seq_len must not exceed it.",
    )
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on embeddings, attention and MLP outputs."
    )
    bias: bool = Field(
        True,
        description="Biases in every linear layer and LayerNorm, as BERT and GPT-2 have them; false drops them, as nanoGPT does. A Hugging Face folder (init_from) needs true.",
    )
    init_from: Path | None = Field(
        None,
        description="A local Hugging Face folder (BertForMaskedLM, BertModel or GPT2LMHeadModel) to start from; its config.json gives the arch and dims. Relative to the job file's folder; nothing is downloaded (hf extra).",
    )

    def dims(self) -> dict[str, int]:
        """The resolved shape: preset, arch defaults, then explicit overrides."""
        layers, d_model, heads = SIZE_PRESETS[self.size]
        out = {"n_layers": layers, "d_model": d_model, "n_heads": heads, **ARCH_DEFAULTS[self.arch]}
        out |= {key: value for key in out if (value := getattr(self, key)) is not None}
        out["d_ff"] = self.d_ff if self.d_ff is not None else 4 * out["d_model"]
        return out

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSpec:
        d = self.dims()
        if d["d_model"] % d["n_heads"]:
            raise ValueError(
                f"d_model {d['d_model']} is not divisible by n_heads {d['n_heads']}; "
                f"choose n_heads among the divisors of {d['d_model']}"
            )
        return self


class DataSpec(Strict):
    source: Literal["synthetic", "tokens", "text"] = Field(
        "synthetic",
        description="pinned. synthetic: structured random tokens made on the device; tokens: a file of token ids; text: text files, tokenized once into a cached token file.",
    )
    seq_len: int = Field(512, ge=8, le=1_048_576, description="pinned. Tokens per sample.")
    path: Path | None = Field(
        None,
        description="source tokens: the token file (.npy, or raw .bin of token ids); source text: a .txt or .jsonl file, or a folder of them (searched recursively). Relative paths are taken from the job file's folder.",
    )
    token_dtype: Literal["uint16", "int32", "int64"] = Field(
        "uint16", description="Element type of a raw .bin token file (.npy files carry their own)."
    )
    mask_prob: float = Field(
        0.15,
        gt=0.0,
        lt=1.0,
        description="BERT: fraction of tokens masked for MLM (80% [MASK], 10% random, 10% kept).",
    )
    tokenizer: Path | None = Field(
        None,
        description="source text: a local folder holding tokenizer.json (hf extra). Relative paths are taken from the job file's folder.",
    )
    text_field: str = Field(
        "text", min_length=1, description="source text: the key of each .jsonl line's text."
    )
    val_path: Path | None = Field(
        None,
        description="source tokens or text: held-out data for train.eval_every, in data.path's format. Relative paths are taken from the job file's folder.",
    )
    val_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="source tokens or text: the fraction of data.path's tokens, at its end, kept out of training for train.eval_every (0: none; data.val_path instead).",
    )
    cache_dir: Path | None = Field(
        None,
        description="source text: where tokenized text is cached (keyed by the text files' and the tokenizer's hashes); default ~/.cache/launcher/tokens. On several nodes a shared folder tokenizes once.",
    )

    @model_validator(mode="after")
    def _path_for_tokens(self) -> DataSpec:
        if self.source == "tokens" and self.path is None:
            raise ValueError("source 'tokens' needs data.path (a .npy or .bin file of token ids)")
        if self.source == "text" and (self.path is None or self.tokenizer is None):
            raise ValueError(
                "source 'text' needs data.path (a .txt or .jsonl file, or a folder of them) "
                "and data.tokenizer (a local tokenizer folder)"
            )
        if self.source == "synthetic" and self.path is not None:
            raise ValueError(
                "data.path is only read when source is 'tokens' or 'text'; set the source or remove path"
            )
        if self.source == "synthetic" and (self.val_path is not None or self.val_fraction):
            raise ValueError(
                "data.val_path and data.val_fraction split a token file or text; synthetic data "
                "draw their held-out samples from a separate seed stream: remove them"
            )
        if self.val_path is not None and self.val_fraction:
            raise ValueError(
                "data.val_path and data.val_fraction are two ways to hold data out; set one"
            )
        if self.source != "text" and self.tokenizer is not None:
            raise ValueError(
                "data.tokenizer is only read when source is 'text'; set source: text or remove tokenizer"
            )
        return self


class CheckpointSpec(Strict):
    model_config = ConfigDict(validate_by_name=True, serialize_by_alias=True)  # and Strict's

    dir: Path | None = Field(
        None,
        description="Checkpoint folder (torch.distributed.checkpoint); null disables checkpoints. Relative to the job file's folder; on several nodes, a shared filesystem.",
    )
    every_steps: int = Field(
        0, ge=0, description="Save every N optimizer steps (0: only at the end when dir is set)."
    )
    resume: Literal["auto", "never"] = Field(
        "auto",
        description="auto: continue from the latest checkpoint in dir if there is one; never: always start fresh.",
    )
    async_save: bool = Field(
        True,
        alias="async",
        description="Write checkpoints in the background (DCP async_save): training waits only while the state is copied to host memory. A checkpoint counts once it is complete.",
    )
    write_threads: int = Field(
        4,
        ge=1,
        le=64,
        description="Threads each rank writes its part of a checkpoint with, each to a file of its own (DCP's FileSystemWriter thread_count).",
    )


class ProfileSpec(Strict):
    start_step: int = Field(
        0,
        ge=0,
        description="First optimizer step to record with torch.profiler (0: no profiling). Recorded steps run slower: do not quote a profiled run's throughput.",
    )
    steps: int = Field(5, ge=1, le=100, description="Optimizer steps to record.")
    ranks: list[int] | Literal["all"] = Field(
        default_factory=lambda: [0],
        description="Global ranks that record (ranks beyond the world size are ignored), or all.",
    )


class TrainSpec(Strict):
    steps: int = Field(200, ge=1, description="pinned. Optimizer steps to run.")
    warmup_steps: int = Field(
        20,
        ge=0,
        description="Steps excluded from throughput (compilation, allocator and cuDNN warm-up).",
    )
    micro_batch: int = Field(32, ge=1, description="pinned. Samples per rank per forward/backward.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches accumulated per optimizer step.")
    lr: float = Field(1.0e-4, gt=0.0, le=10.0, description="Peak learning rate (AdamW).")
    lr_schedule: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Decay after the linear LR warm-up."
    )
    lr_warmup_steps: int = Field(0, ge=0, description="Steps of linear LR warm-up from 0 to lr.")
    min_lr_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="Final LR as a fraction of lr (cosine and linear)."
    )
    weight_decay: float = Field(
        0.01, ge=0.0, description="AdamW weight decay (not applied to biases and norms)."
    )
    grad_clip: float = Field(
        1.0, ge=0.0, description="Clip the global gradient norm to this (0 disables clipping)."
    )
    compile: bool = Field(False, description="torch.compile the model.")
    compile_cache: bool = Field(
        True,
        description="Keep compiled graphs between runs in $LAUNCHER_COMPILE_CACHE (default ~/.cache/launcher/compile; shared by every node on a shared home): loaded by every rank, written by rank 0.",
    )
    compile_scope: Literal["auto", "block", "model"] = Field(
        "auto",
        description="What train.compile compiles as one graph: block (each block apart), model (the whole model), or auto (model in one process, block under DDP or FSDP of several).",
    )
    cuda_graphs: bool = Field(
        False,
        description="Replay the compiled graphs as CUDA graphs (mode reduce-overhead), for less host work per step. Needs train.compile, device cuda and strategy ddp.",
    )
    attention: Literal["auto", "cudnn-fa4", "flash", "cudnn", "efficient", "math"] = Field(
        "auto",
        description="Attention kernels on GPUs: cudnn-fa4 (cuDNN's forward, FlashAttention-4's backward; fa4 extra, compute capability 9.0 or above), auto (cudnn-fa4 where it applies, else torch's choice), or one scaled_dot_product_attention kernel both ways: flash, cudnn, efficient or math.",
    )
    kernels: Literal["auto", "torch"] = Field(
        "auto",
        description="auto: the launcher's Triton kernels for the MLP's bias and GELU and the LM head's loss, on CUDA GPUs of compute capability 8.0 or above; torch: PyTorch's own. The function is the same.",
    )
    weight_grads: Literal["auto", "per-layer"] = Field(
        "auto",
        description="auto: where the whole model compiles as one graph on a CUDA GPU with bf16 weights, each linear's weight gradients over all layers are one batched product at the end of the backward; per-layer: each in its own layer's backward.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each block's activations in backward (less memory, ~30% more compute).",
    )
    seed: int = Field(
        1234,
        ge=0,
        description="Seed for weights and data (synthetic tokens and MLM masks are a function of the seed and the global sample index, so they do not depend on the world size).",
    )
    log_every: int = Field(
        10,
        ge=1,
        description="Log and write a metrics record every N steps (the only steps that synchronise the device).",
    )
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="A non-finite loss or gradient norm: stop the run (exit 4, naming the step), or skip that step's update and go on.",
    )
    max_nonfinite_skips: int = Field(
        10,
        ge=1,
        description="on_nonfinite skip: stop once more than this many steps in a row were skipped.",
    )
    eval_every: int = Field(
        0,
        ge=0,
        description="Compute eval_loss on held-out data every N steps and at the last step (0: never).",
    )
    eval_steps: int = Field(10, ge=1, description="Micro-batches per rank in each evaluation.")
    elastic_batch: Literal["keep", "scale"] = Field(
        "keep",
        description="After an elastic restart at another world size: keep the global batch (grad_accum adjusted) or scale it with the world size. Either way the data go on at the next sample.",
    )
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec, description="Periodic checkpoints and resume."
    )
    profile: ProfileSpec = Field(
        default_factory=ProfileSpec,
        description="torch.profiler over a few steps: a Chrome/Perfetto trace and a table of the top operators per recording rank, in the run directory's profile/ folder.",
    )


class DDPSpec(Strict):
    bucket_cap_mb: float = Field(
        25.0,
        gt=0,
        description="Gradient bucket size for all-reduce overlap (smaller buckets start sooner and leave less exposed at the end of backward).",
    )
    static_graph: bool = Field(
        False,
        description="The graph is the same every step: DDP's static-graph mode (static_graph=True). Measure before turning it on: benchmarks/RESULTS.md compares it with the default.",
    )
    gradient_as_bucket_view: bool = Field(
        True,
        description="Gradients are views into the all-reduce buckets (saves a copy and memory).",
    )
    comm_hook: Literal["none", "bf16", "fp16"] = Field(
        "none", description="Compress gradients to this dtype for all-reduce."
    )


class FSDPSpec(Strict):
    reshard_after_forward: bool = Field(
        True,
        description="Free gathered parameters after the forward (ZeRO-3); false keeps them until the backward (more memory, fewer all-gathers).",
    )
    param_dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="Dtype of gathered parameters for compute; auto follows precision.dtype.",
    )
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Dtype of gradient reduce-scatter."
    )
    cpu_offload: bool = Field(
        False, description="Keep sharded parameters and optimizer state in host memory."
    )
    blocks_per_unit: int = Field(
        1,
        ge=1,
        description="Transformer blocks per FSDP unit (one all-gather and one reduce-scatter each): more blocks per unit cost less host time per step and more memory.",
    )


class ParallelSpec(Strict):
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="pinned. ddp: replicate and all-reduce gradients; fsdp: shard parameters, gradients and optimizer state (FSDP2).",
    )
    ddp: DDPSpec = Field(default_factory=DDPSpec, description="DDP settings (strategy ddp).")
    fsdp: FSDPSpec = Field(default_factory=FSDPSpec, description="FSDP settings (strategy fsdp).")


class PrecisionSpec(Strict):
    dtype: Literal["fp32", "tf32", "bf16", "fp16", "fp8"] = Field(
        "bf16",
        description="pinned. fp32; tf32 (TF32 matmuls); bf16 or fp16 autocast (fp16 with a GradScaler); fp8: torchao's float8 training for the blocks' linear layers and bf16 elsewhere (compute capability 8.9 or above, fp8 extra).",
    )
    fp8_recipe: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise",
        description="Read with dtype fp8 only: torchao's scaling recipe. tensorwise: one dynamic scale per tensor (cuBLAS, the fastest); rowwise: one scale per row (CUTLASS, more accurate).",
    )
    fp8_layers: Literal["auto", "all"] = Field(
        "auto",
        description="With dtype fp8, which blocks' linear layers run in float8: auto, those torchao's size filter expects to gain; all, every one whose dims divide by 16.",
    )
    activations: Literal["auto", "fp32"] = Field(
        "auto",
        description="The hidden states' dtype between layers under bf16 and fp8 autocast: auto keeps them bf16; fp32 as plain autocast leaves them.",
    )
    weights: Literal["auto", "bf16", "fp32"] = Field(
        "auto",
        description="The weights under bf16: bf16 weights with fp32 masters in the optimizer (needs grad_accum 1 and no FSDP sharding), or fp32 weights that autocast casts; auto picks bf16 on a CUDA GPU with Triton.",
    )


def bf16_weights_obstacles(*, dtype: str, grad_accum: int, sharded: bool) -> list[str]:
    """Why ``precision.weights: bf16`` cannot apply to a run (empty where it can); the trainer
    asks again with the world size."""
    reasons = []
    if dtype != "bf16":
        reasons.append(f"they keep fp32 masters for bf16 training, and precision.dtype is {dtype}")
    if grad_accum != 1:
        reasons.append(
            f"bf16 gradients are not summed over micro-batches, and train.grad_accum is {grad_accum} "
            f"(raise train.micro_batch instead)"
        )
    if sharded:
        reasons.append("FSDP shards the weights here (its mixed precision keeps fp32 shards)")
    return reasons


def bf16_weights_refusal(reasons: list[str]) -> str:
    """The one-paragraph error for ``precision.weights: bf16`` where it cannot apply."""
    return (
        "precision.weights bf16 (bf16 weights with fp32 masters) cannot apply to this run: "
        + "; ".join(reasons)
        + ". Set precision.weights to auto or fp32."
    )


def cudnn_fa4_obstacles(*, head_dim: int, half: bool, dropout: float) -> list[str]:
    """Why ``train.attention: cudnn-fa4`` cannot run a model, from the spec alone (the trainer
    adds the GPU and the package); empty where nothing stands in the way."""
    reasons = []
    if head_dim % 8 or head_dim > 128:
        reasons.append(
            f"the head dimension (d_model / n_heads) is {head_dim}, and cuDNN's and FA4's kernels "
            "here take multiples of 8 up to 128"
        )
    if not half:
        reasons.append(
            "FlashAttention-4 takes bf16 or fp16 inputs (precision.dtype bf16, fp16 or fp8)"
        )
    if dropout > 0:
        reasons.append(
            "neither kernel pair applies attention dropout here (model.dropout must be 0)"
        )
    return reasons


def cudnn_fa4_refusal(reasons: list[str]) -> str:
    """The one-paragraph error for ``train.attention: cudnn-fa4`` where it cannot run."""
    return (
        "cudnn-fa4 (cuDNN's forward, FlashAttention-4's backward) cannot run this job: "
        + "; ".join(reasons)
        + ". Set train.attention: auto."
    )


class CudnnSpec(Strict):
    benchmark: bool = Field(
        True,
        description="torch.backends.cudnn.benchmark: search the fastest algorithm per shape (good for fixed shapes).",
    )
    deterministic: bool = Field(
        False,
        description="Reproducible runs: cuDNN deterministic, torch.use_deterministic_algorithms, seeds everywhere, TF32 off (slower).",
    )


class NCCLSpec(Strict):
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="Process-group backend; auto: nccl on cuda, gloo on cpu."
    )
    timeout_s: int = Field(600, ge=1, le=86400, description="Collective timeout in seconds.")
    env: EnvDict = Field(
        default_factory=lambda: {"NCCL_DEBUG": "WARN"},
        description="Environment for every worker (NCCL_* and others).",
    )


class ResourcesSpec(Strict):
    nodes: Literal["all"] | int = Field(
        "all", description="pinned. How many cluster nodes to use, from the first: all, or a count."
    )
    nproc_per_node: Literal["auto"] | int = Field(
        "auto", description="pinned. Workers per node; auto = the node's GPUs (cuda) or 1 (cpu)."
    )
    device: Literal["cuda", "cpu"] = Field("cuda", description="pinned. Where workers compute.")
    min_nodes: int | None = Field(
        None,
        ge=1,
        description="Elastic restarts: with launch.max_restarts above 0, a failed node is left out (or a spare takes its place) and the job restarts on at least this many nodes. Unset: not elastic.",
    )

    @model_validator(mode="after")
    def _positive(self) -> ResourcesSpec:
        if isinstance(self.nodes, int) and self.nodes < 1:
            raise ValueError(f"nodes must be 'all' or a count >= 1, not {self.nodes}")
        if isinstance(self.nproc_per_node, int) and not 1 <= self.nproc_per_node <= 1024:
            raise ValueError(f"nproc_per_node must be 'auto' or 1..1024, not {self.nproc_per_node}")
        if isinstance(self.nodes, int) and (self.min_nodes or 0) > self.nodes:
            raise ValueError(
                f"min_nodes {self.min_nodes} is more than the job's {self.nodes} node(s); "
                f"lower resources.min_nodes or raise resources.nodes"
            )
        return self


class LaunchSpec(Strict):
    max_restarts: int = Field(
        0,
        ge=0,
        le=100,
        description="Restart the job this many times after a failure, with fresh torchruns on a new port; the built-in trainer resumes from its last checkpoint.",
    )
    env: EnvDict = Field(default_factory=dict, description="Extra environment for every worker.")
    env_forward: list[str] = Field(
        default_factory=lambda: list(DEFAULT_ENV_FORWARD),
        description="The launching shell's variables that reach workers on the other nodes: name patterns as in a .gitignore (*, ?, [..]; !PATTERN leaves names out; the last match wins). This machine's node gets the whole shell, as under torchrun.",
    )
    master_port: Port | None = Field(
        None, description="Rendezvous port on the first node; null picks a free one there."
    )
    hang_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Fail the job when a rank writes no metrics record for this long (a hang watchdog; before a rank's first record, at least 120 s), after writing every rank's Python stack to stacks/rank<R>.txt; null disables it.",
    )
    stop_grace_s: float = Field(
        5.0,
        gt=0,
        le=120,
        description="Seconds each stop signal has before the next: on Ctrl-C, SIGINT, then SIGTERM, then SIGKILL; otherwise SIGTERM, then SIGKILL.",
    )

    @model_validator(mode="after")
    def _patterns(self) -> LaunchSpec:
        bad = [p for p in self.env_forward if not PATTERN.match(p)]
        if bad:
            raise ValueError(
                f"env_forward pattern(s) {', '.join(map(repr, bad))} are not variable-name "
                f"patterns; use letters, digits, _, and * ? [..] (a leading ! leaves names out)"
            )
        return self


DEFAULT_EXCLUDE = (
    ".git",
    "__pycache__",
    "*.pyc",
    ".venv/",
    "runs/",
    "checkpoints/",
    "ckpt/",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.safetensors",
)


class ScriptEntrypoint(Strict):
    script: Path = Field(
        description="A torchrun-ready Python script, relative to workdir (or absolute). Where the workdir travels to other nodes, the script must lie inside it."
    )
    args: list[str] = Field(default_factory=list, description="Arguments after the script.")
    workdir: Path | None = Field(
        None,
        description="The script's current directory on every node, as `cd workdir && torchrun ...` would have it. Default: the job file's folder, from which relative paths are taken.",
    )
    sync: Literal["auto", True, False] = Field(
        "auto",
        description="How the workdir reaches the nodes: auto copies it through Ray to nodes that are not this machine; true always runs in a copy; false expects a shared filesystem and checks its code hash on every node.",
    )
    exclude: list[str] = Field(
        default_factory=lambda: list(DEFAULT_EXCLUDE),
        description="gitignore-style patterns left out of the copy and the code hash; replaces the default list (.gitignore files are not read).",
    )

    @model_validator(mode="after")
    def _patterns(self) -> ScriptEntrypoint:
        for pattern in self.exclude:
            if not pattern.strip("/").strip():
                raise ValueError(f"entrypoint.exclude has an empty pattern {pattern!r}; remove it")
            if pattern.startswith("!"):
                raise ValueError(
                    f"entrypoint.exclude pattern {pattern!r}: re-including with '!' is not "
                    f"supported; narrow the pattern that excludes it instead"
                )
        return self


class JobSpec(Strict):
    name: str = Field(
        pattern=NAME_PATTERN,
        description="pinned. Job name (letters, digits, . _ -); names the run directory.",
    )
    model: ModelSpec = Field(
        default_factory=ModelSpec,
        description="pinned. The Transformer to train (built-in trainer).",
    )
    data: DataSpec = Field(default_factory=DataSpec, description="pinned. Where batches come from.")
    train: TrainSpec = Field(
        default_factory=TrainSpec, description="Steps, batch, optimizer and loop settings."
    )
    parallel: ParallelSpec = Field(default_factory=ParallelSpec, description="pinned. DDP or FSDP.")
    precision: PrecisionSpec = Field(
        default_factory=PrecisionSpec, description="pinned. Numeric precision."
    )
    cudnn: CudnnSpec = Field(default_factory=CudnnSpec, description="cuDNN settings.")
    nccl: NCCLSpec = Field(default_factory=NCCLSpec, description="Collective backend settings.")
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="pinned. Nodes, workers per node and device."
    )
    launch: LaunchSpec = Field(
        default_factory=LaunchSpec, description="torchrun and worker settings."
    )
    entrypoint: Literal["builtin"] | ScriptEntrypoint = Field(
        "builtin",
        description="pinned. builtin (the launcher's Transformer trainer) or {script: path.py, args: [...], workdir: ., sync: auto, exclude: [...]}.",
    )
    report: ReportSpec = Field(
        default_factory=ReportSpec,
        description="Where the run's metrics go besides the run directory: TensorBoard, MLflow.",
    )

    @property
    def backend(self) -> str:
        """The process-group backend this job uses."""
        if self.nccl.backend != "auto":
            return self.nccl.backend
        return "nccl" if self.resources.device == "cuda" else "gloo"

    def fsdp_shards(self, world_size: int) -> bool:
        """Whether FSDP shards the model at ``world_size`` ranks: strategy fsdp on more than one
        rank, or with ``parallel.fsdp.cpu_offload`` on any number (one process without it has
        nothing to shard and trains the model unwrapped, ``launcher.train.parallel``)."""
        return self.parallel.strategy == "fsdp" and (
            world_size > 1 or self.parallel.fsdp.cpu_offload
        )

    @property
    def elastic(self) -> bool:
        """A restart may leave a failed node out (resources.min_nodes set, launch.max_restarts above 0)."""
        return self.launch.max_restarts > 0 and self.resources.min_nodes is not None

    @property
    def uses_builtin(self) -> bool:
        return self.entrypoint == "builtin"

    @property
    def script_entry(self) -> ScriptEntrypoint | None:
        """The user's script entrypoint; None for the built-in trainer."""
        return self.entrypoint if isinstance(self.entrypoint, ScriptEntrypoint) else None

    @property
    def kernel_packages(self) -> list[str]:
        """Optional packages that change the built-in trainer's kernels, so preflight checks
        every node has the same version of each (or none)."""
        if not self.uses_builtin or self.resources.device != "cuda":
            return []
        wanted = ["flash-attn-4"] if self.train.attention in ("auto", "cudnn-fa4") else []
        if self.train.kernels == "auto" or self.precision.weights != "fp32":
            wanted.append("triton")
        return wanted + (["torchao"] if self.precision.dtype == "fp8" else [])

    @property
    def records_profile(self) -> bool:
        """train.profile is on (the cross-checks allow it with the built-in trainer only)."""
        return self.train.profile.start_step > 0

    @model_validator(mode="after")
    def _cross_checks(self) -> JobSpec:
        dev = self.resources.device
        if dev == "cpu":
            if self.precision.dtype in GPU_DTYPES:
                raise ValueError(GPU_DTYPES[self.precision.dtype])
            if self.train.attention not in ("auto", "math"):
                raise ValueError(
                    f"train.attention {self.train.attention} is a GPU kernel; on device cpu use auto or math"
                )
            if self.parallel.ddp.comm_hook == "bf16" and self.parallel.strategy == "ddp":
                raise ValueError(
                    "parallel.ddp.comm_hook bf16 needs CUDA GPUs and NCCL; on device cpu use fp16 or none"
                )
            if self.parallel.strategy == "fsdp" and self.parallel.fsdp.cpu_offload:
                raise ValueError(
                    "parallel.fsdp.cpu_offload moves the shards from the GPUs to host memory; on device "
                    "cpu they are there already (offloading to the CPU is meaningless): set "
                    "parallel.fsdp.cpu_offload: false"
                )
            if self.nccl.backend == "nccl":
                raise ValueError(
                    "the nccl backend needs GPUs; with resources.device cpu set nccl.backend to gloo or auto"
                )
        if self.uses_builtin:
            max_pos = self.model.dims()["max_positions"]
            if self.data.seq_len > max_pos:
                raise ValueError(
                    f"data.seq_len {self.data.seq_len} exceeds the model's {max_pos} positions; "
                    f"lower data.seq_len or raise model.max_positions"
                )
            if self.train.warmup_steps >= self.train.steps:
                raise ValueError(
                    f"train.warmup_steps ({self.train.warmup_steps}) must be below train.steps "
                    f"({self.train.steps}), or no step is measured"
                )
        prof = self.train.profile
        if prof.start_step and prof.start_step + prof.steps - 1 > self.train.steps:
            raise ValueError(
                f"train.profile records steps {prof.start_step}..{prof.start_step + prof.steps - 1}, past "
                f"train.steps ({self.train.steps}); lower train.profile.start_step or steps"
            )
        if prof.start_step and not self.uses_builtin:
            raise ValueError(
                "train.profile works with the built-in trainer only; profile your own script inside it"
            )
        if self.elastic and self.uses_builtin and self.train.checkpoint.dir is None:
            raise ValueError(
                "an elastic job (resources.min_nodes with launch.max_restarts above 0) "
                "restarts from its last checkpoint: set train.checkpoint.dir to a folder every "
                "node sees, and train.checkpoint.every_steps"
            )
        held_out = self.data.source == "synthetic" or self.data.val_path or self.data.val_fraction
        if self.uses_builtin and self.train.eval_every and not held_out:
            raise ValueError(
                f"train.eval_every needs held-out data for source {self.data.source}: set "
                f"data.val_path (a file like data.path) or data.val_fraction (e.g. 0.01: the "
                f"end of data.path kept out of training)"
            )
        if self.train.checkpoint.every_steps and self.train.checkpoint.dir is None:
            raise ValueError("train.checkpoint.every_steps needs train.checkpoint.dir")
        if self.cudnn.deterministic and self.cudnn.benchmark:
            raise ValueError(
                "cudnn.deterministic and cudnn.benchmark exclude each other; set cudnn.benchmark: false"
            )
        if self.cudnn.deterministic and self.precision.dtype == "tf32":
            raise ValueError("cudnn.deterministic turns TF32 off; use precision.dtype fp32 or bf16")
        if self.train.cuda_graphs:
            if not self.train.compile:
                raise ValueError(
                    "train.cuda_graphs replays compiled graphs; set train.compile: true"
                )
            if dev != "cuda":
                raise ValueError("train.cuda_graphs needs resources.device cuda")
            if self.parallel.strategy != "ddp":
                raise ValueError(
                    "train.cuda_graphs works with strategy ddp; FSDP re-allocates the gathered "
                    "parameters between graphs (set train.cuda_graphs: false)"
                )
        # The fewest ranks the spec allows (1 for what the cluster decides); the world size may
        # be larger: refusal_at and the trainer ask again.
        counts = (self.resources.nodes, self.resources.nproc_per_node)
        least = math.prod(n for n in counts if isinstance(n, int))
        if refusal := _bf16_weights_refusal_at(self, least):
            raise ValueError(refusal)
        if self.uses_builtin and self.train.attention == "cudnn-fa4":
            dims = self.model.dims()
            reasons = cudnn_fa4_obstacles(
                head_dim=dims["d_model"] // dims["n_heads"],
                half=self.precision.dtype in ("bf16", "fp16", "fp8"),
                dropout=self.model.dropout,
            )
            if reasons:
                raise ValueError(cudnn_fa4_refusal(reasons))
        if self.parallel.strategy == "fsdp" and self.parallel.ddp.comm_hook != "none":
            raise ValueError(
                "parallel.ddp.comm_hook applies to ddp; for fsdp use parallel.fsdp.reduce_dtype"
            )
        return self


def refusal_at(job: JobSpec, world_size: int) -> str | None:
    """Why the built-in trainer would refuse ``job`` on ``world_size`` ranks, as one paragraph;
    None where the spec finds nothing. The job's checks run again (``model_copy`` skips them),
    then those that need the world size."""
    try:
        job = JobSpec.model_validate(job.model_dump())
    except ValidationError as err:
        return "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())
    return _bf16_weights_refusal_at(job, world_size) if job.uses_builtin else None


def _bf16_weights_refusal_at(job: JobSpec, world_size: int) -> str | None:
    if job.precision.weights != "bf16":
        return None
    reasons = bf16_weights_obstacles(
        dtype=job.precision.dtype,
        grad_accum=job.train.grad_accum,
        sharded=job.fsdp_shards(world_size),
    )
    return bf16_weights_refusal(reasons) if reasons else None
