"""Per-rank, per-node and job throughput tables from every rank's metrics records.

The keys of ``summary.json`` (``RANK_KEYS``, ``TOTAL_KEYS``, ``FAILURE_KEYS``) are a contract
other tools read: keep their names and meaning.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

from launcher.errors import UsageError
from launcher.metrics import read_records
from launcher.results.rankstats import RankStats
from launcher.util import percentile, write_atomic

log = logging.getLogger(__name__)

STATUSES = ("succeeded", "failed", "interrupted")
STRAGGLER_THRESHOLD = 0.05  # a rank whose p50 step time exceeds the median by more than 5%

RANK_KEYS = (
    "rank",
    "node",
    "host",
    "local_rank",
    "device",
    "steps",
    "step_time_ms_p50",
    "step_time_ms_p95",
    "samples_per_s",
    "tokens_per_s",
    "tflops",
    "mfu",
    "peak_mem_gib",
    "data_wait_pct",
    "sm_clock_mhz",
    "clock_limited_pct",
    "power_w",
    "energy_mj_per_token",
)
TOTAL_KEYS = ("tokens_per_s", "samples_per_s", "tokens_per_s_per_gpu", "mfu", "straggler_ranks")
FAILURE_KEYS = ("rank", "node", "host", "exit_code", "signal", "log_tail", "reason")
TRAINING_KEYS = ("step", "loss", "grad_norm", "eval_loss", "eval_step", "skipped_steps")
DASH = "–"


def summarize(
    job: str,
    ranks: list[dict],
    records: Mapping[int, Iterable[dict] | RankStats],
    *,
    status: str,
    failure: dict | None = None,
) -> dict:
    """The ``summary.json`` dict from the plan's rank layout and each rank's records (a list,
    or folded in a ``RankStats``)."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
    folded = {
        rank: recs if isinstance(recs, RankStats) else RankStats(recs)
        for rank, recs in records.items()
    }
    rows = [
        _rank_row(layout, folded.get(int(layout["rank"])) or RankStats())
        for layout in sorted(ranks, key=lambda r: int(r["rank"]))
    ]
    nodes = list(dict.fromkeys(r["node"] for r in rows))
    return {
        "job": job,
        "status": status,
        "world_size": len(rows),
        "nodes": len(nodes),
        "ranks": rows,
        "totals": _totals(rows),
        "training": _training(folded),
        "failure": None if failure is None else {k: failure.get(k) for k in FAILURE_KEYS},
        "checkpoints": checkpoint_summary(folded),
    }


def checkpoint_summary(records: Mapping[int, RankStats]) -> dict | None:
    """What checkpoints cost the run: how many completed, the last one's step, how long
    training was held (the slowest rank's) and by what; None without any."""
    held: dict[int, float] = {}
    parts: dict[int, dict[str, float]] = {}
    complete: set[int] = set()
    modes: set[bool] = set()
    saves: list[float] = []
    for stats in records.values():
        for step, blocking_s in stats.held.items():
            if step not in held or blocking_s > held[step]:
                held[step] = blocking_s
                parts[step] = stats.parts.get(step, {})
        complete |= stats.complete
        modes |= stats.modes
        saves += stats.save_s.values()
    if not held:
        return None
    times = list(held.values())
    per_part: dict[str, list[float]] = {}
    for step in sorted(parts):
        for part, seconds in parts[step].items():
            per_part.setdefault(part, []).append(seconds)
    return {
        "async": modes == {True},
        "saved": len(complete),
        "last_complete_step": max(complete, default=None),
        "blocking_s_mean": round(statistics.fmean(times), 4),
        "blocking_s_max": round(max(times), 4),
        "blocking_s_total": round(sum(times), 3),
        "first_blocking_s": round(held[min(held)], 4),
        "blocking_parts_s_mean": {
            part: round(statistics.fmean(values), 4) for part, values in per_part.items()
        },
        "save_s_mean": round(statistics.fmean(saves), 3) if saves else None,
        "save_s_max": round(max(saves), 3) if saves else None,
    }


