"""benchmarks/gpt_vs_nanogpt.py's bookkeeping: nanoGPT's log lines, the token file, the ratios."""

from __future__ import annotations

from pathlib import Path

import gpt_vs_nanogpt as bench
import pytest
import torch


def test_nanogpt_iteration_lines_are_parsed():
    m = bench.ITER_RE.match("iter 199: loss 10.8393, time 34.18ms, mfu 38.47%")
    assert m and (int(m[1]), float(m[2]), float(m[3])) == (199, 10.8393, 34.18)
    assert bench.ITER_RE.match("step 0: train loss 10.9, val loss 10.9") is None


def test_the_token_file_holds_gpt2_ids_as_uint16(tmp_path: Path):
    path = tmp_path / "tokens.bin"
    bench.write_random_tokens(path, 10_000)
    ids = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint16).to(torch.int32)
    assert ids.numel() == 10_000 and int(ids.min()) >= 0 and int(ids.max()) < bench.GPT2_TOKENS
    assert len(ids.unique()) > 5_000  # spread over the vocabulary, not a constant


def test_flops_per_token_is_the_trainers_formula_for_gpt2_124m():
    n = 12 * (4 * 768**2 + 2 * 768 * 3072) + 50304 * 768
    assert bench.flops_per_token() == pytest.approx(6 * n + 6 * 12 * 768 * 1024)


def test_ratios_are_against_nanogpt_and_skip_failed_rows():
    row = {"mfu": 0.4, "step_ms_p50": 30.0}
    results = {
        "nanogpt": {"tokens_per_s": 400.0, "loss": 10.0, "energy_mj_per_token": 1.5, **row},
        "ours": {"tokens_per_s": 500.0, "loss": 10.1, "energy_mj_per_token": 1.2, **row},
        "ours-no-nvml": {"tokens_per_s": 500.0, "loss": 10.0, "energy_mj_per_token": None, **row},
        "ours-fp8": {"error": "boom"},
    }
    r = bench.ratios(results)
    assert set(r) == {"ours", "ours-no-nvml"}
    assert r["ours"]["speed"] == pytest.approx(1.25)
    assert r["ours"]["loss_rel_diff"] == pytest.approx(0.01)
    assert r["ours"]["per_joule"] == pytest.approx(1.25) and r["ours-no-nvml"]["per_joule"] is None
    assert bench.ratios({"ours": {"tokens_per_s": 1.0, "loss": 1.0}}) == {}
    table = bench.table(results)
    assert "FAILED: boom" in table and "1.250x" in table and "+1.00" in table
    assert table.splitlines()[2].endswith("1.250x")  # ours, per joule


def test_the_gpu_window_interpolates_the_energy_counter_at_its_ends():
    sampler = bench.GpuSampler.__new__(bench.GpuSampler)  # samples given, no NVML thread

    def sample(t: float, mhz: float, limits: list[str]) -> tuple[float, dict]:
        return t, {
            "gpu_util_pct": 99.0,
            "sm_clock_mhz": mhz,
            "power_w": 0.0,
            "clock_limits": limits,
            "energy_counter_j": 1000.0 + 700.0 * t,
        }  # 700 W throughout

    sampler.samples = [
        sample(0.0, 1980.0, []),
        sample(1.0, 1700.0, ["power cap"]),
        sample(2.0, 1600.0, ["power cap"]),
        sample(3.0, 1980.0, []),
    ]
    w = sampler.window(0.5, 2.5)
    assert w["energy_j"] == pytest.approx(1400.0) and w["power_w"] == pytest.approx(700.0)
    assert w["sm_clock_mhz"] == pytest.approx(1650.0)
    assert w["power_capped_pct"] == pytest.approx(100.0)
    assert w["samples"] == 2 and w["seconds"] == pytest.approx(2.0)
    # past the last sample: unknown, not guessed
    assert sampler.window(2.5, 3.5)["energy_j"] is None
    result = bench.with_energy({"tokens_per_s": 1.0}, sampler, 0.5, 2.5, tokens=1_400_000)
    assert result["energy_mj_per_token"] == pytest.approx(1.0)
