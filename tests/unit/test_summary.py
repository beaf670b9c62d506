"""Summary tables from recorded metrics: both record flavours, failures, files, `launch report`."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from launcher.errors import UsageError
from launcher.metrics import read_records, write_record
from launcher.results.summary import (
    TRAINING_KEYS,
    load_run,
    render,
    report_command,
    stragglers,
    summarize,
    write_summary,
)
from launcher.util import percentile

SCHEMA_TOP = {
    "job",
    "status",
    "world_size",
    "nodes",
    "ranks",
    "totals",
    "training",
    "failure",
    "checkpoints",
}
SCHEMA_RANK = {
    "rank",
    "node",
    "host",
    "local_rank",
    "device",
    "steps",
    "step_time_ms_p50",
    "step_time_ms_p95",
    "samples_per_s",
    "tokens_per_s",
    "tflops",
    "mfu",
    "peak_mem_gib",
    "data_wait_pct",  # DESIGN.md's, then the GPU's (NVML; null without it)
    "sm_clock_mhz",
    "clock_limited_pct",
    "power_w",
    "energy_mj_per_token",
}
SCHEMA_TOTALS = {"tokens_per_s", "samples_per_s", "tokens_per_s_per_gpu", "mfu", "straggler_ranks"}
SCHEMA_FAILURE = {"rank", "node", "host", "exit_code", "signal", "log_tail", "reason"}  # DESIGN.md

SEQ = 128
MB = 8
T0 = 1_700_000_000.0


def layout(nodes: int = 2, per_node: int = 2, device: str = "cuda") -> list[dict]:
    return [
        {
            "rank": n * per_node + local,
            "node": f"node{n}",
            "host": f"10.0.0.{n + 1}",
            "local_rank": local,
            "device": device,
        }
        for n in range(nodes)
        for local in range(per_node)
    ]


def builtin_records(
    rank: int,
    *,
    step_ms: float,
    steps: int = 40,
    log_every: int = 10,
    warmup: int = 10,
    peak_tflops: float | None = 989.0,
    final: bool = False,
    mhz: float | None = None,
) -> list[dict]:
    """What the built-in trainer writes: meta, step records every log_every, maybe final; with
    ``mhz``, the GPU's clock (power-capped below 1900 MHz) and 500 W of energy."""
    recs = [
        {
            "type": "meta",
            "rank": rank,
            "time": T0,
            "local_rank": rank % 2,
            "world_size": 4,
            "host": "ignored-when-plan-has-it",
            "device": f"cuda:{rank % 2}",
            "device_name": "H200",
            "params": 110_000_000,
            "flops_per_token": 6.6e8,
            "peak_tflops": peak_tflops,
            "seq_len": SEQ,
            "micro_batch": MB,
            "grad_accum": 1,
        }
    ]
    t = T0
    for step in range(log_every, steps + 1, log_every):
        times = [step_ms + (i % 3) for i in range(log_every)]  # step_ms, +1, +2, ...
        interval = sum(times) / 1000.0
        t += interval
        recs.append(
            {
                "type": "step",
                "rank": rank,
                "time": t,
                "step": step,
                "tokens": log_every * MB * SEQ,
                "samples": log_every * MB,
                "interval_s": interval,
                "measured": step > warmup,
                "step_times_ms": times,
                "loss": 7.0,
                "lr": 1e-4,
                "data_wait_s": 0.02 * interval,
                "peak_mem_gib": 10.0 + rank,
            }
        )
        if mhz is not None:
            recs[-1] |= {
                "gpu_util_pct": 99.0,
                "sm_clock_mhz": mhz,
                "power_w": 480.0,
                "energy_j": 500.0 * interval,
                "clock_limits": ["power cap"] if mhz < 1900 else [],
            }
    if final:
        recs.append(
            {
                "type": "final",
                "rank": rank,
                "time": t,
                "steps": steps,
                "measured_steps": steps - warmup,
                "step_time_ms_p50": 123.0,
                "step_time_ms_p95": 150.0,
                "tokens_per_s": 9000.0,
                "samples_per_s": 70.0,
                "tflops": 5.9,
                "mfu": 0.4,
                "peak_mem_gib": 12.5,
                "data_wait_pct": 1.5,
                "gpu_util_pct": 97.0,
                "loss": 6.5,
            }
        )
    return recs


