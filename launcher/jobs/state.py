"""A detached job's state lines (``::launcher-state:: {json}`` in its driver's log) and the
status row the commands make of them.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Any

MARK = "::launcher-state:: "
STATUSES = ("PENDING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED")
ENDED = ("SUCCEEDED", "FAILED", "STOPPED")
JSON_KEYS = (
    "job_id",
    "name",
    "status",
    "world_size",
    "step",
    "tokens_per_s",
    "mfu",
    "run_dir",
    "failure",
)


def line(state: dict[str, Any]) -> str:
    return MARK + json.dumps(state, separators=(",", ":"))


def last_state(logs: str) -> dict[str, Any] | None:
    """The last state line of a driver's log, if any. Lines end at ``\n`` only: a job's output
    cannot start a line of its own with ``\r`` or U+2028 (``splitlines`` would split there)."""
    for text in reversed(logs.split("\n")):
        if text.startswith(MARK):
            try:
                return json.loads(text[len(MARK) :])
            except ValueError:
                continue
    return None


# Ray's own lines in a driver's log: its job manager's (and SDK's) log records, and the
# entrypoint it runs. The driver keeps them in the run directory's logs/ray.log.
RAY_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\s+[A-Z]+ \w+\.py:\d+ -- |^Running entrypoint for job "
)


def shown(text: str) -> bool:
    """Whether a line of a driver's log is the user's to read: no state line, no Ray line."""
    return not (text.startswith(MARK) or RAY_LINE.match(text))


def strip(logs: str) -> str:
    """The log as a user reads it: no state lines, no Ray lines (lines end at ``\n`` only)."""
    return "\n".join(t for t in logs.split("\n") if shown(t))


def status_of(ray_status: str, state: dict[str, Any] | None) -> str:
    """PENDING / RUNNING / SUCCEEDED / FAILED / STOPPED from Ray's status and the driver's state."""
    if ray_status == "RUNNING":
        running = state is not None and state.get("state") in ("running", "done")
        return "RUNNING" if running else "PENDING"
    return ray_status if ray_status in STATUSES else "FAILED"


def row(details: Any, logs: str) -> dict[str, Any]:
    """What ``launch status`` says of one job (``JobDetails`` and its driver's log)."""
    meta = details.metadata or {}
    state = last_state(logs) or {}
    status = status_of(str(details.status.value), state or None)
    failure = state.get("failure") if state.get("state") == "done" else None
    run_dir, no_run_dir = _run_dir(meta.get("run_dir"), status, state)
    if status == "FAILED" and failure is None:
        # The driver died before it could say (killed, out of memory): Ray's word for it.
        message = _first_line(details.message or "the driver exited without a summary")
        failure = {"reason": message.split(", last available logs")[0]}
    return {
        "job_id": details.submission_id,
        "name": meta.get("name"),
        "status": status,
        "world_size": _int(state.get("world_size")) or _int(meta.get("world_size")),
        "attempt": _int(state.get("attempt")) or 0,  # 0: the first; N: after N restarts
        "nodes": _int(meta.get("nodes")),
        "step": state.get("step"),
        "tokens_per_s": state.get("tokens_per_s"),
        "mfu": state.get("mfu"),
        "run_dir": run_dir,
        "no_run_dir": no_run_dir,  # why the job has none, where it has none
        "failure": failure,
        "reason": state.get("reason") if status == "PENDING" else None,
        "summary": state.get("status") if state.get("state") == "done" else None,
        "started": _seconds(details.start_time),
        "ended": _seconds(details.end_time),
    }


def render_one(r: dict[str, Any]) -> str:
    """``launch status ID``: a few lines."""
    reason = f" — {r['reason']}" if r["reason"] else ""
    lines = [f"job {r['job_id']} ({r['name']}): {r['status']}{reason}"]
    when = f"started {_clock(r['started'])}"
    if r["ended"]:
        when += f", ended {_clock(r['ended'])} ({_duration(r)})"
    elif r["started"]:
        when += f", {_duration(r)} so far"
    lines.append("  " + when)
    n = r.get("attempt")
    attempt = f", attempt {n} (after {n} restart(s))" if n else ""
    lines.append(f"  {r['nodes']} node(s), world size {r['world_size']}{attempt}")
    figures = {"step {}": r["step"], "{:,.0f} tokens/s": r["tokens_per_s"], "MFU {:.1%}": r["mfu"]}
    if r["step"] is not None or r["tokens_per_s"] is not None:
        lines.append("  " + ", ".join(f.format(v) for f, v in figures.items() if v is not None))
    if r["summary"]:
        lines.append(f"  summary: {r['summary']}")
    if r["failure"]:
        f = r["failure"]
        where = f"rank {f['rank']} on {f.get('node')}: " if f.get("rank") is not None else ""
        lines.append(f"  failure: {where}{f.get('reason')}")
    run_dir = r["run_dir"] if r["run_dir"] is not None else f"none — {r['no_run_dir']}"
    lines.append(f"  run dir: {run_dir}")
    return "\n".join(lines)


def render_table(rows: list[dict[str, Any]]) -> str:
    """``launch list``: newest first."""
    from tabulate import tabulate

    table = [
        [
            r["job_id"],
            r["name"],
            r["status"],
            f"{r['nodes']} × {_per_node(r)}",
            f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] is not None else "–",
            f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "–",
            _clock(r["started"]),
            _duration(r),
        ]
        for r in rows
    ]
    head = ["job id", "name", "status", "nodes × ranks", "tokens/s", "MFU", "started", "duration"]
    return tabulate(table, headers=head)


def to_json(r: dict[str, Any]) -> dict[str, Any]:
    return {k: r[k] for k in JSON_KEYS}


def _run_dir(
    named: str | None, status: str, state: dict[str, Any]
) -> tuple[str | None, str | None]:
    """The job's run directory (the one named at submission), or None and why it has none."""
    if "run_dir" in state and state["run_dir"] is None:
        return None, (
            f"its driver refused {named} (the failure says why); nothing of this job is "
            f"in that folder"
        )
    if not state and status in ENDED:
        return None, f"the job ended before its driver started; nothing of this job is in {named}"
    return named, None


def _per_node(r: dict[str, Any]) -> str:
    world, nodes = r["world_size"], r["nodes"]
    return str(world // nodes) if world and nodes and world % nodes == 0 else "?"


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _seconds(ms: int | None) -> float | None:
    return ms / 1000 if ms else None


def _clock(ts: float | None) -> str:
    if not ts:
        return "–"
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _duration(r: dict[str, Any]) -> str:
    if not r["started"]:
        return "–"
    end = r["ended"] or dt.datetime.now(dt.timezone.utc).timestamp()
    s = max(0, int(end - r["started"]))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _first_line(text: str) -> str:
    return next((t.strip() for t in text.splitlines() if t.strip()), text)
