"""The built-in trainer for real: torchrun with 2 gloo workers on the CPU (and one process).

Runs are shared between tests (module-scoped fixtures) to keep the set within a few
minutes on a 2-core machine. Every process a run starts lives in its own session and is
killed (the whole group) when the run ends, also on failure or timeout.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fixtures.batching import source, write_npy
from fixtures.launching import sets

from launcher.metrics import read_records
from launcher.orchestrate.reaper import descendants, signal_all

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "tests" / "fixtures" / "train_harness.py"
RUN_TIMEOUT_S = 240

TINY_JOB = """\
name: {name}
model: {{arch: bert, size: tiny, vocab_size: 1024}}
data: {{source: synthetic, seq_len: 32}}
train:
  steps: 50
  warmup_steps: 2
  micro_batch: 4
  lr: 3.0e-3
  lr_warmup_steps: 5
  log_every: 5
  checkpoint: {{dir: {ckpt}, every_steps: 25}}
precision: {{dtype: fp32}}
cudnn: {{benchmark: false, deterministic: true}}
resources: {{nodes: all, nproc_per_node: 2, device: cpu}}
"""


@dataclass
class Run:
    dir: Path
    returncode: int
    output: str

    def records(self, rank: int = 0, kind: str | None = None) -> list[dict]:
        recs = read_records(self.dir / f"rank{rank}.jsonl")
        return [r for r in recs if kind is None or r["type"] == kind]

    def losses(self, rank: int = 0) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.records(rank, "step")}

    def params(self) -> dict[str, torch.Tensor]:
        return torch.load(self.dir / "params.pt")


def write_job(base: Path, name: str, *replace: str, template: str = TINY_JOB) -> Path:
    """``template`` as base/NAME.yaml, checkpoints in base/ckpt-NAME; ``replace``: old, new."""
    text = template.format(name=name, ckpt=base / f"ckpt-{name}")
    if replace:
        assert replace[0] in text
        text = text.replace(*replace)
    (base / f"{name}.yaml").write_text(text)
    return base / f"{name}.yaml"


def launch(
    run_dir: Path,
    args: list[str],
    *,
    nproc: int | None = 2,
    module: bool = False,
    script: Path = HARNESS,
    timeout: float = RUN_TIMEOUT_S,
) -> Run:
    """Run the trainer (``-m launcher.train``, the harness or another script) under torchrun, or alone."""
    run_dir.mkdir(parents=True, exist_ok=True)
    target = ["-m", "launcher.train"] if module else [str(script)]
    torchrun = ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    torchrun += ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0"]
    cmd = [sys.executable, *(torchrun if nproc is not None else []), *target, *args]
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        "LAUNCHER_METRICS_FILE": str(run_dir / "rank{rank}.jsonl"),
    }
    proc = subprocess.Popen(
        cmd,
        cwd=run_dir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        # torchrun's session, and its workers: they run in sessions of their own
        workers = descendants(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        signal_all(workers, signal.SIGKILL)
        proc.wait()
    (run_dir / "output.txt").write_text(out)
    return Run(run_dir, proc.returncode, out)


def ok(run: Run) -> Run:
    assert run.returncode == 0, f"exit {run.returncode}:\n{run.output[-4000:]}"
    return run


def train(
    base: Path, name: str, *overrides: str, module: bool = False, template: str = TINY_JOB, **kw
) -> Run:
    """``template`` (TINY_JOB) named ``name`` with ``overrides``, run to success in ``base/NAME``;
    through the harness the final parameters go to params.pt, else through ``-m launcher.train``."""
    args = ["--job", str(write_job(base, name, template=template)), *sets(*overrides)]
    args += [] if module else ["--params-out", "params.pt"]
    return ok(launch(base / name, args, module=module, **kw))


def assert_loss_falls(run: Run, *, by: float = 0.5) -> None:
    losses = list(run.losses().values())
    assert len(losses) >= 5, losses
    assert all(loss == loss for loss in losses), f"NaN loss: {losses}"
    assert losses[-1] < losses[0] - by, f"loss did not fall by {by}: {losses}"


def assert_params_close(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float
) -> None:
    assert sorted(a) == sorted(b)
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= atol, f"parameters differ by up to {worst:.3g} (> {atol})"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("train")


@pytest.fixture(scope="module")
def ddp_fp32(base: Path) -> Run:
    """DDP, 2 ranks × micro-batch 4, fp32, deterministic, checkpoints at 25 and 50."""
    return train(base, "ddp")


@pytest.fixture(scope="module")
def fsdp_fp32(base: Path) -> Run:
    """The ddp_fp32 job under FSDP, evaluating every 20 steps (evaluations change no parameter:
    the tests below hold it to ddp_fp32's, and to a resumed run's without evaluations)."""
    return train(
        base, "fsdp", "parallel.strategy=fsdp", "train.eval_every=20", "train.eval_steps=4"
    )


def test_ddp_fp32_loss_falls_and_writes_the_metrics_contract(ddp_fp32: Run):
    assert_loss_falls(ddp_fp32)
    assert "step 50/50 | loss" in ddp_fp32.output and "done: 50 steps" in ddp_fp32.output
    for rank in (0, 1):
        kinds = [r["type"] for r in ddp_fp32.records(rank)]
        assert kinds[0] == "meta" and kinds[-1] == "final" and kinds.count("step") == 11
        meta = ddp_fp32.records(rank, "meta")[0]
        assert meta["world_size"] == 2 and meta["rank"] == rank and meta["peak_tflops"] is None
        final = ddp_fp32.records(rank, "final")[0]
        assert final["steps"] == 50 and final["measured_steps"] == 48
        assert final["tokens_per_s"] > 0 and final["mfu"] is None
        assert final["step_time_ms_p50"] <= final["step_time_ms_p95"]
    steps = ddp_fp32.records(0, "step")
    assert [r["measured"] for r in steps[:2]] == [False, True]  # warm-up ends at step 2
    assert all(
        r["tokens"] == (r["step"] - prev["step"]) * 4 * 32 for prev, r in itertools.pairwise(steps)
    )


def test_ddp_two_ranks_match_one_process_with_the_same_global_batch(base: Path, ddp_fp32: Run):
    one = train(base, "one", "train.micro_batch=4", "train.grad_accum=2", nproc=None)
    assert_params_close(ddp_fp32.params(), one.params(), atol=1e-4)


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("ddp-accum-dynamic", ["parallel.ddp.static_graph=false"]),
        ("ddp-accum-static", ["parallel.ddp.static_graph=true"]),
        (
            "fsdp-units",
            [
                "parallel.strategy=fsdp",
                "parallel.fsdp.blocks_per_unit=2",
                "parallel.fsdp.reshard_after_forward=false",
            ],
        ),
    ],
)
def test_accumulating_micro_batches_matches_one_batch_per_rank(
    base: Path, ddp_fp32: Run, name: str, overrides: list[str]
):
    """2 ranks with 2 micro-batches of 2 per step: the same training as DDP with micro-batches
    of 4. Under DDP the first micro-batch's gradients come from ``torch.autograd.grad`` under
    ``no_sync`` and the second from ``backward`` with DDP's hooks (``Trainer.backward``); with a
    static graph the first step syncs both. fsdp-units: two blocks in one FSDP unit (one
    all-gather, one reduce-scatter), the gathered parameters kept from the first backward to the
    second forward (one all-gather per step)."""
    run = train(base, name, *overrides, "train.micro_batch=2", "train.grad_accum=2")
    assert run.records(0, "meta")[0]["grad_accum"] == 2
    assert_params_close(ddp_fp32.params(), run.params(), atol=1e-4)


def test_fsdp_fp32_loss_falls_and_matches_ddp(fsdp_fp32: Run, ddp_fp32: Run):
    assert_loss_falls(fsdp_fp32)
    assert_params_close(ddp_fp32.params(), fsdp_fp32.params(), atol=1e-4)


def test_health_fields_and_evaluations_under_ddp_and_fsdp(fsdp_fp32: Run, ddp_fp32: Run):
    """grad_norm in every record (the same on both ranks: the norm of the whole gradient),
    eval_loss at 20, 40 and the last step (the same on both ranks: a mean over them), falling."""
    for run in (ddp_fp32, fsdp_fp32):
        steps = [run.records(rank, "step") for rank in (0, 1)]
        assert all(r["grad_norm"] > 0 and r["nonfinite_steps"] == 0 for r in steps[0] + steps[1])
        norms = [[r["grad_norm"] for r in ranks_steps] for ranks_steps in steps]
        assert norms[0] == pytest.approx(norms[1], rel=1e-6)
    evals = [
        {r["step"]: r["eval_loss"] for r in fsdp_fp32.records(rank, "step") if r["eval_loss"]}
        for rank in (0, 1)
    ]
    assert list(evals[0]) == [20, 40, 50] and evals[0] == evals[1]
    assert evals[0][50] < evals[0][20]
    final = fsdp_fp32.records(0, "final")[0]
    assert final["eval_loss"] == evals[0][50] and final["eval_step"] == 50
    assert not any(r["eval_loss"] for r in ddp_fp32.records(0, "step"))


@pytest.mark.parametrize(
    ("strategy", "extra"),
    [("ddp", "parallel.ddp.comm_hook=fp16"), ("fsdp", "train.activation_checkpointing=true")],
)
def test_bf16_loss_falls(base: Path, strategy: str, extra: str):
    """bf16 autocast through the real entry point, accumulating 2 micro-batches (DDP's no_sync,
    FSDP's deferred reduce-scatter); DDP also compresses gradients, FSDP also recomputes."""
    run = train(
        base,
        f"bf16-{strategy}",
        "train.checkpoint.dir=null",
        "train.checkpoint.every_steps=0",
        "precision.dtype=bf16",
        f"parallel.strategy={strategy}",
        "train.micro_batch=2",
        "train.grad_accum=2",
        "train.eval_every=25",
        extra,
        module=True,
    )
    assert_loss_falls(run)
    evals = [r["eval_loss"] for r in run.records(1, "step") if r["eval_loss"] is not None]
    assert len(evals) == 2 and evals[1] < evals[0]


def resume(base: Path, strategy: str, reference: Run, *replace: str) -> Run:
    """``reference``'s job (TINY_JOB with ``replace``) again, rank 0 SIGKILLed right after step 30,
    then resumed from its step-25 checkpoint: its losses up to 30 (deterministic runs), the
    resumed run's after 30 and its step-50 parameters are ``reference``'s, bit for bit."""
    job = write_job(base, f"resume-{strategy}", *replace)
    killed = launch(base / f"killed-{strategy}", ["--job", str(job), "--kill-at-step", "30"])
    assert killed.returncode != 0, killed.output[-2000:]
    first, second = reference.losses(), killed.losses()
    assert max(second) == 30 and {2, 5, 10, 15, 20, 25, 30} <= set(second)
    assert all(first[s] == loss for s, loss in second.items()), (first, second)
    ckpt = base / f"ckpt-resume-{strategy}"
    assert (ckpt / "step_00000025" / "COMPLETE").is_file()
    assert not (ckpt / "step_00000050").exists()
    args = ["--job", str(job), "--params-out", "params.pt"]
    resumed = ok(launch(base / f"resumed-{strategy}", args))
    assert "resumed from" in resumed.output and "steps 26..50" in resumed.output
    assert resumed.records(0, "meta")[0]["start_step"] == 25
    assert (ckpt / "step_00000050" / "COMPLETE").is_file()
    assert_params_close(reference.params(), resumed.params(), atol=0.0)
    after = {s: loss for s, loss in resumed.losses().items() if s > 30}  # logged steps line up
    assert set(after) == {35, 40, 45, 50} and all(first[s] == loss for s, loss in after.items())
    return resumed


def test_ddp_resume_after_a_kill_matches_the_uninterrupted_run(base: Path, ddp_fp32: Run):
    resume(base, "ddp", ddp_fp32)


def test_fsdp_resume_after_a_kill_matches_the_uninterrupted_run(base: Path, fsdp_fp32: Run):
    """The same under FSDP: sharded parameters and optimizer state round-trip through DCP."""
    resume(base, "fsdp", fsdp_fp32, "resources:", "parallel: {strategy: fsdp}\nresources:")


# -- bf16 weights with fp32 masters (precision.weights: bf16) on the CPU ----------------------


@pytest.fixture(scope="module")
def ddp_bf16_weights(base: Path) -> Run:
    """DDP, 2 ranks, bf16 weights (MasterAdamW's torch reference on the CPU, gradients averaged
    in fp32 by the comm hook), deterministic, checkpoints at 25 and 50."""
    return train(base, "bf16-weights", "precision.dtype=bf16", "precision.weights=bf16")


def test_ddp_bf16_weights_loss_falls_and_the_parameters_out_are_the_fp32_masters(
    ddp_bf16_weights: Run,
):
    assert_loss_falls(ddp_bf16_weights)
    assert "bf16 weights" in ddp_bf16_weights.output
    for rank in (0, 1):
        meta = ddp_bf16_weights.records(rank, "meta")[0]
        assert meta["weights"] == "bf16" and meta["precision"] == "bf16"
    params = ddp_bf16_weights.params()
    assert params and all(t.dtype == torch.float32 for t in params.values()), {
        k: t.dtype for k, t in params.items()
    }
    # the masters hold what bf16 cannot: not the bf16 weights widened
    assert any(not torch.equal(t, t.bfloat16().float()) for t in params.values())


def test_ddp_bf16_weights_track_fp32_weights(base: Path, ddp_bf16_weights: Run):
    """The same bf16 training with fp32 weights (autocast casting them): the loss ends within 3%."""
    fp32 = train(base, "fp32-weights", "precision.dtype=bf16", "precision.weights=fp32")
    assert fp32.records(0, "meta")[0]["weights"] == "fp32"
    assert sorted(fp32.params()) == sorted(ddp_bf16_weights.params())
    ours, theirs = ddp_bf16_weights.losses()[50], fp32.losses()[50]
    assert abs(ours - theirs) <= 0.03 * theirs, (ddp_bf16_weights.losses(), fp32.losses())


def test_ddp_bf16_weights_resume_after_a_kill_matches_the_uninterrupted_run(
    base: Path, ddp_bf16_weights: Run
):
    """The step-25 checkpoint holds the fp32 masters and the moments; resumed from it, step 50
    equals the run never killed, bit for bit (the bf16 weights are rounded from the masters)."""
    precision = ("precision: {dtype: fp32}", "precision: {dtype: bf16, weights: bf16}")
    resumed = resume(base, "bf16-weights", ddp_bf16_weights, *precision)
    assert resumed.records(0, "meta")[0]["weights"] == "bf16"
    names = {f"model.{k}" for k in ddp_bf16_weights.params()}
    for step in (25, 50):
        path = base / "ckpt-resume-bf16-weights" / f"step_{step:08d}"
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        assert names <= set(saved), (sorted(names - set(saved)), sorted(saved))
        dtypes = {k: saved[k].properties.dtype for k in names}
        assert all(d == torch.float32 for d in dtypes.values()), dtypes


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_gpt_on_a_token_file_sharded_by_rank(base: Path, strategy: str):
    """GPT reading a .npy token file (structured ids from the synthetic generator), its last
    10% held out for evaluations, under DDP and FSDP."""
    ids = source("gpt", seq=256, micro=64, seed=7).batch(1)["input_ids"]
    write_npy(base / "tokens.npy", ids.reshape(-1).to(torch.int32), "<i4")
    job = base / f"gpt-{strategy}.yaml"
    job.write_text(
        "name: gpt-tokens\n"
        "model: {arch: gpt, size: tiny, vocab_size: 1024}\n"
        f"data: {{source: tokens, path: {base / 'tokens.npy'}, seq_len: 32, val_fraction: 0.1}}\n"
        "train: {steps: 30, warmup_steps: 2, micro_batch: 4, lr: 3.0e-3, log_every: 5,\n"
        "        eval_every: 10, eval_steps: 2}\n"
        f"parallel: {{strategy: {strategy}}}\n"
        "precision: {dtype: fp32}\ncudnn: {benchmark: false}\n"
        "resources: {nodes: all, nproc_per_node: 2, device: cpu}\n"
    )
    run = ok(launch(base / f"gpt-{strategy}", ["--job", str(job)], module=True))
    assert_loss_falls(run, by=1.0)
    assert run.records(1, "meta")[0]["arch"] == "gpt"
    evals = [r["eval_loss"] for r in run.records(0, "step") if r["eval_loss"] is not None]
    assert len(evals) == 3 and evals[-1] < evals[0] - 1.0


def test_quickstart_runs_as_one_process_without_torchrun(base: Path):
    args = ["--job", str(REPO / "jobs" / "quickstart.yaml")]
    args += sets("train.steps=4", "train.warmup_steps=1", "train.log_every=2")
    run = ok(launch(base / "quick", args, nproc=None, module=True))
    assert "world 1" in run.output and "step 4/4" in run.output and "done: 4 steps" in run.output
    records = run.records()
    assert [r["type"] for r in records] == ["meta", "first_step", "step", "step", "step", "final"]
    meta, first = records[0], records[1]
    assert set(meta["startup_s"]) >= {"process", "init_distributed", "build_model", "resume"}
    assert first["step"] == 1 and first["time"] >= meta["time"]


def test_the_host_bound_benchmark_reports_issue_and_synced_time_per_rank(base: Path):
    args = [str(REPO / "jobs/quickstart.yaml"), "--warmup", "1", "--probe", "2", "--steps", "2"]
    script = REPO / "benchmarks/host_bound.py"
    run = ok(launch(base / "host-bound", args + sets("model.n_layers=1"), script=script))
    [line] = [x for x in run.output.splitlines() if x.startswith('{"job"')]
    result = json.loads(line)
    assert result["world_size"] == 2 and [r["rank"] for r in result["ranks"]] == [0, 1]
    for r in result["ranks"]:
        assert 0 < r["issue_ms"] <= r["synced_ms"] and r["tokens_per_s"] > 0 and r["step_ms"] > 0
    assert result["tokens_per_s_per_rank"] == min(r["tokens_per_s"] for r in result["ranks"])


# -- GPUs (opt in: skipped with a reason where CUDA is absent) -------------------------------

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpus = {
    n: pytest.mark.skipif(n > GPUS, reason=f"needs {n} CUDA GPU(s); this machine has {GPUS}")
    for n in (1, 2)
}

GPU_JOB = """\
name: {name}
model: {{arch: bert, size: mini, vocab_size: 4096}}
data: {{source: synthetic, seq_len: 128}}
train: {{steps: 50, warmup_steps: 5, micro_batch: 8, lr: 2.0e-3, lr_warmup_steps: 5, log_every: 10}}
precision: {{dtype: fp32}}
cudnn: {{benchmark: false}}
resources: {{nodes: all, nproc_per_node: 1, device: cuda}}
"""


@pytest.mark.gpu
@needs_gpus[2]
def test_gpu_nccl_ddp_on_two_gpus_matches_one_gpu(base: Path):
    two = train(base, "gpu-two", template=GPU_JOB)
    assert two.records(1, "meta")[0]["device"] == "cuda:1"
    one = train(base, "gpu-one", "train.micro_batch=16", template=GPU_JOB, nproc=1)
    assert_params_close(two.params(), one.params(), atol=2e-4)


@pytest.fixture(scope="module")
def compiled_one_gpu(base: Path) -> Run:
    """The GPU job compiled, one GPU, one micro-batch of 16 per step, kernels launched one by one:
    the reference the CUDA-graph runs must reproduce."""
    overrides = ("train.compile=true", "train.micro_batch=16")
    return train(base, "gpu-compiled-one", *overrides, template=GPU_JOB, nproc=1)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("nproc", "accum"),
    [
        pytest.param(2, 1, marks=needs_gpus[2]),
        pytest.param(1, 2, marks=needs_gpus[1]),
        pytest.param(2, 2, marks=needs_gpus[2]),
    ],
)
def test_gpu_cuda_graphs_match_compiled_one_gpu(
    base: Path, nproc: int, accum: int, compiled_one_gpu: Run
):
    """Replayed graphs (with DDP's hooks between them on 2 GPUs; replayed twice per step with
    grad_accum 2) train the same model as one compiled GPU taking the 16 samples at once,
    kernels launched one by one: no micro-batch's gradients are lost to the next replay."""
    graphs = train(
        base,
        f"gpu-graphs-{nproc}-{accum}",
        "train.compile=true",
        "train.cuda_graphs=true",
        f"train.grad_accum={accum}",
        f"train.micro_batch={16 // (accum * nproc)}",
        template=GPU_JOB,
        nproc=nproc,
    )
    assert graphs.records(0, "meta")[0]["grad_accum"] == accum
    assert_loss_falls(graphs, by=1.0)
    assert_params_close(graphs.params(), compiled_one_gpu.params(), atol=5e-4)


