"""train.profile: which ranks record, which steps, what is written (CPU, real torch.profiler)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch

from launcher.spec.job import ProfileSpec
from launcher.train.profiling import StepProfiler

CPU = torch.device("cpu")


def run_steps(profiler: StepProfiler, steps: int) -> list[Path]:
    written = []
    x = torch.randn(64, 64)
    for step in range(1, steps + 1):
        profiler.before_step(step)
        x = torch.tanh(x @ x)
        path = profiler.after_step(step)
        if path is not None:
            written.append(path)
    return written


def test_the_chosen_window_is_written_as_a_trace_and_a_table(tmp_path: Path):
    profiler = StepProfiler(ProfileSpec(start_step=2, steps=3), rank=0, device=CPU, out_dir=tmp_path)
    assert run_steps(profiler, 6) == [tmp_path / "rank0.trace.json.gz"]
    trace = json.loads(gzip.decompress((tmp_path / "rank0.trace.json.gz").read_bytes()))
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names and "aten::tanh" in names
    table = (tmp_path / "rank0.ops.txt").read_text()
    assert table.startswith("rank 0, steps 2..4:") and "aten::mm" in table
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.ops.txt", "rank0.trace.json.gz"]


def test_only_the_listed_ranks_record(tmp_path: Path):
    spec = ProfileSpec(start_step=1, steps=1, ranks=[1])
    assert not StepProfiler(spec, rank=0, device=CPU, out_dir=tmp_path).enabled
    assert StepProfiler(spec, rank=1, device=CPU, out_dir=tmp_path).enabled
    assert StepProfiler(ProfileSpec(start_step=1, ranks="all"), rank=7, device=CPU).enabled
    assert not StepProfiler(ProfileSpec(), rank=0, device=CPU).enabled  # start_step 0: off
    assert run_steps(StepProfiler(spec, rank=0, device=CPU, out_dir=tmp_path), 3) == []
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_recording_cut_short_writes_nothing(tmp_path: Path):
    profiler = StepProfiler(ProfileSpec(start_step=2, steps=5), rank=0, device=CPU, out_dir=tmp_path)
    assert run_steps(profiler, 3) == []  # the window ends at step 6: still recording
    profiler.close()
    assert not any(tmp_path.iterdir())
    assert run_steps(StepProfiler(ProfileSpec(start_step=2, steps=1), rank=0, device=CPU,
                                  out_dir=tmp_path / "again"), 2)  # the profiler is usable again