def ranks_alike(n: int = 2, *, step_ms: float = 100.0, **kw) -> dict[int, list[dict]]:
    """``n`` ranks' built-in records, every rank at ``step_ms``."""
    return {r: builtin_records(r, step_ms=step_ms, **kw) for r in range(n)}


def user_records(
    rank: int, *, gaps: list[float], tokens: int = 4096, samples: int = 32
) -> list[dict]:
    """What `launcher.report()` writes: step records with tokens since the previous call."""
    recs, t = [], T0
    for i, gap in enumerate([0.0, *gaps]):
        t += gap
        recs.append(
            {
                "type": "step",
                "rank": rank,
                "time": t,
                "step": (i + 1) * 5,
                "tokens": tokens,
                "samples": samples,
                "loss": 3.0,
            }
        )
    return recs


def write_run(run_dir: Path, job: str, ranks: list[dict], records: dict[int, list[dict]]) -> Path:
    """A run directory as the launcher leaves it: plan.json (the keys a report reads) and
    metrics/rank<R>.jsonl."""
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "plan.json").write_text(json.dumps({"job": job, "ranks": ranks}))
    for rank, recs in records.items():
        path = run_dir / "metrics" / f"rank{rank}.jsonl"
        for rec in recs:
            write_record(dict(rec), str(path))
    return run_dir


def test_builtin_steps_use_measured_intervals_only():
    recs = builtin_records(0, step_ms=100.0, steps=40, warmup=10)
    # Poison the warm-up record: if it counted, tokens/s and p95 would move a lot.
    recs[1]["tokens"] *= 100
    recs[1]["step_times_ms"] = [5000.0] * 10
    s = summarize("j", layout(1, 1), {0: recs}, status="succeeded")
    row = s["ranks"][0]
    measured = recs[2:]
    seconds = sum(r["interval_s"] for r in measured)
    assert row["steps"] == 40
    assert row["tokens_per_s"] == pytest.approx(3 * 10 * MB * SEQ / seconds)
    assert row["samples_per_s"] == pytest.approx(3 * 10 * MB / seconds)
    all_times = [t for r in measured for t in r["step_times_ms"]]
    assert row["step_time_ms_p50"] == pytest.approx(percentile(all_times, 50))
    assert row["step_time_ms_p95"] == pytest.approx(percentile(all_times, 95))
    assert row["step_time_ms_p95"] < 200
    assert row["tflops"] == pytest.approx(row["tokens_per_s"] * 6.6e8 / 1e12)
    assert row["mfu"] == pytest.approx(row["tflops"] / 989.0)
    assert row["data_wait_pct"] == pytest.approx(2.0)
    assert row["peak_mem_gib"] == 10.0
    assert row["device"] == "cuda:0"  # from meta, more precise than the plan's "cuda"
    assert row["host"] == "10.0.0.1"  # the plan's host wins


def test_final_record_wins_over_step_records():
    recs = builtin_records(0, step_ms=100.0, final=True)
    row = summarize("j", layout(1, 1), {0: recs}, status="succeeded")["ranks"][0]
    assert row["tokens_per_s"] == 9000.0
    assert row["step_time_ms_p50"] == 123.0 and row["step_time_ms_p95"] == 150.0
    assert row["mfu"] == 0.4 and row["tflops"] == 5.9 and row["peak_mem_gib"] == 12.5
    assert row["data_wait_pct"] == 1.5 and row["steps"] == 40


