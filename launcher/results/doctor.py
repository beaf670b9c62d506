"""``launch doctor RUN_DIR``: what made a run slow, most costly first, each with its evidence and
the setting to change, from what the run recorded alone (docs/diagnosis.md lists the checks)."""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from launcher.errors import UsageError
from launcher.metrics import FILE_PATTERN, rank_of, read_records
from launcher.results.stragglers import node_differences, preflight_facts
from launcher.results.summary import load_run, median_p50, read_json

# The built-in trainer's MFU on these GPUs (GPT-2 124M, BERT-base; benchmarks/RESULTS.md).
REFERENCE_MFU = {"H200": 0.47, "H100": 0.47}
# NCCL settings that turn a fast path off, and what it is.
NCCL_SLOW = {
    "NCCL_P2P_DISABLE": ("1", "direct GPU-to-GPU copies (NVLink, PCIe P2P)"),
    "NCCL_SHM_DISABLE": ("1", "shared-memory transport within a node"),
    "NCCL_IB_DISABLE": ("1", "InfiniBand/RoCE between nodes (falls back to TCP sockets)"),
    "NCCL_NVLS_ENABLE": ("0", "NVLink SHARP (in-switch reductions)"),
    "NCCL_CUMEM_ENABLE": ("0", "cuMem buffers (needed by NVLS and some P2P paths)"),
    "NCCL_PROTO": ("Simple", "the LL/LL128 protocols for small and medium messages"),
    "NCCL_DEBUG": (
        "INFO",
        "nothing: INFO logging costs time at start and on every new communicator",
    ),
}
RECOMPILE = re.compile(r"Recompiling function|recompile_limit|cache_size_limit reached")
FALLBACK = re.compile(
    r"cuDNN.*(not available|disabled|not enabled)|Memory efficient kernel not used|"
    r"Flash attention kernel not used|falling back to (the )?math|CUDNN_STATUS_NOT_SUPPORTED",
    re.IGNORECASE,
)


@dataclass
class Finding:
    kind: str
    title: str
    cost_pct: float  # estimated share of the run's time it cost
    evidence: str
    change: str


def diagnose(run_dir: Path) -> list[Finding]:
    """The run's findings, most costly first; empty for a clean run."""
    run = _Run(run_dir)
    found = [
        f
        for check in (
            _data_wait,
            _exposed_comm,
            _gpu_idle,
            _clock_capped,
            _straggler,
            _recompiles,
            _fallbacks,
            _nccl_env,
            _memory_headroom,
        )
        if (f := check(run)) is not None
    ]
    if (gap := _mfu_gap(run, sum(f.cost_pct for f in found))) is not None:
        found.append(gap)
    return sorted(found, key=lambda f: -f.cost_pct)


def render(run_dir: Path, findings: list[Finding]) -> str:
    if not findings:
        return (
            f"{run_dir}: no problems found (data wait, communication, GPU use, clocks, "
            f"stragglers, recompilations, fallbacks, NCCL settings, memory and MFU checked "
            f"against what the run recorded).\n"
        )
    lines = [f"{run_dir}: {len(findings)} finding(s), most costly first"]
    for i, f in enumerate(findings, 1):
        lines += [
            f"{i}. {f.title} (~{f.cost_pct:.0f}% of the run's time)",
            f"   evidence: {f.evidence}",
            f"   change:   {f.change}",
        ]
    return "\n".join(lines) + "\n"


def doctor_command(path: str, *, as_json: bool = False) -> int:
    """``launch doctor RUN_DIR [--json]``: exit 0 with findings or without."""
    run_dir = Path(path)
    if not (run_dir / "plan.json").is_file() and not (run_dir / "summary.json").is_file():
        raise UsageError(
            f"{path} is not a run directory (it has neither plan.json nor summary.json); "
            f"give a directory made by 'launch' (runs/<job>-<time>/) or a job id"
        )
    findings = diagnose(run_dir)
    if as_json:
        out = {"run_dir": str(run_dir), "clean": not findings}
        out["findings"] = [asdict(f) for f in findings]
        print(json.dumps(out, indent=2))
    else:
        print(render(run_dir, findings), end="")
    return 0


# -- what the run recorded ------------------------------------------------------------------


