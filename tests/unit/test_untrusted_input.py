"""Input the launcher must not take at its word: a job's output beside the driver's state
lines, a safetensors header's length, an older Ray."""

from __future__ import annotations

import importlib.metadata
import json
import struct

import pytest

from launcher.errors import PreflightError
from launcher.jobs import state
from launcher.orchestrate import ray_cluster
from launcher.spec.hf import FolderError, _safetensors_shapes


@pytest.mark.parametrize("sep", ["\r", "\x85", "\u2028", "\x0b", "\x1c"])
def test_a_jobs_output_cannot_forge_a_state_line(sep):
    real = state.line({"state": "running", "step": 3})
    forged = state.line({"state": "done", "status": "SUCCEEDED"})
    logs = f"{real}\n[local/rank0] hello{sep}{forged}\n"
    assert state.last_state(logs) == {"state": "running", "step": 3}
    assert state.strip(logs) == f"[local/rank0] hello{sep}{forged}\n"


def test_strip_keeps_every_other_line_as_it_was():
    logs = f"a\n{state.line({'state': 'x'})}\nb\r\n\nc"
    assert state.strip(logs) == "a\nb\r\n\nc"


def test_a_safetensors_header_longer_than_its_file_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(FolderError, match="header length 1099511627776") as err:
        _safetensors_shapes(path)
    assert str(path) in str(err.value)
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}})
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(24))
    assert _safetensors_shapes(path) == {"w": (2, 3)}


@pytest.mark.parametrize(
    ("version", "ok"), [("2.51.1", False), ("2.40.0", False), ("2.52.0", True), ("3.0.0", True)]
)
def test_a_ray_without_token_authentication_is_refused(monkeypatch, version, ok):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version)
    if ok:
        ray_cluster.check_ray_version()
        return
    with pytest.raises(PreflightError, match=f"Ray {version} is installed here") as err:
        ray_cluster.check_ray_version()
    assert "ray[client,default]>=2.52" in str(err.value) and err.value.exit_code == 3