@pytest.mark.gpu
@needs_gpus[1]
@pytest.mark.parametrize(
    ("dtype", "strategy", "compile_"),
    [
        ("bf16", "ddp", False),
        ("fp16", "ddp", False),
        ("bf16", "fsdp", True),
        ("fp16", "fsdp", False),
        ("tf32", "ddp", True),
        ("bf16", "ddp", "graphs"),
        ("fp16", "ddp", "graphs"),
    ],
)
def test_gpu_precisions_run_and_the_loss_falls(
    base: Path, dtype: str, strategy: str, compile_: bool | str
):
    """compile_ "graphs": compiled and replayed as CUDA graphs."""
    run = train(
        base,
        f"gpu-{dtype}-{strategy}-{compile_}",
        f"precision.dtype={dtype}",
        f"parallel.strategy={strategy}",
        f"train.compile={str(bool(compile_)).lower()}",
        f"train.cuda_graphs={str(compile_ == 'graphs').lower()}",
        template=GPU_JOB,
        nproc=min(GPUS, 2),
        module=True,
    )
    assert_loss_falls(run, by=1.0)
    final = run.records(0, "final")[0]
    assert final["peak_mem_gib"] > 0 and final["tokens_per_s"] > 0
    if importlib.util.find_spec("pynvml") is not None:  # the GPU's clock and power, via NVML
        steps = run.records(0, "step")
        assert all(
            r["sm_clock_mhz"] > 0
            and r["power_w"] > 0
            and isinstance(r["clock_limits"], list)
            and r["energy_j"] >= 0
            for r in steps
        ), steps
        assert final["sm_clock_mhz"] > 0 and 0 <= final["clock_limited_pct"] <= 100
        # the energy counter (Volta and newer): the measured steps' energy, per token and as power
        assert final["energy_j"] > 0 and final["energy_mj_per_token"] > 0
        assert 0 < final["power_w"] < 2000


