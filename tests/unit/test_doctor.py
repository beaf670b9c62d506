"""``launch doctor`` on recorded run directories: each finding from what the run wrote, most
costly first, and a clean run said to be clean."""

from __future__ import annotations

import json
from pathlib import Path

from launcher.results.doctor import diagnose, doctor_command

STEP = dict(tokens=1000, samples=8, interval_s=1.0, step_times_ms=[100.0] * 10, measured=True)


def make_run(
    root: Path,
    *,
    wait_s: float = 0.0,
    device: str = "cpu",
    env: dict | None = None,
    telemetry: list | None = None,
    peak: float = 1.0,
) -> Path:
    ranks = [
        {"rank": r, "node": "n0", "host": "h", "local_rank": r, "device": "cpu"} for r in (0, 1)
    ]
    plan = {
        "world_size": 2,
        "backend": "nccl" if device == "cuda" else "gloo",
        "device": device,
        "ranks": ranks,
        "nodes": [{"name": "n0", "env": env or {}}],
    }
    (root / "metrics").mkdir(parents=True)
    (root / "plan.json").write_text(json.dumps(plan))
    (root / "job.yaml").write_text("name: t\ntrain: {micro_batch: 8}\n")
    for r in (0, 1):
        records = [{"type": "meta", "rank": r, "device_name": "cpu"}]
        step = dict(type="step", rank=r, data_wait_s=wait_s, peak_mem_gib=peak, **STEP)
        records += [{**step, "step": 10 * i, "time": float(i)} for i in range(1, 6)]
        (root / "metrics" / f"rank{r}.jsonl").write_text(
            "".join(json.dumps(x) + "\n" for x in records)
        )
    if telemetry:
        (root / "telemetry").mkdir()
        (root / "telemetry/n0.jsonl").write_text("".join(json.dumps(s) + "\n" for s in telemetry))
    return root


def test_a_clean_run_says_so(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    assert diagnose(run) == []
    assert doctor_command(str(run)) == 0
    assert "no problems found" in capsys.readouterr().out


def test_data_wait_comes_first_with_its_share_and_the_setting(tmp_path, capsys):
    run = make_run(tmp_path / "run", wait_s=0.4, env={"NCCL_P2P_DISABLE": "1"}, device="cuda")
    findings = diagnose(run)
    assert [f.kind for f in findings] == ["data_wait", "nccl_settings"]
    assert round(findings[0].cost_pct) == 40 and "data.path" in findings[0].change
    assert "NCCL_P2P_DISABLE=1 on n0" in findings[1].evidence
    doctor_command(str(run), as_json=True)
    out = json.loads(capsys.readouterr().out)
    assert not out["clean"] and out["findings"][0]["kind"] == "data_wait"


def test_capped_clocks_idle_gpus_and_unused_memory_from_telemetry(tmp_path):
    sample = {
        "util_pct": 60.0,
        "sm_clock_mhz": 1400.0,
        "max_sm_clock_mhz": 2000.0,
        "power_w": 700.0,
        "power_cap_w": 700.0,
        "mem_total_gib": 80.0,
        "clock_limits": ["power cap"],
    }
    run = make_run(tmp_path / "run", device="cuda", telemetry=[sample] * 4, peak=10.0)
    kinds = {f.kind: f for f in diagnose(run)}
    assert set(kinds) == {"gpu_idle", "clock_capped", "memory_headroom"}
    assert "70% of the maximum SM clock" in kinds["clock_capped"].evidence
    assert "train.micro_batch: 48" in kinds["memory_headroom"].change
    assert kinds["gpu_idle"].title.startswith("Host-bound")


def test_gpu_use_is_judged_while_steps_ran_not_during_start_up(tmp_path):
    busy = {"util_pct": 100.0, "clock_limits": []}
    idle = {"util_pct": 0.0, "clock_limits": ["power cap"]}
    telemetry = [{**idle, "time": t} for t in (-30.0, -20.0, -10.0)]
    telemetry += [{**busy, "time": t} for t in (0.5, 2.5, 4.5)]
    telemetry += [{**idle, "time": 9.0}]
    run = make_run(tmp_path / "run", device="cuda", telemetry=telemetry, peak=70.0)
    assert {f.kind for f in diagnose(run)} == set()