class _Run:
    def __init__(self, root: Path):
        self.root = root
        self.summary = load_run(root)
        self.records: dict[int, list[dict[str, Any]]] = {}
        for path in sorted((root / "metrics").glob(FILE_PATTERN)):
            if (rank := rank_of(path.name)) is not None:
                self.records[rank] = read_records(path)
        self.telemetry = [
            s for p in sorted((root / "telemetry").glob("*.jsonl")) for s in read_records(p)
        ]
        self.facts = preflight_facts(root / "preflight")
        self.plan = read_json(root / "plan.json") or {}
        try:
            self.job = yaml.safe_load((root / "job.yaml").read_text()) or {}
        except (OSError, yaml.YAMLError):
            self.job = {}

    def steps(self, rank: int | None = None) -> list[dict[str, Any]]:
        """Measured step records (past warm-up), of one rank or all."""
        ranks = [rank] if rank is not None else list(self.records)
        return [
            r
            for k in ranks
            for r in self.records.get(k, [])
            if r.get("type") == "step" and r.get("measured", True)
        ]

    def busy_telemetry(self) -> list[dict[str, Any]]:
        """Telemetry samples taken while measured steps ran: start-up and compilation would
        otherwise read as an idle GPU. Samples without a time are kept."""
        spans = [
            (float(r["time"]) - float(r.get("interval_s") or 0.0), float(r["time"]))
            for r in self.steps()
            if r.get("time") is not None
        ]
        if not spans:
            return self.telemetry
        start, end = min(a for a, _ in spans), max(b for _, b in spans)
        return [
            s for s in self.telemetry if s.get("time") is None or start <= float(s["time"]) <= end
        ]

    def log_lines(self, pattern: re.Pattern[str]) -> list[str]:
        out = []
        for path in sorted((self.root / "logs").rglob("*.log")):
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            out += [
                f"{path.parent.name}/{path.name}: {line.strip()}"
                for line in text.splitlines()
                if pattern.search(line)
            ]
        return out

    def job_get(self, dotted: str, default: Any = None) -> Any:
        value: Any = self.job
        for part in dotted.split("."):
            if not isinstance(value, dict) or part not in value:
                return default
            value = value[part]
        return value


def _seconds(records: list[dict[str, Any]], key: str) -> float:
    return sum(float(r.get(key) or 0.0) for r in records)


# -- the checks, each None where the run shows no such problem --------------------------------


def _data_wait(run: _Run) -> Finding | None:
    per_rank = {}
    for rank in run.records:
        steps = run.steps(rank)
        total = _seconds(steps, "interval_s")
        if total > 0 and any("data_wait_s" in r for r in steps):
            per_rank[rank] = 100 * _seconds(steps, "data_wait_s") / total
    if not per_rank or (pct := statistics.fmean(per_rank.values())) < 3:
        return None
    worst = max(per_rank, key=per_rank.__getitem__)
    if run.job_get("entrypoint", "builtin") == "builtin":
        source = run.job_get("data.source", "synthetic")
        change = (
            f"data loading feeds the steps too slowly (data.source {source}): put data.path on a "
            f"local disk, use a pre-tokenized data.source tokens file, or raise train.micro_batch "
            f"so that each batch's preparation is amortized"
        )
    else:
        change = "feed the loop faster: DataLoader num_workers, pin_memory=True, prefetch_factor, data on local disk"
    return Finding(
        "data_wait",
        "Data loading: steps wait for their next batch",
        pct,
        f"{pct:.1f}% of the measured step time waits for data, mean over {len(per_rank)} rank(s) "
        f"(rank {worst}: {per_rank[worst]:.1f}%; metrics data_wait_s / interval_s)",
        change,
    )


def _exposed_comm(run: _Run) -> Finding | None:
    shares = []
    for rank in run.records:
        steps = [r for r in run.steps(rank) if r.get("compute_s") is not None]
        wall = _seconds(steps, "interval_s")
        if not wall and len(steps) > 1:
            wall = float(steps[-1]["time"]) - float(steps[0]["time"])
            steps = steps[1:]
        if wall > 0:
            busy = _seconds(steps, "compute_s") + _seconds(steps, "data_wait_s")
            shares.append(max(0.0, 100 * (1 - busy / wall)))
    if len(run.records) < 2 or not shares or (pct := statistics.median(shares)) < 10:
        return None
    return Finding(
        "exposed_communication",
        "Communication not hidden behind compute",
        pct,
        f"the median rank spends {pct:.0f}% of its step time neither computing nor loading "
        f"(compute_s and data_wait_s against wall time): waiting in collectives",
        "overlap or shrink communication: parallel.ddp.bucket_cap_mb (25-100), train.grad_accum "
        "above 1 (one reduction per accumulated step), and no NCCL setting that disables a fast path",
    )


