"""Throughput tables for a run (summary) and for a scaling study (scaling).

Not to be confused with ``launcher.report``, the function user scripts call to record their
progress (``launcher.metrics.report``): this package reads those records back.
"""

from launcher.results.scaling import (
    build_table,
    load_scaling,
    render_scaling,
    scale_job,
    write_scaling,
)
from launcher.results.summary import load_run, render, report_command, summarize, write_summary

__all__ = [
    "build_table",
    "load_run",
    "load_scaling",
    "render",
    "render_scaling",
    "report_command",
    "scale_job",
    "summarize",
    "write_scaling",
    "write_summary",
]