def render(summary: dict) -> str:
    """The text report: status line, per-rank, per-node and job tables, stragglers; for a run
    that stopped before any worker was planned, what stopped it."""
    if not summary["ranks"]:
        return before_training(summary) + "\n"
    parts = [_status_lines(summary), ""]
    parts += ["Per rank", _rank_table(summary["ranks"]), ""]
    parts += ["Per node", _node_table(summary["ranks"]), ""]
    parts += ["Job", _totals_table(summary), ""]
    parts.append(_straggler_line(summary))
    if ckpt := summary.get("checkpoints"):
        parts += _checkpoint_lines(ckpt)
    for found in summary.get("stragglers") or []:  # named while the run went
        parts.append(
            f"Straggler while running: rank {found['rank']} on node {found['node']}, "
            f"{found['slower_pct']:.0f}% slower than the other ranks' median ({found['from']})"
            + "".join(f"; {d}" for d in found.get("details") or [])
        )
    return "\n".join(parts) + "\n"


def before_training(summary: dict, *, reason: bool = True) -> str:
    """A run that stopped before any worker was planned (a failed preflight, Ctrl-C): no
    tables, what stopped it."""
    text = f"job {summary['job']}: {summary['status'].upper()} before any worker started"
    failure = summary.get("failure") or {}
    if reason and failure.get("reason"):
        text += f"\nReason: {failure['reason']}"
    return text


def write_summary(run_dir: Path, summary: dict) -> str:
    """Write ``summary.json``, ``summary.csv`` and ``summary.txt``; return the text."""
    run_dir.mkdir(parents=True, exist_ok=True)
    text = render(summary)
    write_atomic(run_dir / "summary.json", _json_text(summary))
    (run_dir / "summary.csv").write_text(to_csv(summary))
    (run_dir / "summary.txt").write_text(text)
    return text


def load_run(run_dir: Path) -> dict:
    """Rebuild a run's summary from ``plan.json`` and ``metrics/``, keeping what only the
    launcher knew (status, failure, restarts) from ``summary.json``. Without one, the run
    succeeded only if every rank wrote its ``final`` record. A run that restarted, or one
    with nothing to rebuild from, gets its ``summary.json`` as it is."""
    if not run_dir.is_dir():
        what = "not a directory" if run_dir.exists() else "no such directory"
        raise UsageError(f"{run_dir}: {what}; give a run directory (runs/<job>-<time>/)")
    plan = read_json(run_dir / "plan.json")
    previous = read_json(run_dir / "summary.json")
    source = plan if plan is not None else previous
    if source is None:
        raise UsageError(
            f"{run_dir} is not a run directory: it has neither plan.json nor summary.json; "
            f"give a directory made by 'launch' (runs/<job>-<time>/)"
        )
    if previous is not None and (
        plan is None
        and not (run_dir / "metrics").is_dir()  # nothing to rebuild from
        or previous.get("restarts")
        or previous.get("attempts")
    ):
        return previous
    layout = source.get("ranks", [])
    records = {
        rank: read_records(path)
        if (path := run_dir / "metrics" / f"rank{rank}.jsonl").is_file()
        else []
        for rank in (int(r["rank"]) for r in layout)
    }
    if previous is not None and previous.get("status") in STATUSES:
        status, failure = previous["status"], previous.get("failure")
    else:
        done = all(any(r.get("type") == "final" for r in recs) for recs in records.values())
        status, failure = ("succeeded" if layout and done else "interrupted"), None
    rebuilt = summarize(
        str(source.get("job", run_dir.name)), layout, records, status=status, failure=failure
    )
    # What only the launcher that watched the run knew (restarts, launcher_timings_s) is kept.
    return {**rebuilt, **{k: v for k, v in (previous or {}).items() if k not in rebuilt}}


