"""The job's ``report:`` sinks (TensorBoard files, an MLflow run), fed with the records the
driver receives from a background thread, so that neither a slow disk nor a tracking server
that is down holds up the run; what waits is written at the end.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from launcher.orchestrate.rundir import RunDir, masked_spec
from launcher.results.mlflow_run import MlflowRun
from launcher.results.scalars import Point, Scalars
from launcher.results.tensorboard_files import SUBDIR, EventFiles
from launcher.spec import JobSpec
from launcher.util import first_line, mask_urls

log = logging.getLogger(__name__)

FLUSH_S = 5.0  # between writes
CLOSE_S = 30.0  # the most the end of a run waits for the last writes
BACKLOG = 500_000  # records waiting for the writer thread; more are left out, with a warning


class Sink(Protocol):
    def write(self, points: list[Point]) -> None: ...

    def close(self, status: str) -> None: ...


class ReportSinks:
    """Takes records from the watch loop (``attempt``, ``record``, ``telemetry``: appends, no
    I/O) and hands their points to the sinks every ``flush_s`` seconds."""

    def __init__(self, job: JobSpec, run_dir: RunDir, *, flush_s: float = FLUSH_S):
        self._open: list[tuple[str, Callable[[], Sink]]] = []
        report = job.report
        if report.tensorboard:
            self._open.append(("TensorBoard", lambda: EventFiles(run_dir.root / SUBDIR)))
        if (spec := report.mlflow) is not None:
            mlflow = partial(
                MlflowRun,
                spec.tracking_uri,
                experiment=spec.experiment or job.name,
                run_name=spec.run_name or run_dir.name,
                params=spec_params(job),
                tags={"launcher.job": job.name, "launcher.run_dir": str(run_dir.root)},
            )
            self._open.append(("MLflow", mlflow))
        self.flush_s = flush_s
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._taking = True  # false once no sink is left to write to
        self._left_out = 0
        self._said_left_out = False
        self._scalars = Scalars()
        self._status = "succeeded"
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="launcher-report", daemon=True)
        self._thread.start()

    def attempt(self, world_size: int) -> None:
        self._take(("attempt", world_size))

    def record(self, rank: int, record: dict[str, Any]) -> None:
        self._take(("record", rank, record))

    def telemetry(self, node: str, samples: list[dict[str, Any]]) -> None:
        self._take(("telemetry", node, samples))

    def _take(self, item: tuple[Any, ...]) -> None:
        if not self._taking:
            return
        if len(self._inbox) >= BACKLOG and item[0] != "attempt":
            self._left_out += 1
            return
        self._inbox.append(item)

    def close(self, status: str, timeout_s: float = CLOSE_S) -> None:
        """Write what waits and end the sinks (the MLflow run's status), ``timeout_s`` at most."""
        self._status = status
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "the report sinks were still writing after %.0f s; the run ends without waiting "
                "(its metrics are in metrics/ of the run directory)",
                timeout_s,
            )

    def _run(self) -> None:
        sinks = []
        for name, make in self._open:
            try:
                sinks.append((name, make()))
            except Exception as err:  # a package missing on this node, a folder not writable
                log.warning("%s: nothing is written there: %s", name, first_line(err))
        while True:
            stopping = self._stop.is_set()
            points = self._drain()
            for name, sink in list(sinks):
                try:
                    sink.write(points)
                    if stopping:
                        sink.close(self._status)
                except Exception as err:
                    log.warning("%s: writing stopped: %s: %s", name, type(err).__name__, err)
                    sinks.remove((name, sink))
            if not sinks:
                self._taking = False
                self._inbox.clear()
            if stopping or not sinks:
                return
            self._wake.wait(self.flush_s)

    def _drain(self) -> list[Point]:
        points: list[Point] = []
        if self._left_out and not self._said_left_out:
            self._said_left_out = True
            log.warning(
                "the report sinks fall behind the records (%d waiting): records are left out of "
                "them from now on while the backlog is full (metrics/ keeps every record); log "
                "less often (train.log_every) for TensorBoard and MLflow to keep up",
                BACKLOG,
            )
        while self._inbox:
            kind, *args = self._inbox.popleft()
            if kind == "attempt":
                self._scalars.attempt(args[0])
            elif kind == "record":
                points += self._scalars.record(args[0], args[1])
            else:
                for sample in args[1]:
                    points += self._scalars.telemetry(args[0], sample)
        return points


def spec_params(job: JobSpec) -> dict[str, str]:
    """The resolved job spec as flat parameters (``train.steps``: ``30``), secrets masked."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            out[prefix] = mask_urls(text)

    walk("", masked_spec(job))
    return out
