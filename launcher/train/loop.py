"""The training loop in named stages: init_distributed → configure_runtime → build_model →
build_optimizer → build_data → resume → allocate_grads → train (train_step per step) → close.
The host waits for the device only on log steps, after the first step, at evaluations and at
checkpoints.
"""

from __future__ import annotations

import logging
import math
import os
import random
import socket
import time
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from launcher.errors import NonFiniteError
from launcher.metrics import write_record
from launcher.spec.job import JobSpec, TrainSpec
from launcher.train import attention, fused, parallel
from launcher.train.checkpoint import Checkpointer, latest_checkpoint
from launcher.train.collector import ManualCollector
from launcher.train.compile_cache import (
    CompileCache,
    cache_autograd_functions,
    cache_hits,
    open_cache,
)
from launcher.train.data import build_data, build_val_batches
from launcher.train.health import stop_reason
from launcher.train.hf import load_pretrained
from launcher.train.meter import (
    CudaTimer,
    GpuMonitor,
    HostTimer,
    Meter,
    final_line,
    peak_memory_gib,
    peak_tflops,
    progress_line,
)
from launcher.train.model import (
    MLP,
    Attention,
    LMHead,
    MLMHead,
    build_model,
    count_params,
    describe,
    flops_per_token,
)
from launcher.train.optim import MasterAdamW, MasterWeights, choose_weights, substitute_masters
from launcher.train.profiling import StepProfiler
from launcher.util import free_port, process_started

log = logging.getLogger(__name__)

StepCallback = Callable[[int], None]


def train(job: JobSpec, *, on_step: StepCallback | None = None) -> dict[str, Any]:
    """Train ``job`` with the built-in trainer; returns this rank's ``final`` record.
    ``on_step(step)`` runs after every optimizer step (and its checkpoint), on every rank."""
    with Trainer(job) as trainer:
        return trainer.train(on_step=on_step)


