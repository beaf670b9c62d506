"""The driver's record path holds bounded state however many metrics records the ranks write."""

from __future__ import annotations

import dataclasses
import json
import tracemalloc

from fixtures.fake_launch import cpu_job, two_nodes

from launcher.orchestrate.plan import NodePlan, plan
from launcher.orchestrate.records import AgentUpdate
from launcher.orchestrate.rundir import RunDir
from launcher.orchestrate.runlog import RunLog
from launcher.results.rankstats import KEPT, RankStats, Sample
from launcher.results.summary import summarize

RECORDS = 20_000  # over both ranks, about 2 KiB each (its own text, as decoded): held, ~37 MiB
BOUND_MIB = 16
PAD = "x" * 1200


def node() -> NodePlan:
    """Node a of fake_launch's two nodes, with two ranks."""
    first = plan(cpu_job(), two_nodes(), None, run_id="r", master_port=1, launcher_env={}).nodes[0]
    return dataclasses.replace(first, nproc=2, ranks=[0, 1])


def step(rank: int, i: int) -> dict:
    return {
        "type": "step",
        "step": i,
        "time": 100.0 + i,
        "interval_s": 0.1 + rank * 0.01,
        "tokens": 4096,
        "samples": 8,
        "loss": 1.0 / i,
        "grad_norm": 0.5,
        "data_wait_s": 0.001,
        "step_times_ms": [100.0 + (i % 7)],
        "peak_mem_gib": 1.5,
        "pad": f"{PAD}{rank}/{i}",
    }


def test_20k_records_keep_the_driver_under_a_fixed_bound(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    (run_dir.root / "metrics").mkdir(parents=True)
    log = RunLog(run_dir, quiet=True)
    where = node()
    meta = [(r, {"type": "meta", "host": "h", "device": "cpu", "start_step": 0}) for r in (0, 1)]
    log.ingest(where, AgentUpdate(records=meta))
    batch = 500
    tracemalloc.start()
    try:
        for first in range(1, RECORDS // 2 + 1, batch):
            records = [(r, step(r, i)) for i in range(first, first + batch) for r in (0, 1)]
            log.ingest(where, AgentUpdate(records=records))
            del records
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        log.close()
    assert peak < BOUND_MIB * 2**20, f"the record path held {peak / 2**20:.1f} MiB"
    with open(run_dir.metrics_file(1), encoding="utf-8") as fh:
        assert sum(1 for _ in fh) == RECORDS // 2 + 1
    layout = [{"rank": r, "node": "n0", "host": "h", "local_rank": r} for r in (0, 1)]
    summary = summarize("j", layout, log.by_attempt[0], status="interrupted")
    assert [r["steps"] for r in summary["ranks"]] == [RECORDS // 2] * 2
    assert summary["ranks"][1]["step_time_ms_p50"] == 103.0
    assert summary["training"]["step"] == RECORDS // 2


def test_the_step_times_kept_stay_under_the_cap_and_exact_below_it():
    sample = Sample()
    for i in range(KEPT):
        sample.add(float(i))
    assert list(sample.values) == [float(i) for i in range(KEPT)]
    for i in range(KEPT, 10 * KEPT):
        sample.add(float(i))
    assert len(sample.values) <= KEPT and sample.values[:3].tolist() == [0.0, 16.0, 32.0]


def test_folded_records_summarize_as_the_records_themselves(tmp_path):
    recs = [{"type": "meta", "device": "cpu", "flops_per_token": 6e6, "peak_tflops": 100.0}]
    recs += [step(0, i) for i in range(1, 50)]
    recs += [{"type": "checkpoint", "step": 10, "blocking_s": 0.25, "async": False}]
    layout = [{"rank": 0, "node": "n0", "host": "h", "local_rank": 0}]
    listed = summarize("j", layout, {0: recs}, status="succeeded")
    folded = summarize("j", layout, {0: RankStats(recs)}, status="succeeded")
    assert listed == folded
    assert json.dumps(listed)  # what summary.json holds