def test_unknown_peak_means_null_mfu():
    recs = builtin_records(0, step_ms=100.0, peak_tflops=None)
    s = summarize("j", layout(1, 1, "cpu"), {0: recs}, status="succeeded")
    assert s["ranks"][0]["mfu"] is None
    assert s["ranks"][0]["tflops"] is not None
    assert s["totals"]["mfu"] is None


def test_user_script_records_first_record_only_starts_the_clock():
    recs = user_records(0, gaps=[2.0, 2.0, 4.0])
    row = summarize("j", layout(1, 1, "cpu"), {0: recs}, status="succeeded")["ranks"][0]
    # Three intervals (8 s) after the first record; its own tokens are not counted.
    assert row["tokens_per_s"] == pytest.approx(3 * 4096 / 8.0)
    assert row["samples_per_s"] == pytest.approx(3 * 32 / 8.0)
    # 5 steps per interval: mean step times 400, 400, 800 ms.
    assert row["step_time_ms_p50"] == pytest.approx(400.0)
    assert row["step_time_ms_p95"] == pytest.approx(percentile([400.0, 400.0, 800.0], 95))
    assert row["steps"] == 20
    assert row["tflops"] is None and row["mfu"] is None and row["data_wait_pct"] is None


def test_user_script_single_record_measures_nothing():
    s = summarize("j", layout(1, 1, "cpu"), {0: user_records(0, gaps=[])}, status="succeeded")
    row = s["ranks"][0]
    assert row["steps"] == 5
    assert row["tokens_per_s"] is None and row["step_time_ms_p50"] is None


def test_stragglers_and_totals():
    ranks = layout(2, 2)
    step_ms = {0: 100.0, 1: 101.0, 2: 104.0, 3: 120.0}
    recs = {r: builtin_records(r, step_ms=ms) for r, ms in step_ms.items()}
    s = summarize("j", ranks, recs, status="succeeded")
    rows = s["ranks"]
    assert s["totals"]["straggler_ranks"] == [3]  # 104 is within 5% of the median, 120 is not
    tokens = [r["tokens_per_s"] for r in rows]
    assert s["totals"]["tokens_per_s"] == pytest.approx(sum(tokens))
    assert s["totals"]["samples_per_s"] == pytest.approx(sum(r["samples_per_s"] for r in rows))
    assert s["totals"]["tokens_per_s_per_gpu"] == pytest.approx(sum(tokens) / 4)
    assert s["totals"]["mfu"] == pytest.approx(sum(r["mfu"] for r in rows) / 4)
    assert s["world_size"] == 4 and s["nodes"] == 2
    text = render(s)
    assert "rank 3 on node1" in text and "Stragglers" in text


def test_gpu_clock_in_the_tables_and_the_straggler_line():
    """A rank whose GPU the power cap holds at a lower clock is the straggler, and says so."""
    step_ms = {0: 100.0, 1: 101.0, 2: 100.0, 3: 120.0}
    mhz = {0: 1980.0, 1: 1980.0, 2: 1965.0, 3: 1650.0}
    recs = {r: builtin_records(r, step_ms=ms, mhz=mhz[r]) for r, ms in step_ms.items()}
    s = summarize("j", layout(2, 2), recs, status="succeeded")
    assert_schema(s)
    r3 = s["ranks"][3]
    assert r3["sm_clock_mhz"] == 1650.0 and r3["clock_limited_pct"] == 100.0
    assert s["ranks"][0]["clock_limited_pct"] == 0.0
    assert r3["power_w"] == pytest.approx(500.0)  # energy over the measured intervals' time
    assert r3["energy_mj_per_token"] == pytest.approx(1e3 * 500.0 / r3["tokens_per_s"])
    text = render(s)
    assert "SM MHz" in text and "clock limited %" in text
    assert (
        "rank 3 on node1 (121.0 ms, +19.2%, SM clock 1650 MHz against a median 1972, limited 100% of the time)"
        in text
    )
    # from final records: the trainer's own figures
    fin = ranks_alike(final=True)
    fin[0][-1] |= dict(
        sm_clock_mhz=1700.0, clock_limited_pct=90.0, power_w=690.0, energy_mj_per_token=1.2
    )
    rows = summarize("j", layout(1, 2), fin, status="succeeded")["ranks"]
    assert rows[0]["sm_clock_mhz"] == 1700.0 and rows[0]["clock_limited_pct"] == 90.0
    assert rows[0]["power_w"] == 690.0 and rows[0]["energy_mj_per_token"] == 1.2
    assert rows[1]["sm_clock_mhz"] is None