def _gpu_idle(run: _Run) -> Finding | None:
    values = [s["util_pct"] for s in run.busy_telemetry() if s.get("util_pct") is not None]
    values = values or [r["gpu_util_pct"] for r in run.steps() if r.get("gpu_util_pct") is not None]
    if not values or (util := statistics.fmean(values)) >= 85:
        return None
    wait = _data_wait(run)
    cost = max(0.0, 90 - util - (wait.cost_pct if wait else 0.0))
    if cost < 3:
        return None
    host_bound = util >= 50
    change = (
        "cut the host's work per step: train.compile: true, train.cuda_graphs: true, a larger "
        "train.micro_batch; keep other processes off the node's CPUs"
        if host_bound
        else "the GPU idles most of the time: check the data wait, the step's host work and "
        "that the work is on the GPU at all (resources.device: cuda)"
    )
    return Finding(
        "gpu_idle",
        "Host-bound steps: the GPU waits for kernel launches"
        if host_bound
        else "Low GPU utilisation",
        cost,
        f"GPU utilisation {util:.0f}% on average while steps ran (NVML)"
        + (f", beyond the {wait.cost_pct:.0f}% data wait" if wait else ""),
        change,
    )


def _clock_capped(run: _Run) -> Finding | None:
    samples = [s for s in run.busy_telemetry() if s.get("clock_limits") is not None]
    if not samples:
        return None
    capped = [s for s in samples if s["clock_limits"]]
    share = len(capped) / len(samples)
    if share < 0.1:
        return None
    reasons = sorted({r for s in capped for r in s["clock_limits"]})
    ratios = [
        s["sm_clock_mhz"] / s["max_sm_clock_mhz"]
        for s in capped
        if s.get("sm_clock_mhz") and s.get("max_sm_clock_mhz")
    ]
    ratio = statistics.fmean(ratios) if ratios else 0.9
    power = [
        (s["power_w"], s["power_cap_w"])
        for s in capped
        if s.get("power_w") and s.get("power_cap_w")
    ]
    watts = (
        f"; power {statistics.fmean(p for p, _ in power):.0f} W of a {power[0][1]:.0f} W cap"
        if power
        else ""
    )
    return Finding(
        "clock_capped",
        "GPU clocks held down (" + ", ".join(reasons) + ")",
        100 * share * (1 - ratio),
        f"{100 * share:.0f}% of telemetry samples limited, at {100 * ratio:.0f}% of the maximum SM clock{watts}",
        "not a launcher setting: check the power cap (nvidia-smi -q -d POWER; -pl raises it where "
        "allowed), cooling and the node's thermal state; "
        + (
            "thermal limits point at cooling"
            if any("thermal" in r for r in reasons)
            else "a power cap is normal under full load on some GPUs"
        ),
    )


def _straggler(run: _Run) -> Finding | None:
    live = run.summary.get("stragglers") or []
    if live:
        worst = max(live, key=lambda s: s["slower_pct"])
        slower = worst["slower_pct"]
        rank, node = worst["rank"], worst["node"]
        detail = f"{slower:.0f}% slower than the other ranks' median ({worst['from']})"
    else:
        rows = run.summary.get("ranks", [])
        named = set((run.summary.get("totals") or {}).get("straggler_ranks") or [])
        if (median := median_p50(rows)) is None or not named:
            return None
        row = max((r for r in rows if r["rank"] in named), key=lambda r: r["step_time_ms_p50"])
        slower = 100 * (row["step_time_ms_p50"] / median - 1)
        if slower < 10:
            return None
        rank, node = row["rank"], row["node"]
        detail = f"p50 step {row['step_time_ms_p50']:.1f} ms against a median {median:.1f} ms"
    diffs = node_differences(run.facts, node)
    return Finding(
        "straggler",
        f"Straggler: rank {rank} on node {node}",
        100 * slower / (100 + slower),
        detail
        + (f"; node {node} differs in its preflight facts: {', '.join(diffs)}" if diffs else ""),
        f"every rank waits for rank {rank} at each collective: look at node {node} "
        f"(`launch check`, its telemetry/{node}.jsonl clocks and power), or leave it out of "
        f"cluster.yaml",
    )


