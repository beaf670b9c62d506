"""``launch report RUN_DIR --plot``: steps.png from the step records, stragglers marked."""

from __future__ import annotations

import json

import pytest

from launcher.errors import UsageError
from launcher.metrics import write_record
from launcher.results.runplot import plot_run


def test_a_run_plots_loss_and_tokens_per_rank(tmp_path, monkeypatch):
    (tmp_path / "metrics").mkdir()
    ranks = [
        {"rank": r, "node": "a", "host": "h", "local_rank": r, "device": "cpu"} for r in (0, 1)
    ]
    (tmp_path / "plan.json").write_text(json.dumps({"ranks": ranks}))
    for r in (0, 1):
        for s in range(1, 8):
            record = dict(type="step", rank=r, step=s, time=s * (1.0 + r), tokens=100, loss=1 / s)
            write_record(record, str(tmp_path / f"metrics/rank{r}.jsonl"))
    marked = []
    import matplotlib.axes

    plot = matplotlib.axes.Axes.plot

    def spy(self, *args, **kwargs):
        marked.append(kwargs.get("label"))
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    out = plot_run(tmp_path)
    assert out == tmp_path / "steps.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "rank 1 (straggler)" in marked and "rank 0" in marked


def test_a_run_without_step_records_is_a_usage_error(tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps({"ranks": []}))
    with pytest.raises(UsageError, match="no step records"):
        plot_run(tmp_path)