def report_command(path: str, *, fmt: str = "table") -> int:
    """``launch report RUN_DIR [--format table|json|csv]``: print a finished run or study."""
    from launcher.results import scaling

    if fmt not in ("table", "json", "csv"):
        raise UsageError(f"--format {fmt!r}: choose table, json or csv")
    run_dir = Path(path)
    if not run_dir.is_dir():
        what = "not a directory" if run_dir.exists() else "no such directory"
        raise UsageError(
            f"{path}: {what}; give a run directory (runs/<job>-<time>/) "
            f"or a scaling study directory"
        )
    if (run_dir / "scaling.json").is_file():
        data = scaling.load_scaling(run_dir)
        if not (run_dir / "scaling.png").is_file():
            scaling.draw_plot(run_dir, data)  # a study run before the plot extra was installed
        show = {"table": scaling.render_scaling, "json": _json_text, "csv": scaling.to_csv}
    else:
        data = load_run(run_dir)
        show = {"table": render, "json": _json_text, "csv": to_csv}
    print(show[fmt](data), end="")
    return 0


def to_csv(summary: dict) -> str:
    """One row per rank with the ``summary.json`` rank keys as columns (mfu as a fraction)."""
    return csv_text(summary["ranks"], RANK_KEYS)


def grid(body: list[list[Any]], headers: Sequence[str], colalign: Sequence[str]) -> str:
    """A text table of ``body`` with the values as given (no number re-formatting)."""
    return tabulate(
        body, headers=headers, tablefmt="simple", disable_numparse=True, colalign=colalign
    )


Column = tuple[str, Callable[[Any], Any]]


def text_table(columns: Sequence[Column], items: Iterable[Any], colalign: Sequence[str]) -> str:
    """A text table with a line per item: each column's header, and its cell of an item."""
    body = [[cell(item) for _, cell in columns] for item in items]
    return grid(body, [header for header, _ in columns], colalign)


def csv_text(rows: Iterable[dict], keys: Sequence[str]) -> str:
    """CSV with ``keys`` as columns, one line per row; missing and null values are empty."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(keys), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else row.get(k) for k in keys})
    return buf.getvalue()


def stragglers(rows: Sequence[dict], threshold: float = STRAGGLER_THRESHOLD) -> list[int]:
    """Ranks whose p50 step time exceeds the median of all ranks' p50 by more than threshold."""
    median = median_p50(rows)
    if median is None:
        return []
    return [
        int(r["rank"])
        for r in rows
        if r.get("step_time_ms_p50") is not None
        and r["step_time_ms_p50"] > median * (1 + threshold)
    ]


def median_p50(rows: Sequence[dict]) -> float | None:
    """The median of the ranks' p50 step times; None with fewer than two measured."""
    known = [r["step_time_ms_p50"] for r in rows if r.get("step_time_ms_p50") is not None]
    return statistics.median(known) if len(known) >= 2 else None


# -- one rank -------------------------------------------------------------------------------


def _rank_row(layout: dict, stats: RankStats) -> dict:
    row: dict[str, Any] = dict.fromkeys(RANK_KEYS)
    meta = stats.meta or {}
    row.update(
        rank=int(layout["rank"]),
        node=layout.get("node"),
        host=layout.get("host") or meta.get("host"),
        local_rank=layout.get("local_rank", meta.get("local_rank")),
        device=meta.get("device") or layout.get("device"),
    )
    if stats.final is not None:  # the rank's own figures, every key after the layout's
        row.update({k: stats.final.get(k) for k in RANK_KEYS[5:]})
    else:
        row.update(_from_steps(stats, meta))
    return row


def _from_steps(stats: RankStats, meta: dict) -> dict:
    """Statistics from ``step`` records: measured intervals only, intervals from ``time`` gaps
    where ``interval_s`` is absent (the first such record only starts the clock)."""
    if not stats.steps:
        return {}
    out: dict[str, Any] = {"steps": stats.max_step, "peak_mem_gib": stats.peak_mem}
    if not stats.intervals:
        return out
    out["tokens_per_s"] = stats.tokens / stats.seconds
    out["samples_per_s"] = stats.samples / stats.seconds
    out.update(stats.gpu())  # from NVML; null without it

    step_ms = stats.step_ms.values if stats.step_ms.seen else stats.span_ms.values
    out["step_time_ms_p50"] = percentile(step_ms, 50)
    out["step_time_ms_p95"] = percentile(step_ms, 95)

    if stats.wait_s is not None:
        out["data_wait_pct"] = 100.0 * stats.wait_s / stats.wait_span_s

    if flops_per_token := meta.get("flops_per_token"):
        out["tflops"] = out["tokens_per_s"] * float(flops_per_token) / 1e12
        if peak := meta.get("peak_tflops"):
            out["mfu"] = out["tflops"] / float(peak)
    return out