def _recompiles(run: _Run) -> Finding | None:
    lines = run.log_lines(RECOMPILE)
    if not lines:
        return None
    return Finding(
        "recompilations",
        "torch.compile recompiles",
        min(20.0, 2.0 * len(lines)),
        f"{len(lines)} recompilation line(s) in the logs, first: {lines[0][:200]}",
        "keep shapes fixed (data.seq_len, train.micro_batch; drop the last partial batch), or "
        "mark the changing dimension dynamic (torch._dynamo.mark_dynamic)",
    )


def _fallbacks(run: _Run) -> Finding | None:
    lines = run.log_lines(FALLBACK)
    off = [n for n, f in run.facts.items() if (f.get("torch") or {}).get("cudnn_enabled") is False]
    if not lines and not off:
        return None
    evidence = f"{len(lines)} fallback line(s) in the logs" + (
        f", first: {lines[0][:200]}" if lines else ""
    )
    if off:
        evidence += f"; cuDNN disabled on {', '.join(off)} (preflight)"
    return Finding(
        "fallback",
        "A slower kernel path: cuDNN or fused attention fell back",
        10.0,
        evidence,
        "make the fast path available: matching cuDNN on every node (`launch check`), bf16/fp16 "
        "precision.dtype and a head dimension the fused attention kernels support (train.attention)",
    )


def _nccl_env(run: _Run) -> Finding | None:
    if int(run.plan.get("world_size") or 1) < 2 or run.plan.get("backend") != "nccl":
        return None
    slow = []
    for node in run.plan.get("nodes", []):
        for key, value in (node.get("env") or {}).items():
            bad = NCCL_SLOW.get(key)
            if bad and str(value).upper().startswith(bad[0].upper()):
                slow.append(f"{key}={value} on {node['name']} (turns off {bad[1]})")
    if not slow:
        return None
    return Finding(
        "nccl_settings",
        "NCCL settings that disable fast paths",
        5.0 * len(slow),
        "; ".join(sorted(set(slow))[:6]),
        "remove them from nccl.env, launch.env, cluster.yaml nodes' env or the launcher's own "
        "environment (launch plan names each variable's source)",
    )


def _memory_headroom(run: _Run) -> Finding | None:
    if run.plan.get("device") != "cuda":
        return None
    totals = [s["mem_total_gib"] for s in run.telemetry if s.get("mem_total_gib")]
    peaks = [r.get("peak_mem_gib") for r in run.summary.get("ranks", []) if r.get("peak_mem_gib")]
    micro = run.job_get("train.micro_batch")
    if not totals or not peaks or not isinstance(micro, int):
        return None
    total, peak = min(totals), max(peaks)
    fits = int(0.8 * total / peak)
    if fits < 2:
        return None
    return Finding(
        "memory_headroom",
        "Memory left unused: a larger micro-batch fits",
        3.0,
        f"peak {peak:.1f} GiB of {total:.0f} GiB per GPU at train.micro_batch {micro}",
        f"train.micro_batch: {micro * fits} (or {micro * 2} to start; lower train.grad_accum to keep "
        f"the global batch); fewer, larger steps use the GPU better",
    )


def _mfu_gap(run: _Run, explained: float) -> Finding | None:
    mfu = (run.summary.get("totals") or {}).get("mfu")
    names = {
        str(r.get("device_name") or "")
        for recs in run.records.values()
        for r in recs
        if r.get("type") == "meta"
    }
    ref = next((v for k, v in REFERENCE_MFU.items() for n in names if k in n), None)
    if not mfu or ref is None or mfu >= 0.6 * ref:
        return None
    gap = 100 * (1 - mfu / ref)
    return Finding(
        "mfu",
        "MFU far from what this GPU reaches",
        max(0.0, gap - explained),
        f"MFU {100 * mfu:.1f}% against {100 * ref:.0f}% the built-in trainer reaches on "
        f"{'/'.join(sorted(names))} (benchmarks/RESULTS.md); the findings above explain "
        f"{min(explained, gap):.0f} of the {gap:.0f} points",
        "precision.dtype bf16, train.compile: true, a larger train.micro_batch, and the findings above",
    )
