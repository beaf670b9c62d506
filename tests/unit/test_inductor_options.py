"""benchmarks/inductor_options.py: its options reach inductor's config, and bad ones are refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import inductor_options as tool  # noqa: E402


def test_values_are_python_literals():
    assert tool.parse_option("combo_kernels=True") == ("combo_kernels", True)
    assert tool.parse_option(
        "post_grad_fusion_options={'batch_linear_post_grad': {'min_fuse_set_size': 4}}"
    ) == ("post_grad_fusion_options", {"batch_linear_post_grad": {"min_fuse_set_size": 4}})
    with pytest.raises(ValueError, match="KEY=VALUE"):
        tool.parse_option("combo_kernels")
    with pytest.raises(ValueError, match="not a Python literal"):
        tool.parse_option("combo_kernels=yes please")


def test_apply_sets_known_keys_and_refuses_others():
    import torch._inductor.config as config

    before = config.aggressive_fusion
    # config.patch restores the value as inductor keeps it (monkeypatch's delattr would hide
    # the key from later compiles: torch keeps overrides in ContextVars).
    with config.patch(aggressive_fusion=before):
        tool.apply([("aggressive_fusion", True)])
        assert config.aggressive_fusion is True
    assert config.aggressive_fusion is before
    with pytest.raises(ValueError, match="no option 'not_an_option'"):
        tool.apply([("not_an_option", 1)])


@pytest.mark.processes
def test_an_unknown_option_exits_2_before_training():
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "inductor_options.py"),
            "--option",
            "no_such_option=1",
            "--",
            "--job",
            str(REPO / "jobs" / "quickstart.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "no option 'no_such_option'" in proc.stderr
