"""benchmarks/gpu_bench.py's bookkeeping: median rounds and the ratios (pure; no GPU)."""

from __future__ import annotations

import gpu_bench
import pytest


def run(per_gpu: float, gpus: int) -> dict:
    """One trainer run's result, as gpu_bench records it."""
    return {
        "gpus": gpus,
        "tokens_per_s": per_gpu * gpus,
        "tokens_per_s_per_gpu": per_gpu,
        "mfu": 0.3,
        "step_ms_p50": 27.0,
        "wall_s": 30.0,
    }


def test_the_median_round_is_reported_with_every_round():
    rounds = [{"tokens_per_s": t} for t in (3.0, 1.0, 2.0)]
    assert gpu_bench._median_round(rounds) == {"tokens_per_s": 2.0, "rounds": [3.0, 1.0, 2.0]}
    assert gpu_bench._median_round([{"ratio": 1.7}, {"ratio": 1.5}])["ratio"] == 1.5  # lower middle
    assert gpu_bench._median_round([{"tokens_per_s": 5.0}]) == {"tokens_per_s": 5.0}
    failed = [{"tokens_per_s": 3.0}, {"error": "boom"}]
    assert gpu_bench._median_round(failed) == {"error": "boom"}  # a failed round is the result


def test_ratios_are_per_gpu_and_missing_runs_give_none():
    results = {
        "hf-vs-ours-eager": {"hf_tokens_per_s": 300.0, "ours_tokens_per_s": 450.0, "ratio": 1.5},
        "bert-ddp-launch-1": run(600.0, 1),
        "bert-ddp-launch-2": run(540.0, 2),
        "bert-ddp-torchrun-1": run(600.0, 1),
        "bert-ddp-torchrun-2": run(570.0, 2),
        "hf-ddp-ref-1": run(330.0, 1),
        "hf-ddp-ref-2": run(323.4, 2),
    }
    r = gpu_bench._ratios(results)
    assert r["launch_1gpu_over_hf_eager"] == pytest.approx(2.0)
    assert r["ddp_scaling_efficiency_2gpu"] == pytest.approx(0.9)
    assert r["ddp_scaling_efficiency_2gpu_torchrun"] == pytest.approx(0.95)
    assert r["launch_over_torchrun_2gpu"] == pytest.approx(540 / 570)
    assert r["hf_ddp_ref_scaling_efficiency_2gpu"] == pytest.approx(0.98)
    assert r["fsdp_scaling_efficiency_2gpu"] is None
    assert r["ours_ddp_ref_scaling_efficiency_2gpu"] is None


def test_ratios_by_round_pair_the_runs_of_one_round():
    rounds = {  # round 1 of launch-1 stalled: the median rounds would pair 560 (round 1) with 560
        "bert-ddp-launch-1": [run(560.0, 1), run(610.0, 1)],
        "bert-ddp-launch-2": [run(560.0, 2), run(565.0, 2)],
    }
    by_round = gpu_bench._ratios_by_round(rounds)
    assert [r["ddp_scaling_efficiency_2gpu"] for r in by_round] == pytest.approx([1.0, 565 / 610])
    medians = {name: gpu_bench._median_round(runs) for name, runs in rounds.items()}
    assert gpu_bench._ratios(medians)["ddp_scaling_efficiency_2gpu"] == pytest.approx(1.0)
    # a failed run leaves that round's ratio empty
    rounds["bert-ddp-launch-2"][1] = {"error": "boom"}
    assert gpu_bench._ratios_by_round(rounds)[1]["ddp_scaling_efficiency_2gpu"] is None
    text = gpu_bench._table(medians, gpu_bench._ratios(medians), by_round)
    assert "ddp_scaling_efficiency_2gpu: 1.000 (by round: 1.000, 0.926)" in text


def test_a_bench_stopped_part_way_keeps_what_it_measured():
    """results.json after each run: the runs made so far, their ratios, and a round cut short
    paired within itself (round 2 lost its last run here)."""

    rounds = {
        "bert-ddp-torchrun-1": [run(660.0, 1)],
        "bert-ddp-launch-1": [run(659.0, 1), run(661.0, 1)],
        "bert-ddp-launch-2": [run(641.0, 2), run(640.0, 2)],
        "bert-fsdp-launch-1": [],
    }
    got = gpu_bench._summary(rounds, planned=8, env={"gpus": []})
    assert (got["runs"], got["runs_planned"], got["complete"]) == (5, 8, False)
    assert set(got["results"]) == set(rounds) - {"bert-fsdp-launch-1"}
    by_round = got["ratios_by_round"]
    assert [r["ddp_scaling_efficiency_2gpu"] for r in by_round] == pytest.approx(
        [641 / 659, 640 / 661]
    )
    assert by_round[0]["launch_over_torchrun_1gpu"] == pytest.approx(659 / 660)
    assert by_round[1]["launch_over_torchrun_1gpu"] is None
    rounds["bert-ddp-torchrun-1"].append(run(660.0, 1))
    rounds["bert-fsdp-launch-1"] = [run(600.0, 1), run(590.0, 1)]
    assert gpu_bench._summary(rounds, planned=8, env={})["complete"]
