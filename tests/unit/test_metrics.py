"""``launcher.report``: the plain function user scripts call to feed the launcher's tables."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from launcher import report


def test_report_appends_a_step_record(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCHER_METRICS_FILE", str(tmp_path / "rank{rank}.jsonl"))
    monkeypatch.setenv("RANK", "3")
    report(step=1, tokens=2)
    report(step=2, tokens=5, samples=1, loss=0.5)
    lines = (tmp_path / "rank3.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["type"] == "step" and first["rank"] == 3
    assert (first["step"], first["tokens"], first["samples"], first["loss"]) == (1, 2, 0, None)
    assert (second["step"], second["tokens"], second["samples"], second["loss"]) == (2, 5, 1, 0.5)
    assert second["time"] >= first["time"]


def test_report_without_the_variable_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("LAUNCHER_METRICS_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    assert report(step=1, tokens=2) is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.processes
def test_importing_results_leaves_report_alone():
    # A fresh interpreter: here launcher.results may already be imported by other tests.
    code = (
        "import launcher, launcher.metrics\n"
        "import launcher.results, launcher.results.summary, launcher.results.scaling\n"
        "from launcher import report\n"
        "import inspect\n"
        "assert inspect.isfunction(report)\n"
        "assert launcher.report is launcher.metrics.report is report, launcher.report\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
