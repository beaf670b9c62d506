"""benchmarks/step_energy.py's bookkeeping: the parts of a GPT step, per-step sums, the trainer's step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import step_energy as bench

from launcher.spec.job import ModelSpec
from launcher.train.model import flops_per_token


def test_the_parts_hold_the_model_flops_mfu_counts():
    parts = bench.plan()
    per_token = sum(p.flops * p.count for p in parts) / bench.TOKENS
    spec = ModelSpec(arch="gpt", size="base", bias=False)
    assert per_token == pytest.approx(flops_per_token(spec, seq_len=bench.SEQ, mask_prob=0.15))
    assert {p.group for p in parts} == set(bench.GROUPS)
    assert len({p.name for p in parts}) == len(parts)
    parts = bench.plan({"gemm"})  # only the named groups
    assert len(parts) == 15 and {p.group for p in parts} == {"gemm"}
    head = [p for p in parts if p.name.startswith("head")]
    assert [p.count for p in head] == [1, 1, 1]


def test_each_part_is_counted_as_often_as_a_step_calls_it():
    part = bench.Part("fc forward", "gemm", 12, 2e9)
    row = bench.per_step(part, {"ms": 0.5, "mj": 300.0})
    assert row["ms_per_step"] == pytest.approx(6.0) and row["j_per_step"] == pytest.approx(3.6)
    assert row["tflops"] == pytest.approx(4.0) and row["pj_per_flop"] == pytest.approx(150.0)
    assert "tflops" not in bench.per_step(
        bench.Part("GELU forward + backward", "gelu", 12), {"ms": 0.1, "mj": 30.0}
    )


def test_groups_sum_their_parts_and_share_the_joules():
    rows = [
        {"group": "gemm", "ms_per_step": 10.0, "j_per_step": 6.0},
        {"group": "gemm", "ms_per_step": 2.0, "j_per_step": 1.5},
        {"group": "loss", "ms_per_step": 1.0, "j_per_step": 0.5},
    ]
    groups = bench.by_group(rows)
    assert groups["gemm"] == dict(ms_per_step=12.0, j_per_step=7.5, share=pytest.approx(0.9375))
    assert groups["loss"]["share"] == pytest.approx(0.0625)
    text = bench.table([], groups, None)
    assert "sum of the parts" in text and "93.8%" in text


def test_the_whole_step_comes_from_the_final_record(tmp_path: Path):
    metrics = tmp_path / "rank0.jsonl"
    final = {"type": "final", "tokens_per_s": 16384 / 0.028, "energy_mj_per_token": 1.2}
    records = [{"type": "step", "step": 20}, {**final, "power_w": 700.0, "sm_clock_mhz": 1660.0}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    whole = bench.whole_step(metrics)
    assert whole["ms_per_step"] == pytest.approx(28.0)
    assert whole["j_per_step"] == pytest.approx(16384 * 1.2e-3)
    metrics.write_text(json.dumps({**final, "energy_mj_per_token": None}) + "\n")  # no NVML
    with pytest.raises(SystemExit, match="energy_mj_per_token"):
        bench.whole_step(metrics)


def test_wgrad_batching_ways_compute_every_layers_weight_gradient():
    import torch
    import wgrad_batching

    layers, tokens, k, n = bench.LAYERS, 16, 8, 4
    x = torch.randn(layers, tokens, k, dtype=torch.float64)
    dy = torch.randn(layers, tokens, n, dtype=torch.float64)
    want = torch.stack([dy[i].t() @ x[i] for i in range(layers)])
    names = wgrad_batching._ways(torch, x, dy, torch.empty(layers, n, k, dtype=torch.float64))
    assert set(names) == {"per layer", "batched", "stacked", "pointers"}
    with pytest.raises(RuntimeError, match="did not take these tensors"):
        names["pointers"]()  # cuBLAS's way, on the CPU: refused, not silently skipped
    for way in ("per layer", "batched", "stacked"):
        dw = torch.empty(layers, n, k, dtype=torch.float64)
        ways = wgrad_batching._ways(torch, x, dy, dw)
        ways[way]()
        torch.testing.assert_close(dw, want, msg=way)
