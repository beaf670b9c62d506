"""The preflight's deep checks on a real GPU (skipped where CUDA is absent)."""

from __future__ import annotations

import pytest

from launcher.preflight import run_preflight
from launcher.spec import ClusterSpec

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_deep_probe_sees_cuda_cudnn_and_nccl_really_working():
    report = run_preflight(ClusterSpec.this_machine(), deep=True)
    assert report.ok, report.table()
    probe = report.probes["local"]
    deep = probe["deep"]
    assert deep["cuda_available"] and deep["device_count"] == torch.cuda.device_count()
    assert deep["cudnn"]["available"] and deep["cudnn"]["enabled"] and deep["cudnn"]["version"]
    assert deep["conv"]["speedup"] > 1.0, deep["conv"]  # cuDNN really ran, and beat the fallback
    assert deep["nccl"]
    assert deep["loaded_libs"]["libcudnn"], "no libcudnn in the process's maps"
    assert report.gpus("local") == torch.cuda.device_count()
