"""train.profile: which ranks record, which steps, what is written (CPU, real torch.profiler)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from launcher.spec.job import ProfileSpec
from launcher.train.profiling import (
    StepProfiler,
    breakdown_table,
    device_timeline,
    gaps_text,
    idle_gaps,
    kernel_breakdown,
    kernel_kind,
    timeline_line,
)

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
    spec = ProfileSpec(start_step=2, steps=3)
    profiler = StepProfiler(spec, rank=0, device=CPU, out_dir=tmp_path)
    assert run_steps(profiler, 6) == [tmp_path / "rank0.trace.json.gz"]
    trace = json.loads(gzip.decompress((tmp_path / "rank0.trace.json.gz").read_bytes()))
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names and "aten::tanh" in names
    table = (tmp_path / "rank0.ops.txt").read_text()
    assert table.startswith("rank 0, steps 2..4:") and "aten::mm" in table
    # no device activity on the CPU
    assert "device timeline" not in table and "kernels by kind" not in table
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
    spec = ProfileSpec(start_step=2, steps=5)
    profiler = StepProfiler(spec, rank=0, device=CPU, out_dir=tmp_path)
    assert run_steps(profiler, 3) == []  # the window ends at step 6: still recording
    profiler.close()
    assert not any(tmp_path.iterdir())
    one_step = ProfileSpec(start_step=2, steps=1)
    again = StepProfiler(one_step, rank=0, device=CPU, out_dir=tmp_path / "again")
    assert run_steps(again, 2)  # the profiler is usable again


def kernel(name: str, start: float, end: float, device: int = 0, cat: str = "kernel") -> dict:
    args = {"device": device, "stream": 7}
    return {"cat": cat, "name": name, "ts": start, "dur": end - start, "args": args}


HOST_EVENT = {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 900}


def test_the_device_timeline_splits_compute_communication_and_idle():
    # Two steps (µs): compute 0-10 and 12-20, 30-40 and 40-44 (touching); an all-reduce 15-25
    # (5 µs under compute) and 42-50 (2 µs under); a copy 26-28. Another device's and host
    # events are ignored.
    events = [
        kernel("sm90_gemm", 0, 10),
        kernel("triton_poi_fused", 12, 20),
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 15, 25),
        kernel("Memcpy DtoD", 26, 28, cat="gpu_memcpy"),
        kernel("sm90_gemm", 30, 40),
        kernel("multi_tensor_apply_kernel", 40, 44),
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 42, 50),
        kernel("sm90_gemm", 0, 1000, device=1),
        HOST_EVENT,
    ]
    t = device_timeline(events, steps=2, device=0)
    assert t is not None
    assert t["span_ms"] == pytest.approx(50e-3 / 2)
    assert t["compute_ms"] == pytest.approx((10 + 8 + 2 + 14) * 1e-3 / 2)
    assert t["comm_ms"] == pytest.approx((10 + 8) * 1e-3 / 2)
    assert t["comm_exposed_ms"] == pytest.approx((5 + 6) * 1e-3 / 2)
    assert t["idle_ms"] == pytest.approx((2 + 1 + 2) * 1e-3 / 2)  # 10-12, 25-26, 28-30
    assert t["kernels"] == 3.5
    line = timeline_line(t)
    assert line.startswith(
        "device timeline per step: span 0.03 ms, compute 0.02 ms, communication 0.01 ms"
    )


def test_a_trace_without_device_activity_has_no_timeline():
    assert device_timeline([HOST_EVENT], steps=1) is None
    # every device counts when none is named
    t = device_timeline([kernel("a", 0, 4), kernel("b", 2, 6, device=1)], steps=1)
    assert t is not None and t["compute_ms"] == pytest.approx(6e-3) and t["idle_ms"] == 0


# Kernel names as they appear in an H200 trace of the built-in GPT and BERT steps (torch 2.11).
NAMED = {
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matrix products",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "matrix products",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_128x128_64x3_nt_align8>": "matrix products",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64": "attention",
    "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*)": "attention",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "communication",
    "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, FusedAdamMathFunctor>": "optimizer and gradient norm",
    "triton_per_fused__to_copy_add_native_layer_norm_native_layer_norm_backward_view_3": "normalization",
    "triton_poi_fused__unsafe_view_gelu_gelu_backward_view_2": "activation",
    "triton_red_fused__to_copy_exp_gather_logsumexp_scatter_sub_unsqueeze_view_7": "loss",
    "_xent_kernel": "loss",  # launcher.train.fused.softmax_xent_
    "triton_poi_fused_clone_permute_stack_5": "copies, casts, memsets",
    "triton_poi_fused__to_copy_t_4": "copies, casts, memsets",
    "Memset (Unknown)": "copies, casts, memsets",
    "void at::native::reduce_kernel<128, 4, ReduceOp<float, sum_functor<float>>>": "other",
}


@pytest.mark.parametrize(("name", "kind"), NAMED.items())
def test_kernels_are_named_for_what_they_do(name: str, kind: str):
    assert kernel_kind(name) == kind


def test_the_breakdown_sums_each_kind_and_ranks_the_busiest_kernels():
    # Two steps (µs): two products of 6 and one of 4, an attention kernel twice, a memset;
    # the other device's kernel and the host event are left out.
    gemm = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"
    attn = "cudnn_generated_fort_native_sdpa_sm90_flash"
    events = [
        kernel(gemm, 0, 6),
        kernel(gemm, 10, 16),
        kernel("sm90_xmma_gemm_bf16", 20, 24),
        kernel(attn, 30, 33),
        kernel(attn, 40, 43),
        kernel("Memset (Unknown)", 50, 51, cat="gpu_memset"),
        kernel(gemm, 0, 500, device=1),
        HOST_EVENT,
    ]
    b = kernel_breakdown(events, steps=2, device=0, top=2)
    assert b is not None
    assert b["kinds"] == pytest.approx(  # busiest first
        {"matrix products": 8e-3, "attention": 3e-3, "copies, casts, memsets": 0.5e-3}
    )
    assert list(b["kinds"]) == ["matrix products", "attention", "copies, casts, memsets"]
    assert b["total_ms"] == pytest.approx(11.5e-3)
    assert [(k["name"], k["launches"]) for k in b["top"]] == [(gemm, 1.0), (attn, 1.0)]
    assert b["top"][0]["ms"] == pytest.approx(6e-3)
    table = breakdown_table(b)
    assert "matrix products" in table and "69.6" in table  # 8 of 11.5
    assert kernel_breakdown([HOST_EVENT], steps=1) is None


class _RecordedOnAGPU:
    """What ``_write`` asks of a stopped ``torch.profiler.profile``, with a GPU step's kernels."""

    def __init__(self, events: list[dict]):
        self.events = events

    def export_chrome_trace(self, path: str) -> None:
        Path(path).write_text(json.dumps({"traceEvents": self.events}))

    def key_averages(self):
        class Table:
            def table(self, **_kw) -> str:
                return "(operator table)"

        return Table()


