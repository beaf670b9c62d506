"""Scaling studies: adjust a job per point, aggregate repeats, write the table and plot.

speedup(N) = T(N) / T(N0); efficiency(N) = (T(N) / N) / (T(N0) / N0), T the median tokens/s.
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path
from typing import Any

from launcher.errors import SpecError, UsageError
from launcher.results.summary import DASH, Column, csv_text, read_json, text_table
from launcher.spec.job import JobSpec
from launcher.util import write_atomic

log = logging.getLogger(__name__)

MODES = ("weak", "strong")
CSV_KEYS = (  # scaling.csv: a point's keys in scaling.json but repeats, run_dirs, noisy
    "nodes",
    "ranks",
    "global_batch",
    "tokens_per_s",
    "tokens_per_s_min",
    "tokens_per_s_per_rank",
    "speedup",
    "efficiency",
    "failed_repeats",
)
SPREAD_LIMIT = 2.0  # a rank's p95 step time above this many times its p50: a noisy measurement
DISAGREE_LIMIT = 0.10  # repeats whose range exceeds this share of their median disagree


def scale_job(job: JobSpec, world: int, base_world: int, mode: str) -> JobSpec:
    """The job for one point of a study at ``world`` ranks (the base point at ``base_world``):
    weak keeps the job; strong keeps the global batch, changing micro_batch, else grad_accum,
    never growing the micro-batch."""
    if mode not in MODES:
        raise UsageError(f"--mode {mode!r}: choose weak or strong")
    if world < 1 or base_world < 1:
        raise UsageError(f"world sizes must be >= 1 (got world {world}, base {base_world})")
    if mode == "weak":
        return job
    mb, ga = job.train.micro_batch, job.train.grad_accum
    global_batch = mb * ga * base_world
    if global_batch % world:
        divisors = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
        shown = ", ".join(str(n) for n in divisors[:12]) + (", ..." if len(divisors) > 12 else "")
        raise SpecError(
            f"strong scaling keeps the base point's global batch (train.micro_batch {mb} x "
            f"train.grad_accum {ga} x {base_world} ranks = {global_batch} samples), which does not "
            f"split over {world} ranks; use world sizes that divide {global_batch} ({shown}) or "
            f"change train.micro_batch / train.grad_accum",
            field="train.micro_batch",
        )
    share = global_batch // world
    if share % ga == 0:
        new_mb, new_ga = share // ga, ga
    else:  # the largest micro-batch up to the current one that divides the share
        new_mb = max(d for d in range(1, min(mb, share) + 1) if share % d == 0)
        new_ga = share // new_mb
    train = job.train.model_copy(update={"micro_batch": new_mb, "grad_accum": new_ga})
    return job.model_copy(update={"train": train})


def build_table(points: list[dict], *, job: str, mode: str) -> dict:
    """The study table (the ``scaling.json`` dict) from measured points, each with its
    ``repeats`` (summaries or tokens/s); a repeat without tokens/s counts as failed."""
    if mode not in MODES:
        raise UsageError(f"--mode {mode!r}: choose weak or strong")
    rows: list[dict[str, Any]] = []
    for point in sorted(points, key=lambda p: (int(p["ranks"]), int(p["nodes"]))):
        values = [_tokens_per_s(r) for r in point.get("repeats", [])]
        measured = [v for v in values if v is not None]
        ranks = int(point["ranks"])
        median = statistics.median(measured) if measured else None
        rows.append(
            {
                "nodes": int(point["nodes"]),
                "ranks": ranks,
                "global_batch": point.get("global_batch"),
                "tokens_per_s": median,
                "tokens_per_s_min": min(measured) if measured else None,
                "tokens_per_s_per_rank": median / ranks if median is not None else None,
                "speedup": None,
                "efficiency": None,
                "repeats": measured,
                "failed_repeats": len(values) - len(measured),
                "run_dirs": [str(d) for d in point.get("run_dirs", [])],
                "noisy": noise(point.get("repeats", []), measured),
            }
        )
    base = next((r for r in rows if r["tokens_per_s"]), None)
    for row in rows:
        if base is not None and row["tokens_per_s"] is not None:
            row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
            row["efficiency"] = row["tokens_per_s_per_rank"] / base["tokens_per_s_per_rank"]
    return {
        "job": job,
        "mode": mode,
        "base_ranks": base["ranks"] if base is not None else None,
        "points": rows,
    }


def noise(repeats: list[Any], measured: list[float]) -> str | None:
    """Why a point's measurement is noise, or None: a rank's step times spread (p95 far above
    p50), or repeats that disagree."""
    why = []
    spreads = [
        r["step_time_ms_p95"] / r["step_time_ms_p50"]
        for rep in repeats
        if isinstance(rep, dict)
        for r in rep.get("ranks") or []
        if r.get("step_time_ms_p50") and r.get("step_time_ms_p95")
    ]
    if spreads and max(spreads) > SPREAD_LIMIT:
        why.append(f"p95 step time {max(spreads):.1f}x p50")
    if len(measured) > 1:
        spread = (max(measured) - min(measured)) / statistics.median(measured)
        if spread > DISAGREE_LIMIT:
            why.append(f"repeats differ by {100 * spread:.0f}%")
    return "; ".join(why) or None


def render_scaling(table: dict) -> str:
    """The study as a text table, with the definitions under it."""

    def efficiency(p: dict) -> str:
        pct = DASH if p["efficiency"] is None else f"{100 * p['efficiency']:.1f}"
        return pct + (" *" if p.get("noisy") else "")

    def repeats(p: dict) -> str:
        runs = len(p["repeats"]) + p["failed_repeats"]
        return f"{len(p['repeats'])}/{runs}" if p["failed_repeats"] else str(runs)

    columns: list[Column] = [
        ("nodes", lambda p: p["nodes"]),
        ("ranks", lambda p: p["ranks"]),
        ("global batch", lambda p: DASH if p["global_batch"] is None else p["global_batch"]),
        ("tokens/s (median)", lambda p: _num(p["tokens_per_s"])),
        ("tokens/s (min)", lambda p: _num(p["tokens_per_s_min"])),
        ("tokens/s per rank", lambda p: _num(p["tokens_per_s_per_rank"])),
        ("speedup", lambda p: DASH if p["speedup"] is None else f"{p['speedup']:.2f}x"),
        ("efficiency %", efficiency),
        ("repeats", repeats),
    ]
    text = text_table(columns, table["points"], ("right",) * len(columns))
    base = table.get("base_ranks")
    definition = (
        "speedup / (N/N0), the global batch kept"
        if table["mode"] == "strong"
        else "per-rank tokens/s at N over that at N0, the per-rank batch kept"
    )
    note = (
        f"Speedup and efficiency are relative to N0 = {base} rank{'s' if base != 1 else ''}; "
        f"efficiency = {definition}."
    )
    if base is None:
        note = "No point measured a throughput; nothing to compare."
    if noisy := [p for p in table["points"] if p.get("noisy")]:
        note += "\n* noise, not scaling: " + "; ".join(
            f"{p['ranks']} rank(s): {p['noisy']}" for p in noisy
        )
        note += ". Repeat on a quiet machine with --repeat 3 or more."
    return f"{table['job']}: {table['mode']} scaling\n\n{text}\n\n{note}\n"


def write_scaling(out_dir: Path, table: dict) -> str:
    """Write ``scaling.json``, ``scaling.csv`` and ``scaling.png`` (when matplotlib is
    installed); return the text table."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "scaling.json", json.dumps(table, indent=2) + "\n")
    (out_dir / "scaling.csv").write_text(to_csv(table))
    draw_plot(out_dir, table)
    return render_scaling(table)