def lr_factor(i: int, spec: TrainSpec) -> float:
    """LR multiplier for optimizer step index ``i`` (0-based): linear warm-up from 1/W to 1
    over ``lr_warmup_steps``, then cosine, linear or constant decay towards ``min_lr_ratio``
    (reached at the last step for linear and cosine)."""
    warm = spec.lr_warmup_steps
    if i < warm:
        return (i + 1) / warm
    if spec.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (i - warm) / max(1, spec.steps - warm - 1))
    lo = spec.min_lr_ratio
    if spec.lr_schedule == "linear":
        return 1.0 - (1.0 - lo) * progress
    return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (linear weights, embeddings); none on biases and norms."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class Trainer:
    """One rank of a training job. Construction runs every stage up to the first step; ``close``
    (or leaving a ``with`` block) ends it."""

    def __init__(self, job: JobSpec):
        self.job = job
        self.gpu: GpuMonitor | None = None
        self._contexts = ExitStack()  # process-wide settings held for the trainer's lifetime
        # Seconds per start-up stage, for the meta record; "process" is Python's start and imports.
        started = process_started()
        self.startup_s: dict[str, float] = {
            "process": round(time.time() - started, 3) if started else 0.0
        }
        try:
            for name, stage in (
                ("init_distributed", self.init_distributed),
                ("configure_runtime", self.configure_runtime),
                ("build_model", self.build_model),
                ("compile_cache", self.load_compile_cache),
                ("build_optimizer", self.build_optimizer),
                ("build_data", self.build_data),
                ("resume", self.resume),
            ):
                begun = time.perf_counter()
                stage()
                self.startup_s[name] = round(time.perf_counter() - begun, 3)
            self.allocate_grads()
            self.build_meter()
        except BaseException:
            self.close()
            raise

    # -- stages ------------------------------------------------------------------------

    def init_distributed(self) -> None:
        """Join the process group torchrun set up (or make a one-process group without it)."""
        if "RANK" not in os.environ:  # plain `python -m launcher.train`: world of one
            os.environ.update(
                RANK="0",
                LOCAL_RANK="0",
                WORLD_SIZE="1",
                LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()),
            )
        self.rank = int(os.environ["RANK"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.world_size = int(os.environ["WORLD_SIZE"])
        job = self.job
        if job.resources.device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(
                    "resources.device is cuda but torch sees no GPU; set resources.device: cpu"
                )
            if job.cudnn.deterministic:  # cuBLAS reads it when its handle is created
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets 1 with several workers
                local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        dist.init_process_group(
            # gloo beside NCCL for CPU-offloaded shards
            backend=parallel.process_group_backend(job),
            timeout=timedelta(seconds=job.nccl.timeout_s),
            device_id=self.device if self.device.type == "cuda" else None,
        )

    def configure_runtime(self) -> None:
        """Precision modes, cuDNN, determinism and seeds."""
        job = self.job
        dtype = job.precision.dtype
        tf32 = dtype == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cudnn.benchmark = job.cudnn.benchmark
        torch.backends.cudnn.deterministic = job.cudnn.deterministic
        if job.cudnn.deterministic:
            torch.use_deterministic_algorithms(True)
        seed = job.train.seed
        random.seed(seed)
        torch.manual_seed(seed)  # same weights on every rank (also seeds every CUDA device)
        # The dtype autocast computes in (fp8: bf16 outside float8 matmuls); None for fp32, tf32.
        compute = parallel.DTYPES[dtype]
        self.autocast_dtype = None if compute == torch.float32 else compute
        # The hidden states' dtype under autocast (precision.activations); None without autocast.
        bf16_states = self.autocast_dtype == torch.bfloat16 and job.precision.activations == "auto"
        states = torch.bfloat16 if bf16_states else torch.float32
        self.activation_dtype = None if self.autocast_dtype is None else states
        # auto resolved: cudnn-fa4 where FlashAttention-4 can run (launcher.train.attention)
        dims = job.model.dims()
        self.attention = attention.choose(
            job.train.attention,
            device=self.device,
            dtype=self.autocast_dtype,
            dropout=job.model.dropout,
            head_dim=dims["d_model"] // dims["n_heads"],
        )
        # auto resolved: bf16 weights with fp32 masters where they apply (launcher.train.optim)
        # FSDP wraps the model only where there is something to shard (parallel.parallelize).
        self.sharded = job.fsdp_shards(self.world_size)
        self.weights = choose_weights(
            job.precision.weights,
            dtype=job.precision.dtype,
            device=self.device,
            grad_accum=job.train.grad_accum,
            sharded=self.sharded,
        )
        if self.world_size > 1:  # DDP needs one weight dtype on every rank: rank 0's choice
            # (a rank without Triton updates bf16 weights with the torch reference, slower but alike)
            choice = [self.weights]
            dist.broadcast_object_list(choice, src=0)
            self.weights = choice[0]
        if self.attention not in ("auto", "cudnn-fa4") and self.device.type == "cuda":
            # Set before anything compiles: torch.compile picks the kernel when it traces.
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend = {
                "flash": SDPBackend.FLASH_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "math": SDPBackend.MATH,
            }[self.attention]
            self._contexts.enter_context(sdpa_kernel([backend]))

    def build_model(self) -> None:
        job = self.job
        spec, seq_len, mask_prob = job.model, job.data.seq_len, job.data.mask_prob
        # Weights from a folder go into the model before anything wraps it (docs/trainer.md).
        init = spec.init_from is not None
        offload = self.sharded and job.parallel.fsdp.cpu_offload
        fill_shards = init and self.sharded and not offload  # built on meta, filled after sharding
        where = "cpu" if init and offload else "meta" if fill_shards else self.device
        with torch.device(where):
            model = build_model(spec)
        if init and not fill_shards:  # a plain module on its device (or on the CPU for offload)
            load_pretrained(
                model,
                spec,
                device=torch.device("cpu") if offload else self.device,
                every_rank=offload,
            )
        model.embed.out_dtype = self.activation_dtype
        use_kernels = job.train.kernels == "auto" and fused.supported(self.device)
        for module in model.modules():
            if isinstance(module, (MLP, MLMHead, LMHead)):
                module.fused = use_kernels
            elif isinstance(module, Attention):
                module.packed = self.attention == "cudnn-fa4"
        self.n_params = count_params(model)
        self.flops_per_token = flops_per_token(spec, seq_len=seq_len, mask_prob=mask_prob)
        # bf16 weights: fp32 masters taken from the weights as built or loaded, before DDP
        # wraps the model (its buckets take the parameters' dtype).
        trained = [p for p in model.parameters() if p.requires_grad]
        self.masters = MasterWeights(trained) if self.weights == "bf16" else None
        self.model = parallel.parallelize(
            model, job, device=self.device, world_size=self.world_size
        )
        if fill_shards:  # sharded on the meta device, filled from rank 0's copy
            load_pretrained(self.model, spec, device=self.device)
        self.model.train()
        # Accumulating over replayed CUDA graphs needs gradients with memory of their own
        # (allocate_grads, after the resume); one backward a step can take the graph's.
        self.grads_in_place = job.train.cuda_graphs and job.train.grad_accum > 1
        self.trained_params = [p for p in self.model.parameters() if p.requires_grad]

    def load_compile_cache(self) -> None:
        """Hand the job's cached compiled graphs to torch before anything compiles
        (``launcher.train.compile_cache``); they compile on the first step."""
        self.compile_cache: CompileCache | None = None
        if not self.job.train.compile:
            return
        cache_autograd_functions()
        if self.job.train.compile_cache:
            self.compile_cache = open_cache(
                self.job, device=self.device, rank=self.rank, world_size=self.world_size
            )
            self.compile_cache.load()

    def build_optimizer(self) -> None:
        t = self.job.train
        fsdp = self.job.parallel.strategy == "fsdp"
        # Fused AdamW needs the parameters on the GPU, and rejects ShardedGradScaler's
        # found-inf tensor (shape [1], fused wants []): fp16 under FSDP uses foreach AdamW.
        on_gpu = self.device.type == "cuda" and not (
            fsdp and (self.job.parallel.fsdp.cpu_offload or self.job.precision.dtype == "fp16")
        )
        betas = (0.9, 0.95) if self.job.model.arch == "gpt" else (0.9, 0.999)
        groups = param_groups(self.model, t.weight_decay)
        self.optimizer: torch.optim.Optimizer
        # bf16 weights: AdamW on their fp32 masters, one kernel a group
        if self.masters is not None:
            self.optimizer = MasterAdamW(groups, self.masters, lr=t.lr, betas=betas)
        else:
            self.optimizer = torch.optim.AdamW(
                groups, lr=t.lr, betas=betas, **({"fused": True} if on_gpu else {})
            )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda i: lr_factor(i, t)
        )
        self.scaler: torch.amp.GradScaler | None = None
        if self.job.precision.dtype == "fp16":
            if parallel.is_sharded(self.model):
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.scaler = ShardedGradScaler()  # all-reduces found-inf across shards
            else:
                self.scaler = torch.amp.GradScaler("cuda")
        # Clipping folded into the fused kernel (clip_gradients; MasterAdamW always folds it); a
        # GradScaler owns that slot when there is one, and sharded gradients keep the in-place multiply.
        self.clip_in_optimizer = (
            on_gpu and self.scaler is None and not parallel.is_sharded(self.model)
        )

    def build_data(self) -> None:
        """The training batches and, with ``train.eval_every``, the held-out batches every
        evaluation reads (made once, kept on the device)."""
        self.data = build_data(
            self.job, rank=self.rank, world_size=self.world_size, device=self.device
        )
        self.val_batches: list[dict[str, torch.Tensor]] = []
        if self.job.train.eval_every:
            self.val_batches = build_val_batches(
                self.job, rank=self.rank, world_size=self.world_size, device=self.device
            )

    def resume(self) -> None:
        """Continue from the latest complete checkpoint where there is one (``start_step``)."""
        job = self.job
        self.checkpointer = Checkpointer(
            job.train.checkpoint,
            rank=self.rank,
            data=self.data,
            elastic_batch=job.train.elastic_batch,
        )
        self.start_step = self.checkpointer.maybe_resume(
            self.model, self.optimizer, self.scheduler, self.scaler
        )

    def allocate_grads(self) -> None:
        """Give every trained parameter its own gradient memory where the micro-batches are
        summed into it (``grads_in_place``); after the resume, which needs ``.grad`` None."""
        if self.grads_in_place:
            for p in self.trained_params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)

    def build_meter(self) -> None:
        job, t = self.job, self.job.train
        cuda = self.device.type == "cuda"
        name = torch.cuda.get_device_name(self.device) if cuda else _cpu_name()
        # fp8 against the bf16 peak: only some matmuls run in float8, and the same peak for both
        # makes an fp8 run's MFU over a bf16 run's MFU its speed-up.
        peak_dtype = "bf16" if job.precision.dtype == "fp8" else job.precision.dtype
        self.peak_tflops = peak_tflops(name, peak_dtype) if cuda else None
        self.gpu = GpuMonitor(self.device)
        tokens = t.micro_batch * t.grad_accum * job.data.seq_len
        self.meter = Meter(
            total_steps=t.steps,
            start_step=self.start_step,
            warmup_steps=t.warmup_steps,
            log_every=t.log_every,
            tokens_per_step=tokens,
            samples_per_step=t.micro_batch * t.grad_accum,
            flops_per_token=self.flops_per_token,
            peak_tflops=self.peak_tflops,
            timer=CudaTimer() if cuda else HostTimer(),
            sync=(lambda: torch.cuda.synchronize(self.device)) if cuda else (lambda: None),
            reduce_loss=parallel.all_reduce_mean,
            peak_mem_gib=lambda: peak_memory_gib(self.device),
            gpu=self.gpu,
            lr=lambda step: t.lr * lr_factor(step - 1, t),  # the scheduler's rule (LambdaLR)
            read_late=cuda,  # the GPU runs the next step while the host logs
            # read before a checkpoint (a checkpoint holds finite steps only) and at evaluations
            also_log=lambda step: self.checkpointer.due(step, t.steps) or self.eval_due(step),
            norm_counts=self.scaler is None,  # a loss scaler skips its overflows itself
            skips=t.on_nonfinite == "skip",
        )
        write_record(
            {
                "type": "meta",
                "local_rank": self.local_rank,
                "world_size": self.world_size,
                "host": socket.gethostname(),
                "device": str(self.device),
                "device_name": name,
                "params": self.n_params,
                "flops_per_token": self.flops_per_token,
                "peak_tflops": self.peak_tflops,
                "seq_len": job.data.seq_len,
                "micro_batch": t.micro_batch,
                "grad_accum": t.grad_accum,
                "job": job.name,
                "arch": job.model.arch,
                "strategy": job.parallel.strategy,
                "precision": job.precision.dtype,
                "weights": self.weights,
                "attention": self.attention,
                "start_step": self.start_step,
                # Where this attempt starts (an elastic restart may change the world size).
                "global_batch": self.data.global_batch,
                "start_sample": self.data.first_sample(self.start_step + 1),
                **self.checkpointer.record(),
                "restart_count": int(os.environ.get("LAUNCHER_RESTART_COUNT") or 0),
                "peak_mem_source": "cuda_max_memory_allocated" if cuda else "host_peak_rss",
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "startup_s": self.startup_s,
            }
        )

    # -- the loop ------------------------------------------------------------------------

    def forward_backward(self, step: int, micro: int) -> torch.Tensor:
        """One micro-batch: forward under autocast, loss scaled for accumulation, backward."""
        accum = self.job.train.grad_accum
        with self.meter.data_wait():
            batch = self.data.batch(step, micro)
        # a new replay generation: the last micro-batch's outputs are done
        if self.job.train.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        sync = self.syncs(step, micro)
        keep = not self.job.parallel.fsdp.reshard_after_forward
        with parallel.gradient_sync(self.model, sync, keep_gathered=keep):
            with self._autocast():
                loss = self.model(**batch) / accum
            self.backward(self.scaler.scale(loss) if self.scaler else loss, micro, sync)
        return loss.detach()

    def syncs(self, step: int, micro: int) -> bool:
        """Whether this micro-batch's backward reduces the gradients across ranks: the last
        one of a step. DDP with static_graph records the graph on its first backward and fails
        under no_sync there; syncing every micro-batch of the first step gives the same average."""
        par = self.job.parallel
        first = step == self.start_step + 1 and par.strategy == "ddp" and par.ddp.static_graph
        return micro == self.job.train.grad_accum - 1 or first

    def by_autograd_grad(self, sync: bool) -> bool:
        """Whether this micro-batch's gradients are accumulated by ``backward``'s foreach ops
        instead of autograd's accumulation (see ``backward``)."""
        return self.job.train.grad_accum > 1 and not parallel.needs_backward(self.model, sync)

    def backward(self, loss: torch.Tensor, micro: int, sync: bool) -> None:
        """The micro-batch's backward, its gradients summed into ``.grad``: by autograd where a
        DDP or FSDP hook needs it (``parallel.needs_backward``), else from
        ``torch.autograd.grad`` summed with foreach ops (a few kernels, not one per tensor)."""
        if not self.by_autograd_grad(sync):
            loss.backward()
            return
        grads = torch.autograd.grad(loss, self.trained_params, allow_unused=True)
        into, new = [], []
        for p, g in zip(self.trained_params, grads, strict=True):
            if g is None:  # a parameter this micro-batch did not use
                if micro == 0:  # no zero_grad ran before this step's first backward
                    p.grad = p.grad.zero_() if self.grads_in_place else None
            elif p.grad is None or (micro == 0 and not self.grads_in_place):
                # autograd's layout rule for .grad: the parameter's strides (no expanded views)
                p.grad = g if g.stride() == p.stride() else torch.empty_like(p).copy_(g)
            else:
                into.append(p.grad)
                new.append(g)
        if into:
            (torch._foreach_add_ if micro > 0 else torch._foreach_copy_)(into, new)

    def train_step(self, step: int) -> torch.Tensor:
        """One optimizer step (all micro-batches); returns the loss on the device (no sync)."""
        if not self.by_autograd_grad(self.syncs(step, 0)):  # else the first backward sets .grad
            self.optimizer.zero_grad(set_to_none=not self.grads_in_place)
        # Summed into a fresh tensor as each micro-batch ends, before any replay can reuse the
        # graph memory that holds a micro-batch's loss.
        loss = sum(self.forward_backward(step, micro) for micro in range(self.job.train.grad_accum))
        assert isinstance(loss, torch.Tensor)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients
        self.grad_norm = self.clip_gradients()
        bad = (
            self.nonfinite(loss, self.grad_norm) if self.job.train.on_nonfinite == "skip" else None
        )
        if self.scaler is not None:
            if bad is None or not bool(bad):  # a host sync (the scaler's own step has one)
                self.scaler.step(self.optimizer)
            self.scaler.update()
        elif bad is None:
            self.optimizer.step()
        elif getattr(self.optimizer, "_step_supports_amp_scaling", False):
            # fused AdamW: skipped on the device (parameters, moments and step count kept)
            self.optimizer.found_inf = bad.float()  # type: ignore[attr-defined]
            self.optimizer.step()
        elif not bool(bad):  # a host sync: free on the CPU; on GPUs bf16 weights and FSDP offload
            self.optimizer.step()
        self.scheduler.step()
        return loss

    def nonfinite(self, loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """Whether this step is skipped (``train.on_nonfinite: skip``), a 0-d bool every rank
        agrees on: a non-finite loss on any rank, or gradient norm (not under a loss scaler)."""
        bad = ~torch.isfinite(parallel.all_reduce_mean(loss.detach().float()))
        if self.scaler is None:
            bad |= ~torch.isfinite(norm)
        return bad

    def clip_gradients(self) -> torch.Tensor:
        """The gradients' global norm before clipping (a 0-d tensor, no sync), the gradients
        clipped to ``train.grad_clip`` where it is above 0: inside a fused AdamW's kernel where
        there is no loss scaler, else in place."""
        clip = self.job.train.grad_clip
        if isinstance(self.optimizer, MasterAdamW):  # the norm in fp32 (the gradients are bf16)
            return self.optimizer.clip_grad_norm_(clip if clip > 0 else math.inf)
        if clip <= 0:
            return parallel.grad_norm(self.trained_params)
        if self.clip_in_optimizer:
            return parallel.clip_in_fused_optimizer(self.optimizer, self.model.parameters(), clip)
        return parallel.clip_grad_norm_(self.model.parameters(), clip)

    def eval_due(self, step: int) -> bool:
        """Whether an evaluation follows optimizer step ``step``: every ``train.eval_every``
        steps and at the last."""
        every = self.job.train.eval_every
        return bool(every) and (step % every == 0 or step == self.job.train.steps)

    @torch.no_grad()
    def evaluate(self) -> torch.Tensor:
        """The mean loss over the held-out batches and the ranks (a 0-d tensor on the device):
        the model in eval mode (no dropout), forward only, under the training precision."""
        self.model.eval()
        try:
            total = torch.zeros((), device=self.device)
            for batch in self.val_batches:
                if self.job.train.cuda_graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                with self._autocast():
                    total += self.model(**batch).float()
        finally:
            self.model.train()
        return parallel.all_reduce_mean(total / len(self.val_batches))

    def train(self, *, on_step: StepCallback | None = None) -> dict[str, Any]:
        """Run steps start_step+1 .. train.steps; returns this rank's ``final`` record."""
        total = self.job.train.steps
        if self.rank == 0:
            log.info(
                "training %s: %s, world %d, %s, %s, %s weights, attention %s, steps %d..%d",
                self.job.name,
                describe(self.job.model, self.n_params),
                self.world_size,
                self.job.parallel.strategy,
                self.job.precision.dtype,
                self.weights,
                self.attention,
                self.start_step + 1,
                total,
            )
        profiler = StepProfiler(self.job.train.profile, rank=self.rank, device=self.device)
        # On GPUs, Python's collector runs on log steps only, with the warm-up's objects frozen
        # (launcher.train.collector); the freeze falls in the warm-up's last step.
        self.collector = ManualCollector(
            enabled=self.device.type == "cuda",
            freeze_at=max(self.start_step + 1, self.meter.warmup_end - 1),
        )
        self.meter.start()
        try:
            for step in range(self.start_step + 1, total + 1):
                profiler.before_step(step)
                loss = self.train_step(step)
                profiler.after_step(step)
                if step == self.start_step + 1:
                    self._first_step_done(step)
                self._after_step(step, loss, total, on_step)
        finally:
            profiler.close()
            self.collector.close()
        self.checkpointer.wait()  # the last checkpoint is complete before the run says it ended
        # Graphs compiled after the first step (evaluation, a last shorter step) join the cache.
        if self.compile_cache is not None:
            self.compile_cache.save()
        self._progress(self.meter.flush())
        final = self.meter.finish()
        if self.rank == 0:
            log.info(final_line(final, self.world_size))
        return final

    def _after_step(
        self, step: int, loss: torch.Tensor, total: int, on_step: StepCallback | None
    ) -> None:
        """Meter (and log the last log step's record, read now), checkpoint when due, then the
        caller's callback."""
        eval_loss = None
        if self.eval_due(step):
            with self.meter.set_aside():
                eval_loss = self.evaluate()
        record = self.meter.step_end(step, loss, grad_norm=self.grad_norm, eval_loss=eval_loss)
        self._progress(record)
        self.collector.after_step(step, logged=record is not None)
        if self.checkpointer.due(step, total):
            # A checkpoint holds finite steps only: this step's record is read first (the save
            # waits for the device anyway).
            self._progress(self.meter.flush())
            self.checkpointer.save(step, self.model, self.optimizer, self.scheduler, self.scaler)
        else:
            self.checkpointer.poll()
        if on_step is not None:
            on_step(step)

    def _first_step_done(self, step: int) -> None:
        """Record when the first step ended (compilation included): one host sync, once; then
        let the checkpointer allocate its host memory (``Checkpointer.prepare``)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        write_record(
            {
                "type": "first_step",
                "step": step,
                "compile": self.job.train.compile,
                "compile_cache_loaded": bool(self.compile_cache and self.compile_cache.loaded),
                "compile_s": _compile_times(),
                "compile_cache_hits": cache_hits() if self.job.train.compile else {},
            }
        )
        if self.compile_cache is not None:
            self.compile_cache.save()
        # The optimizer has state now: the host memory of background checkpoints is allocated
        # beside training instead of at the first save.
        self.checkpointer.prepare(self.model, self.optimizer, self.scheduler, self.scaler)

    def _progress(self, record: dict[str, Any] | None) -> None:
        """Log a record (rank 0) and stop on a non-finite step (every rank reads the same)."""
        if record is None:
            return
        if self.rank == 0:
            log.info(
                progress_line(record, self.job.train.steps, self.flops_per_token, self.peak_tflops)
            )
        if record.get("first_nonfinite") is None:
            return
        t = self.job.train
        self.checkpointer.wait()  # a background save holds earlier, finite steps: it counts
        reason = stop_reason(
            record,
            mode=t.on_nonfinite,
            max_skips=t.max_nonfinite_skips,
            checkpoint=latest_checkpoint(self.checkpointer.root),
        )
        if reason is not None:
            raise NonFiniteError(reason)

    def full_state_dict(self) -> dict[str, Any]:
        """Unsharded CPU copies of the parameters (the fp32 masters of bf16 weights): on every
        rank for bf16 weights (never sharded), else on rank 0 (a collective under FSDP)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.masters is not None:  # never sharded: the local state is the whole model
            state = substitute_masters(get_model_state_dict(self.model), self.masters)
            return {k: v.detach().cpu() for k, v in state.items()}
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            if hasattr(self, "checkpointer"):  # finish a background save still in flight
                self.checkpointer.close()
        finally:
            if hasattr(self, "data"):  # a trainer that failed before build_data has none
                self.data.close()
            self._contexts.close()
            if self.gpu is not None:
                self.gpu.close()
            if dist.is_initialized():
                dist.destroy_process_group()

    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)


# torch.compile's phases as dynamo's own accounting names them: all of it, tracing the bytecode,
# the backend (AOTAutograd, inductor), inductor's code generation, waiting for Triton's compiles.
COMPILE_PHASES = {
    "_compile.compile_inner": "total",
    "bytecode_tracing": "dynamo",
    "OutputGraph.call_user_compiler": "backend",
    "fx_codegen_and_compile": "inductor_codegen",
    "async_compile.wait": "triton_wait",
}


def _compile_times() -> dict[str, float]:
    """Seconds torch.compile spent so far, by phase (``COMPILE_PHASES``; empty without)."""
    try:
        from torch._dynamo.utils import compile_times

        names, values = compile_times(repr="csv", aggregate=True)
    except Exception:
        return {}
    spent = {str(n): str(v) for n, v in zip(names, values, strict=False)}
    return {short: round(float(spent[n]), 3) for n, short in COMPILE_PHASES.items() if n in spent}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            return next(x.split(":", 1)[1].strip() for x in fh if x.startswith("model name"))
    except (OSError, StopIteration):
        return "cpu"