def test_the_tables_of_gpu_and_cpu_runs_without_stragglers():
    """Per GPU and the GPU's clock columns for a CUDA run; per rank and neither for a CPU one."""
    recs = ranks_alike()
    text = render(summarize("j", layout(1, 2), recs, status="succeeded"))
    assert "tokens/s per GPU" in text and "Stragglers: none" in text
    for r in recs.values():
        r[0]["device"] = "cpu"
    s = summarize("j", layout(1, 2, device="cpu"), recs, status="succeeded")
    assert all(r["sm_clock_mhz"] is None and r["energy_mj_per_token"] is None for r in s["ranks"])
    text = render(s)
    assert "tokens/s per rank" in text and "per GPU" not in text and "SM MHz" not in text


def test_stragglers_need_two_measured_ranks():
    def rows(*p50: float | None) -> list[dict]:
        return [{"rank": r, "step_time_ms_p50": ms} for r, ms in enumerate(p50)]

    assert stragglers(rows(100.0)) == [] and stragglers(rows(100.0, None)) == []
    assert stragglers(rows(100.0, 200.0, 100.0)) == [1]


# -- schema and files ------------------------------------------------------------------------


def assert_schema(s: dict) -> None:
    assert set(s) == SCHEMA_TOP
    assert s["status"] in {"succeeded", "failed", "interrupted"}
    assert isinstance(s["world_size"], int) and isinstance(s["nodes"], int)
    for row in s["ranks"]:
        assert set(row) == SCHEMA_RANK
    assert set(s["totals"]) == SCHEMA_TOTALS
    assert all(isinstance(r, int) for r in s["totals"]["straggler_ranks"])
    assert s["training"] is None or set(s["training"]) == set(TRAINING_KEYS)
    assert s["failure"] is None or set(s["failure"]) == SCHEMA_FAILURE


def test_summary_json_keys_exactly_per_schema(tmp_path):
    recs = {r: builtin_records(r, step_ms=100.0 + r) for r in range(4)}
    s = summarize("bert-ddp", layout(2, 2), recs, status="succeeded")
    assert_schema(s)
    write_summary(tmp_path, s)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert_schema(on_disk)
    assert on_disk == json.loads(json.dumps(s))


def test_failed_run_with_missing_ranks(tmp_path):
    ranks = layout(2, 2)
    recs = {0: builtin_records(0, step_ms=100.0), 1: builtin_records(1, step_ms=101.0)}
    tail = "Traceback (most recent call last):\nRuntimeError: CUDA out of memory"
    failure = dict(rank=2, node="node1", host="10.0.0.2", exit_code=1, signal=None, log_tail=tail)
    s = summarize("bert-ddp", ranks, recs, status="failed", failure=failure)
    assert_schema(s)
    assert [r["rank"] for r in s["ranks"]] == [0, 1, 2, 3]
    for missing in s["ranks"][2:]:
        assert missing["node"] == "node1" and missing["local_rank"] in (0, 1)
        assert all(
            missing[k] is None
            for k in SCHEMA_RANK - {"rank", "node", "host", "local_rank", "device"}
        )
    # Totals over what was measured; per-GPU over measured ranks only.
    measured = [r["tokens_per_s"] for r in s["ranks"][:2]]
    assert s["totals"]["tokens_per_s"] == pytest.approx(sum(measured))
    assert s["totals"]["tokens_per_s_per_gpu"] == pytest.approx(sum(measured) / 2)
    text = write_summary(tmp_path, s)
    first = text.splitlines()[0]
    assert "FAILED" in first and "bert-ddp" in first
    assert "rank 2 on node node1" in text and "exit code 1" in text
    assert "CUDA out of memory" in text
    assert "2 of 4" in text and "0/2" in text  # ranks measured: node1 measured none of its two
    rank_lines = [ln for ln in text.splitlines() if ln.strip().startswith("3 ")]
    assert rank_lines and "–" in rank_lines[0]
    assert (tmp_path / "summary.txt").read_text() == text