PLOT_HINT = (
    "matplotlib is not installed: no scaling.png. Install the plot extra (pip install -e "
    "'.[plot]' in the launcher's folder), then 'launch report %s' draws it."
)


def draw_plot(study_dir: Path, table: dict) -> Path | None:
    """Draw ``scaling.png`` into the study folder; without matplotlib, say how to get it."""
    try:
        return plot_scaling(table, Path(study_dir) / "scaling.png")
    except ImportError:
        log.warning(PLOT_HINT, study_dir)
        return None


def load_scaling(study_dir: Path) -> dict:
    """A study's table from its ``scaling.json``."""
    path = Path(study_dir) / "scaling.json"
    data = read_json(path, "study")
    if data is None:
        raise UsageError(f"{study_dir}: no scaling.json; give a directory made by 'launch scale'")
    if not isinstance(data.get("points"), list):
        raise UsageError(f"{path}: not a scaling table (expected an object with 'points')")
    return data


def to_csv(table: dict) -> str:
    """One row per point."""
    return csv_text(table["points"], CSV_KEYS)


def plot_scaling(table: dict, path: Path) -> Path:
    """Two panels against ranks: tokens/s with the ideal line, and efficiency with 100%."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in table["points"] if p["tokens_per_s"] is not None]
    # efficiency needs a base with throughput (a script that reports no tokens has none)
    rated = [p for p in points if p["efficiency"] is not None]
    base_ranks = table.get("base_ranks")
    base = next((p for p in points if p["ranks"] == base_ranks), None)
    fig, (ax_tp, ax_eff) = plt.subplots(1, 2, figsize=(11, 4.5))
    try:
        fig.suptitle(f"{table['job']}: {table['mode']} scaling")
        ranks = [p["ranks"] for p in points]
        if base is not None:
            ideal = [base["tokens_per_s"] * n / base["ranks"] for n in ranks]
            ax_tp.plot(ranks, ideal, "--", color="grey", label="ideal (linear)")
        if points:
            ax_tp.plot(ranks, [p["tokens_per_s"] for p in points], "o-", label="measured (median)")
        if rated:
            ax_eff.axhline(100.0, linestyle="--", color="grey", label="ideal (100%)")
            ax_eff.plot(*_efficiency(rated), "o-", color="tab:orange", label="measured")
        if noisy := [p for p in rated if p.get("noisy")]:
            label = "noisy: repeat (--repeat)"
            ax_eff.plot(*_efficiency(noisy), "x", color="red", markersize=12, label=label)
        for ax in (ax_tp, ax_eff):
            ax.set_xlabel("ranks (world size)")
            if ranks:
                ax.set_xticks(ranks)
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:  # an empty panel has nothing to name
                ax.legend(loc="best")
        ax_tp.set_ylabel("tokens/s (all ranks)")
        ax_tp.set_title("throughput")
        ax_eff.set_ylabel("scaling efficiency (%)")
        ax_eff.set_title(
            f"efficiency relative to {base_ranks} rank{'s' if base_ranks != 1 else ''}"
            if base_ranks
            else "efficiency"
        )
        top = max([110.0] + [105.0 * p["efficiency"] for p in rated])
        ax_eff.set_ylim(0, top)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return Path(path)


def _efficiency(points: list[dict]) -> tuple[list[int], list[float]]:
    """The plot's x and y of points with an efficiency: ranks, and efficiency in %."""
    return [p["ranks"] for p in points], [100 * p["efficiency"] for p in points]


def _tokens_per_s(repeat: Any) -> float | None:
    """tokens/s of one repeat: a number, or a summary dict's totals."""
    if isinstance(repeat, dict):
        value = (repeat.get("totals") or {}).get("tokens_per_s")
        return None if value is None else float(value)
    return None if repeat is None else float(repeat)


def _num(value: float | None) -> str:
    return DASH if value is None else f"{value:,.0f}"
