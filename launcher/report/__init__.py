"""Throughput tables for a run (summary) and for a scaling study (scaling).

``launcher.report`` is also the function user scripts call (``launcher.metrics.report``).
Importing this package rebinds the attribute ``launcher.report`` to the package, so the
package itself is made callable and forwards to that function: ``launcher.report(step=...)``
and ``from launcher import report; report(step=...)`` work whether or not it was imported.
"""

import sys
import types
from typing import Any

from launcher.metrics import report as _record
from launcher.report.scaling import (
    build_table,
    load_scaling,
    render_scaling,
    scale_job,
    write_scaling,
)
from launcher.report.summary import load_run, render, report_command, summarize, write_summary

__all__ = [
    "build_table", "load_run", "load_scaling", "render", "render_scaling", "report_command",
    "scale_job", "summarize", "write_scaling", "write_summary",
]


class _CallablePackage(types.ModuleType):
    def __call__(self, *, step: int, tokens: int = 0, samples: int = 0,
                 loss: float | None = None, **extra: Any) -> None:
        """Record a user script's progress (see ``launcher.metrics.report``)."""
        _record(step=step, tokens=tokens, samples=samples, loss=loss, **extra)


sys.modules[__name__].__class__ = _CallablePackage