def test_no_records_at_all_still_summarizes():
    s = summarize("j", layout(1, 2), {}, status="interrupted")
    assert_schema(s)
    assert s["totals"]["tokens_per_s"] is None and s["totals"]["mfu"] is None
    text = render(s)
    assert text.startswith("job j: INTERRUPTED")
    assert "not assessed" in text


def test_csv_one_row_per_rank(tmp_path):
    recs = ranks_alike(3)
    s = summarize("j", layout(1, 4), recs, status="interrupted")
    write_summary(tmp_path, s)
    rows = list(csv.DictReader(io.StringIO((tmp_path / "summary.csv").read_text())))
    assert len(rows) == 4
    assert set(rows[0]) == SCHEMA_RANK
    assert [int(r["rank"]) for r in rows] == [0, 1, 2, 3]
    assert float(rows[0]["mfu"]) == pytest.approx(s["ranks"][0]["mfu"])
    assert rows[3]["tokens_per_s"] == ""


def test_bad_status_is_a_bug():
    with pytest.raises(ValueError, match="status"):
        summarize("j", layout(1, 1), {}, status="ok")


# -- run directories and `launch report` ------------------------------------------------------


def test_load_run_rebuilds_from_plan_and_metrics(tmp_path):
    recs = {r: builtin_records(r, step_ms=100.0 + 10 * (r == 1), final=False) for r in range(4)}
    run = write_run(tmp_path / "run", "bert-ddp", layout(2, 2), recs)
    s = load_run(run)
    assert_schema(s)
    assert s["job"] == "bert-ddp" and s["world_size"] == 4
    assert s["status"] == "interrupted"  # no summary.json and no final records: it never finished
    assert s["totals"]["straggler_ranks"] == [1]
    assert read_records(run / "metrics" / "rank0.jsonl")[0]["type"] == "meta"


def test_load_run_takes_status_and_failure_from_summary_json(tmp_path):
    ranks = layout(1, 2)
    run = write_run(tmp_path / "run", "j", ranks, {0: builtin_records(0, step_ms=100.0)})
    reason = "rank 1 on node node0 (10.0.0.1) exited with signal SIGKILL"
    failure = dict(rank=1, node="node0", host="10.0.0.1", exit_code=None, signal="SIGKILL")
    failure |= {"log_tail": "killed", "reason": reason}
    write_summary(run, summarize("j", ranks, {}, status="failed", failure=failure))
    s = load_run(run)
    assert s["status"] == "failed" and s["failure"] == failure
    assert s["ranks"][0]["tokens_per_s"] is not None  # metrics re-read, not the stale summary
    assert "signal SIGKILL" in render(s)