# -- totals and failure ---------------------------------------------------------------------


def _totals(rows: list[dict]) -> dict:
    return {
        "tokens_per_s": _agg(sum, rows, "tokens_per_s"),
        "samples_per_s": _agg(sum, rows, "samples_per_s"),
        # Per measured rank: a rank that died before measuring would otherwise dilute it.
        "tokens_per_s_per_gpu": _agg(statistics.fmean, rows, "tokens_per_s"),
        "mfu": _agg(statistics.fmean, rows, "mfu"),
        "straggler_ranks": stragglers(rows),
    }


def _training(records: Mapping[int, RankStats]) -> dict | None:
    """How training went, from the step records of the lowest rank that wrote any (the loss
    and eval loss are means over the ranks, the gradient norm global): the last step logged,
    its loss and gradient norm, the last evaluation and the steps skipped as non-finite."""
    stats = next((records[rank] for rank in sorted(records) if records[rank].steps), None)
    if stats is None:
        return None
    last = stats.last_step_rec or {}
    return {
        "step": last.get("step"),
        "loss": stats.loss,
        "grad_norm": last.get("grad_norm"),
        "eval_loss": stats.eval[0] if stats.eval else None,
        "eval_step": stats.eval[1] if stats.eval else None,
        "skipped_steps": stats.skipped,
    }


# -- text -----------------------------------------------------------------------------------


def _status_lines(summary: dict) -> str:
    nodes = summary["nodes"]
    head = (
        f"job {summary['job']}: {summary['status'].upper()} — {summary['world_size']} "
        f"rank{'s' if summary['world_size'] != 1 else ''} on {nodes} node{'s' if nodes != 1 else ''}"
    )
    lines = [head]
    training = summary.get("training")
    if training and training.get("step") is not None:
        done = [f"Training: step {training['step']}"]
        if training.get("loss") is not None:
            done.append(f"loss {training['loss']:.4g}")
        if training.get("grad_norm") is not None:
            done.append(f"grad norm {training['grad_norm']:.3g}")
        if training.get("eval_loss") is not None:
            done.append(f"eval loss {training['eval_loss']:.4g} (step {training['eval_step']})")
        if training.get("skipped_steps"):
            done.append(f"{training['skipped_steps']} non-finite step(s) skipped")
        lines.append(", ".join(done))
    if summary["status"] != "succeeded":
        lines.append(
            "Partial results: the tables show what was measured before the run stopped; "
            f"'{DASH}' marks what no record reported."
        )
    if failure := summary.get("failure"):
        how = []
        if failure.get("exit_code") is not None:
            how.append(f"exit code {failure['exit_code']}")
        if failure.get("signal"):
            how.append(f"signal {failure['signal']}")
        where = f"rank {failure.get('rank', '?')} on node {failure.get('node', '?')} ({failure.get('host', '?')})"
        lines.append(f"First failure: {where}" + (f", {', '.join(how)}" if how else ""))
        if failure.get("reason"):
            lines.append(f"Reason: {failure['reason']}")
        if tail := failure.get("log_tail"):
            lines.append("Last lines of its log:")
            lines += ["  | " + line for line in str(tail).rstrip("\n").splitlines()[-20:]]
    for r in summary.get("restarts") or []:
        step = r.get("resumed_from_step")
        resumed = "" if step is None else f", resumed from step {step}"
        lost = "" if r.get("lost_steps") is None else f" ({r['lost_steps']} step(s) redone)"
        lines.append(
            f"Restart {r['attempt']}: {r['reason']}; went on with {len(r['nodes'])} node(s) "
            f"({', '.join(r['nodes'])}), world size {r['world_size']}{resumed}{lost}"
        )
    return "\n".join(lines)