def fp8_missing() -> str:
    """Why FP8 training cannot run here ("" where it can)."""
    if not GPUS:
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability(0) < (8, 9):
        return f"{torch.cuda.get_device_name(0)} has no FP8 tensor cores (compute capability below 8.9)"
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "needs torchao (pip install -e '.[fp8]')"
    return ""


FP8_MISSING = fp8_missing()


@pytest.mark.gpu
@pytest.mark.skipif(bool(FP8_MISSING), reason=FP8_MISSING or "fp8 available")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_gpu_fp8_loss_falls_and_tracks_bf16(base: Path, recipe: str):
    """torchao's float8 layers (every block linear: the mini model is below torchao's size
    filter) train like bf16: the loss falls, and after 50 steps it is within 2% of bf16's.
    Eager, to keep the test short (the compiled path is what the benchmarks run)."""

    def run(dtype: str, *more: str) -> Run:
        name, more = f"gpu-fp8-{recipe}-{dtype}", (f"precision.dtype={dtype}", *more)
        return train(base, name, *more, template=GPU_JOB, nproc=1, module=True)

    fp8 = run("fp8", f"precision.fp8_recipe={recipe}", "precision.fp8_layers=all")
    bf16 = run("bf16")
    assert fp8.records(0, "meta")[0]["precision"] == "fp8"
    assert "fp8: 16 linear layers in float8" in fp8.output  # 4 blocks x (qkv, proj, fc, proj)
    assert_loss_falls(fp8, by=1.0)
    last_fp8, last_bf16 = list(fp8.losses().values())[-1], list(bf16.losses().values())[-1]
    assert abs(last_fp8 - last_bf16) <= 0.02 * last_bf16, (last_fp8, last_bf16)