def test_load_run_keeps_the_launchers_keys_of_a_run_without_restarts(tmp_path, capsys):
    ranks = layout(1, 2)
    run = write_run(tmp_path / "run", "j", ranks, ranks_alike())
    saved = summarize("j", ranks, {}, status="succeeded")
    saved["restarts"] = []  # DESIGN.md's summary.json: always there, empty without restarts
    saved["launcher_timings_s"] = {"preflight": 1.5, "train": 12.0}
    write_summary(run, saved)
    s = load_run(run)
    assert s["restarts"] == [] and s["launcher_timings_s"] == saved["launcher_timings_s"]
    assert s["ranks"][0]["tokens_per_s"] is not None  # still rebuilt from the metrics
    assert list(s) == list(saved)
    assert report_command(str(run), fmt="json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["restarts"] == [] and out["launcher_timings_s"] == saved["launcher_timings_s"]
    assert_schema({k: v for k, v in out.items() if k not in ("restarts", "launcher_timings_s")})


def test_load_run_with_only_summary_json_returns_it(tmp_path):
    s = summarize("j", layout(1, 2), ranks_alike(), status="succeeded")
    write_summary(tmp_path, s)
    assert load_run(tmp_path) == json.loads(json.dumps(s))


def test_load_run_of_a_restarted_run_keeps_the_launchers_summary(tmp_path):
    # node1 lost after attempt 0: attempt 1 runs 2 ranks; the metrics files hold both attempts
    run = write_run(tmp_path / "run", "j", layout(2, 2), ranks_alike(4))
    last = summarize("j", layout(1, 2), ranks_alike(step_ms=90.0), status="succeeded")
    last["restarts"] = [
        {"attempt": 1, "reason": "node node1 was lost", "nodes": ["node0"], "world_size": 2}
    ]
    last["attempts"] = [{"attempt": 0, "world_size": 4}, {"attempt": 1, "world_size": 2}]
    write_summary(run, last)
    s = load_run(run)
    assert s["world_size"] == 2 and s["restarts"] == last["restarts"]
    assert s["attempts"] == last["attempts"]


def test_load_run_all_final_records_counts_as_succeeded(tmp_path):
    run = write_run(tmp_path / "run", "j", layout(1, 2), ranks_alike(final=True))
    assert load_run(run)["status"] == "succeeded"


def test_load_run_torn_last_line_is_skipped(tmp_path):
    run = write_run(tmp_path / "run", "j", layout(1, 1), {0: user_records(0, gaps=[1.0, 1.0])})
    with open(run / "metrics" / "rank0.jsonl", "a") as fh:
        fh.write('{"type": "step", "rank": 0, "ti')
    assert load_run(run)["ranks"][0]["tokens_per_s"] == pytest.approx(4096.0)


def test_report_command_formats(tmp_path, capsys):
    run = write_run(tmp_path / "run", "j", layout(1, 2), ranks_alike())
    assert report_command(str(run)) == 0
    out = capsys.readouterr().out
    assert "Per rank" in out and "Per node" in out and "tokens/s" in out
    assert report_command(str(run), fmt="json") == 0
    assert_schema(json.loads(capsys.readouterr().out))
    assert report_command(str(run), fmt="csv") == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 3
    assert not (run / "summary.json").exists()  # re-rendering never writes into the run


@pytest.mark.parametrize("make", ["missing", "empty", "file"])
def test_report_command_rejects_non_run_directories(tmp_path, make):
    target = tmp_path / "x"
    if make == "empty":
        target.mkdir()
    elif make == "file":
        target.write_text("hi")
    with pytest.raises(UsageError) as err:
        report_command(str(target))
    assert err.value.exit_code == 2
    assert str(target) in str(err.value)
    assert "run directory" in str(err.value)


def test_report_command_rejects_bad_format_and_damaged_plan(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text("{not json")
    with pytest.raises(UsageError, match="format"):
        report_command(str(run), fmt="xml")
    with pytest.raises(UsageError, match="plan.json: not valid JSON"):
        report_command(str(run))


def test_checkpoints_count_once_complete_and_say_how_long_training_waited(tmp_path):
    """Per checkpoint the slowest rank's wait counts, and the parts of that rank's record; a
    background save counts as saved only with its checkpoint_complete record (step 30's never
    came: the run ended while it wrote)."""
    recs = ranks_alike()
    for step, waits in ((10, (0.02, 0.05)), (20, (0.04, 0.03)), (30, (0.01, 0.01))):
        for rank, wait in enumerate(waits):
            recs[rank].append(
                {
                    "type": "checkpoint",
                    "rank": rank,
                    "step": step,
                    "async": True,
                    "blocking_s": wait,
                    # the first save sets up; later ones wait for the previous one
                    "wait_s": 0.0 if step == 10 else wait - 0.01,
                    "setup_s": wait - 0.01 if step == 10 else 0.0,
                    "stage_s": 0.01,
                }
            )
    recs[0] += [
        {"type": "checkpoint_complete", "rank": 0, "step": s, "save_s": t}
        for s, t in ((10, 1.5), (20, 2.5))
    ]
    s = summarize("gpt", layout(1, 2), recs, status="succeeded")
    assert s["checkpoints"] == {
        "async": True,
        "saved": 2,
        "last_complete_step": 20,
        "blocking_s_mean": pytest.approx((0.05 + 0.04 + 0.01) / 3, abs=1e-4),
        "blocking_s_max": 0.05,
        "blocking_s_total": 0.1,
        "first_blocking_s": 0.05,
        # step 10: rank 1's parts, step 20: rank 0's, step 30: rank 1's (a tie: the later one)
        "blocking_parts_s_mean": {
            "wait": pytest.approx((0.0 + 0.03 + 0.0) / 3, abs=1e-4),
            "setup": pytest.approx((0.04 + 0.0 + 0.0) / 3, abs=1e-4),
            "stage": 0.01,
        },
        "save_s_mean": 2.0,
        "save_s_max": 2.5,
    }
    text = write_summary(tmp_path, s)
    assert "Checkpoints: 2 complete (last at step 20), written in the background" in text
    assert "wait 0.01 s, setup 0.01 s, stage 0.01 s; the first held 0.05 s" in text
    assert "a background save completed in 2.00 s (mean)" in text
    sync = {
        0: builtin_records(0, step_ms=1.0)
        + [{"type": "checkpoint", "step": 5, "async": False, "blocking_s": 0.3}]
    }
    old_records = summarize("gpt", layout(1, 1), sync, status="succeeded")["checkpoints"]
    assert old_records["blocking_parts_s_mean"] == {} and old_records["save_s_mean"] is None
    none = summarize("gpt", layout(1, 2), {0: builtin_records(0, step_ms=1.0)}, status="succeeded")
    assert none["checkpoints"] is None


def test_training_holds_the_last_loss_eval_loss_and_skips_also_for_a_failed_run():
    """From the lowest rank's step records: the last finite loss (a stop leaves the last record
    without one), its gradient norm, the last evaluation and every skipped step."""
    steps = [
        {"step": 10, "loss": 5.0, "grad_norm": 2.0, "eval_loss": 5.5, "skipped_steps": 1},
        {"step": 20, "loss": 4.0, "grad_norm": 1.5, "eval_loss": 4.6, "skipped_steps": 2},
        {"step": 30, "loss": None, "grad_norm": None, "eval_loss": None, "skipped_steps": 0},
    ]
    records = {1: [{"type": "step", **r} for r in steps], 2: []}
    s = summarize(
        "j", layout(1, 2)[1:] + [{**layout(1, 2)[0], "rank": 2}], records, status="failed"
    )
    assert s["training"] == dict(
        step=30, loss=4.0, grad_norm=None, eval_loss=4.6, eval_step=20, skipped_steps=3
    )
    assert (
        "Training: step 30, loss 4, eval loss 4.6 (step 20), 3 non-finite step(s) skipped"
        in render(s)
    )
    assert summarize("j", layout(1, 1), {0: []}, status="failed")["training"] is None


def test_a_run_stopped_before_any_worker_shows_why_and_no_empty_tables():
    summary = summarize(
        "j", [], {}, status="failed", failure={"reason": "Preflight failed: needs 2 GPUs, has 0"}
    )
    text = render(summary)
    assert text == (
        "job j: FAILED before any worker started\nReason: Preflight failed: needs 2 GPUs, has 0\n"
    )