def _fmt(value: Any, digits: int = 1, *, pct: bool = False, thousands: bool = False) -> str:
    if value is None:
        return DASH
    if isinstance(value, str):
        return value
    if pct:
        value = value * 100.0
    if thousands:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def _rank_table(rows: list[dict]) -> str:
    """One line per rank; where any rank read its GPU's clock, the SM clock and the share of
    time something (power, heat) held it down, the first thing to see of a slow GPU."""
    columns: list[tuple[str, Callable[[dict], Any]]] = [
        ("rank", lambda r: r["rank"]),
        ("node", lambda r: r["node"] or DASH),
        ("host", lambda r: r["host"] or DASH),
        ("device", lambda r: r["device"] or DASH),
        ("steps", lambda r: DASH if r["steps"] is None else r["steps"]),
        ("step ms p50", lambda r: _fmt(r["step_time_ms_p50"])),
        ("step ms p95", lambda r: _fmt(r["step_time_ms_p95"])),
        ("samples/s", lambda r: _fmt(r["samples_per_s"])),
        ("tokens/s", lambda r: _fmt(r["tokens_per_s"], thousands=True)),
        ("TFLOP/s", lambda r: _fmt(r["tflops"], 2)),
        ("MFU %", lambda r: _fmt(r["mfu"], pct=True)),
        ("peak mem GiB", lambda r: _fmt(r["peak_mem_gib"], 2)),
        ("data wait %", lambda r: _fmt(r["data_wait_pct"])),
    ]
    if any(r.get("sm_clock_mhz") is not None for r in rows):
        columns.append(("SM MHz", lambda r: _fmt(r.get("sm_clock_mhz"), 0)))
        columns.append(("clock limited %", lambda r: _fmt(r.get("clock_limited_pct"), 0)))
    return text_table(
        columns, rows, ("right", "left", "left", "left") + ("right",) * (len(columns) - 4)
    )


def _node_table(rows: list[dict]) -> str:
    """Per node: throughputs and TFLOP/s summed, step times and MFU averaged, memory max."""

    def ranks(mine: list[dict]) -> str:
        measured = sum(r.get("tokens_per_s") is not None for r in mine)
        return str(len(mine)) if measured == len(mine) else f"{measured}/{len(mine)}"

    columns: list[Column] = [
        ("node", lambda m: m[0]["node"] or DASH),
        ("host", lambda m: m[0]["host"] or DASH),
        ("ranks", ranks),
        ("mean step ms p50", lambda m: _fmt(_agg(statistics.fmean, m, "step_time_ms_p50"))),
        ("samples/s", lambda m: _fmt(_agg(sum, m, "samples_per_s"))),
        ("tokens/s", lambda m: _fmt(_agg(sum, m, "tokens_per_s"), thousands=True)),
        ("TFLOP/s", lambda m: _fmt(_agg(sum, m, "tflops"), 2)),
        ("mean MFU %", lambda m: _fmt(_agg(statistics.fmean, m, "mfu"), pct=True)),
        ("max peak mem GiB", lambda m: _fmt(_agg(max, m, "peak_mem_gib"), 2)),
        ("mean data wait %", lambda m: _fmt(_agg(statistics.fmean, m, "data_wait_pct"))),
    ]
    nodes = [[r for r in rows if r["node"] == n] for n in dict.fromkeys(r["node"] for r in rows)]
    return text_table(columns, nodes, ("left", "left") + ("right",) * 8)