@pytest.mark.gpu
@needs_gpus[1]
@pytest.mark.skipif(
    GPUS > 0 and torch.cuda.get_device_capability(0) >= (8, 9),
    reason="this GPU has FP8 tensor cores; the error is for GPUs without them",
)
def test_gpu_fp8_without_fp8_tensor_cores_fails_with_a_clear_error(base: Path):
    job = write_job(base, "gpu-fp8-unsupported", template=GPU_JOB)
    args = ["--job", str(job), *sets("precision.dtype=fp8")]
    run = launch(base / "gpu-fp8-unsupported", args, nproc=1, module=True)
    assert run.returncode == 2
    assert "fp8 needs FP8 tensor cores (compute capability 8.9 or above" in run.output


@pytest.mark.gpu
@needs_gpus[1]
def test_gpu_bf16_weights_under_cuda_graphs_track_fp32_weights(base: Path):
    """bf16 weights (fp32 masters, the Triton update reading gradients a replayed graph wrote)
    train the compiled GPU job as fp32 weights do: the loss falls and ends within 2%."""
    runs = {}
    for weights in ("bf16", "fp32"):
        runs[weights] = train(
            base,
            f"gpu-weights-{weights}",
            "precision.dtype=bf16",
            f"precision.weights={weights}",
            "train.compile=true",
            "train.cuda_graphs=true",
            "train.micro_batch=16",
            template=GPU_JOB,
            nproc=1,
        )
        assert runs[weights].records(0, "meta")[0]["weights"] == weights
    assert_loss_falls(runs["bf16"], by=1.0)
    ours, theirs = runs["bf16"].losses()[50], runs["fp32"].losses()[50]
    assert abs(ours - theirs) <= 0.02 * theirs, (runs["bf16"].losses(), runs["fp32"].losses())
    assert all(t.dtype == torch.float32 for t in runs["bf16"].params().values())  # the masters
