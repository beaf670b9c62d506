"""``launch report RUN_DIR --plot``: loss and tokens/s per rank over steps, as ``steps.png`` in
the run directory, stragglers (named while the run went, or by their p50 step time) marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launcher.errors import UsageError
from launcher.metrics import FILE_PATTERN, rank_of, read_records
from launcher.results.summary import load_run


def plot_run(run_dir: Path) -> Path:
    """Draw ``steps.png``; UsageError where matplotlib (the plot extra) or step records are missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(
            "--plot needs matplotlib: pip install -e '.[plot]' in the launcher's folder; "
            "the tables need nothing"
        ) from None
    summary = load_run(run_dir)
    slow = {s["rank"] for s in summary.get("stragglers") or []}
    slow |= set((summary.get("totals") or {}).get("straggler_ranks") or [])
    series: dict[int, tuple[list[int], list[float | None], list[float]]] = {}
    for path in sorted((Path(run_dir) / "metrics").glob(FILE_PATTERN)):
        steps = [r for r in read_records(path) if r.get("type") == "step"]
        if (rank := rank_of(path.name)) is not None and steps:
            series[rank] = _points(steps)
    if not series:
        raise UsageError(f"{run_dir} has no step records in metrics/ to plot")
    fig, (ax_loss, ax_tok) = plt.subplots(1, 2, figsize=(12, 4.5))
    try:
        fig.suptitle(f"{summary.get('job', '')}: per rank over steps")
        for r, (xs, loss, tokens) in sorted(series.items()):
            style = {"linewidth": 2.5, "color": "red"} if r in slow else {"linewidth": 1}
            label = f"rank {r}" + (" (straggler)" if r in slow else "")
            if any(v is not None for v in loss):
                ax_loss.plot(xs, loss, label=label, **style)
            ax_tok.plot(xs, tokens, label=label, **style)
        ax_loss.set_title("loss")
        ax_tok.set_title("tokens/s")
        for ax in (ax_loss, ax_tok):
            ax.set_xlabel("step")
            ax.grid(True, alpha=0.3)
            if len(series) <= 16 or slow:
                ax.legend(loc="best", fontsize="small")
        fig.tight_layout()
        out = Path(run_dir) / "steps.png"
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out


def _points(steps: list[dict[str, Any]]) -> tuple[list[int], list[float | None], list[float]]:
    """Steps, loss and tokens/s of a rank's step records (tokens/s from ``interval_s``, else the
    time since the previous record)."""
    xs, loss, rate = [], [], []
    previous = None
    for r in steps:
        seconds = r.get("interval_s")
        if seconds is None and previous is not None:
            seconds = float(r.get("time") or 0) - float(previous.get("time") or 0)
        previous = r
        if not seconds or seconds <= 0:
            continue
        xs.append(int(r["step"]))
        loss.append(r.get("loss"))
        rate.append(float(r.get("tokens") or 0) / seconds)
    return xs, loss, rate