def test_a_gpu_profile_writes_the_timeline_and_the_breakdown(tmp_path: Path):
    spec = ProfileSpec(start_step=3, steps=2)
    profiler = StepProfiler(spec, rank=1, device=torch.device("cuda", 0), out_dir=tmp_path)
    events = [
        kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 0, 30),
        kernel("triton_poi_fused__unsafe_view_gelu_5", 30, 40),
    ]
    written = profiler._write(_RecordedOnAGPU(events), wall_ms=25.0)
    assert written == tmp_path / "rank1.trace.json.gz"
    text = (tmp_path / "rank1.ops.txt").read_text()
    assert text.startswith("rank 1, steps 3..4: 25.0 ms per step")
    assert "device timeline per step: span 0.02 ms" in text
    kinds = text[text.index("kernels by kind") : text.index("(operator table)")]
    assert all(word in kinds for word in ("matrix products", "75.0", "activation", "25.0"))


def test_idle_gaps_split_kernel_to_kernel_gaps_from_waits_for_the_host():
    """Two steps on two streams: 2 µs gaps between kernels, one 400 µs wait on the host, and a
    kernel on a second stream that covers a gap of the first (no idle time there)."""
    events = [
        kernel("a", 0, 10),
        kernel("b", 12, 22),
        kernel("side", 20, 35),
        kernel("c", 35, 45),  # b..c covered by side
        kernel("d", 47, 57),
        kernel("sync-wait-after", 457, 467),
        kernel("e", 469, 479),
        kernel("other-gpu", 100, 400, device=1),
        {"cat": "cpu_op", "name": "aten::mm", "ts": 60, "dur": 5},
    ]
    g = idle_gaps(events, steps=2, device=0)
    # a→b, c→d and wait→e are 2 µs apart; side runs from b's end to c's start: no gap there
    assert g["short"] == 1.5 and g["short_ms"] == pytest.approx(3 * 2e-3 / 2)
    assert g["long"] == 0.5 and g["long_ms"] == pytest.approx(400e-3 / 2)
    assert g["longest"] == [{"us": 400.0, "after": "d", "before": "sync-wait-after"}]
    text = gaps_text(g)
    assert "in 1.5 gaps under 5 us" in text and "400.0 us after d, before sync-wait-after" in text
    assert idle_gaps([{"cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}], steps=1) is None