def _totals_table(summary: dict) -> str:
    t = summary["totals"]
    measured = sum(r.get("tokens_per_s") is not None for r in summary["ranks"])
    body = [
        ["status", summary["status"]],
        ["ranks measured", f"{measured} of {summary['world_size']}"],
        ["tokens/s (all ranks)", _fmt(t["tokens_per_s"], thousands=True)],
        ["samples/s (all ranks)", _fmt(t["samples_per_s"])],
        [f"tokens/s per {_worker(summary)}", _fmt(t["tokens_per_s_per_gpu"], thousands=True)],
        ["MFU % (mean of ranks)", _fmt(t["mfu"], pct=True)],
    ]
    return grid(body, (), ("left", "right"))


def _worker(summary: dict) -> str:
    """GPU where the ranks ran on GPUs; rank for a CPU job (or one whose devices are unknown)."""
    devices = {r.get("device") for r in summary["ranks"]}
    return "GPU" if devices and all(d and d.startswith("cuda") for d in devices) else "rank"


def _straggler_line(summary: dict) -> str:
    rows = summary["ranks"]
    median = median_p50(rows)
    if median is None:
        return "Stragglers: not assessed (fewer than two ranks measured step times)."
    slow = [r for r in rows if r["rank"] in set(summary["totals"]["straggler_ranks"])]
    if not slow:
        return (
            f"Stragglers: none (every rank's p50 step time is within "
            f"{STRAGGLER_THRESHOLD:.0%} of the median {median:.1f} ms)."
        )
    clocks = [r["sm_clock_mhz"] for r in rows if r.get("sm_clock_mhz") is not None]

    def clock(r: dict) -> str:  # a GPU held below the others' clock explains a slow rank
        if r.get("sm_clock_mhz") is None or len(clocks) < 2:
            return ""
        limited = r.get("clock_limited_pct")
        return (
            f", SM clock {r['sm_clock_mhz']:.0f} MHz against a median {statistics.median(clocks):.0f}"
            + (f", limited {limited:.0f}% of the time" if limited else "")
        )

    named = ", ".join(
        f"rank {r['rank']} on {r['node']} ({r['step_time_ms_p50']:.1f} ms, "
        f"+{100 * (r['step_time_ms_p50'] / median - 1):.1f}%{clock(r)})"
        for r in slow
    )
    return (
        f"Stragglers (p50 step time > median {median:.1f} ms + {STRAGGLER_THRESHOLD:.0%}): {named}."
    )


def _agg(fn: Callable[[list[float]], float], rows: Iterable[dict], key: str) -> float | None:
    """``fn`` of the rows' known values of ``key``; None where no row has one."""
    known = [r[key] for r in rows if r.get(key) is not None]
    return fn(known) if known else None


def read_json(path: Path, what: str = "run") -> dict | None:
    """A run (or study) directory's JSON object; None where the file is missing, UsageError
    where damaged."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UsageError(
            f"{path}: not valid JSON (line {err.lineno}); the {what} directory is damaged"
        ) from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a JSON object; the {what} directory is damaged")
    return data


def _json_text(data: dict) -> str:
    return json.dumps(data, indent=2) + "\n"


def _checkpoint_lines(ckpt: dict) -> list[str]:
    """How long checkpoints held training; where the hold went (the parts over 5 ms, in the
    order they come), what the first one held, and how long a background save took."""
    mode = "in the background" if ckpt["async"] else "synchronously"
    held = (
        f"Checkpoints: {ckpt['saved']} complete (last at step {ckpt['last_complete_step']}), "
        f"written {mode}; training held {ckpt['blocking_s_mean']:.2f} s each "
        f"(max {ckpt['blocking_s_max']:.2f} s)"
    )
    shown = [
        f"{part} {seconds:.2f} s"
        for part, seconds in (ckpt.get("blocking_parts_s_mean") or {}).items()
        if seconds >= 0.005
    ]
    if not shown:
        return [held]
    line = f"  held by part (mean): {', '.join(shown)}"
    if ckpt.get("first_blocking_s") is not None:
        line += f"; the first held {ckpt['first_blocking_s']:.2f} s"
    if ckpt.get("save_s_mean") is not None:
        line += f"; a background save completed in {ckpt['save_s_mean']:.2f} s (mean)"
    return [held, line]
