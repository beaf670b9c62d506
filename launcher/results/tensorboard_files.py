"""TensorBoard event files of a run, one folder (a TensorBoard run) per series, written with the
``tensorboard`` package's protobufs (docs/diagnosis.md, "TensorBoard")."""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path

from launcher.results.scalars import RESTART, Point

SUBDIR = "tensorboard"


class EventFiles:
    """Appends points to the event file of their series under ``root``."""

    def __init__(self, root: Path):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self.root = root
        self._event, self._session = event_pb2.Event, event_pb2.SessionLog
        self._summary, self._records = summary_pb2.Summary, RecordWriter
        self._files: dict[str, Path] = {}
        self._suffix = f"{socket.gethostname()}.{os.getpid()}"

    def write(self, points: Iterable[Point]) -> None:
        """One event per series, step and time, holding that record's values."""
        by_series: dict[str, dict[tuple[int, float], list[Point]]] = {}
        for p in points:
            by_series.setdefault(p.series, {}).setdefault((p.step, p.time), []).append(p)
        for series, events in by_series.items():
            with open(self._file(series), "ab") as fh:
                out = self._records(fh)
                for (step, when), group in events.items():
                    if any(p.key == RESTART for p in group):  # TensorBoard drops steps >= step
                        start = self._session(status=self._session.START)
                        restart = self._event(wall_time=when, step=step, session_log=start)
                        out.write(restart.SerializeToString())
                    values = [
                        self._summary.Value(tag=p.key, simple_value=p.value)
                        for p in group
                        if p.key != RESTART
                    ]
                    if values:
                        event = self._event(
                            wall_time=when, step=step, summary=self._summary(value=values)
                        )
                        out.write(event.SerializeToString())

    def close(self, status: str) -> None:
        """Nothing stays open between writes."""

    def _file(self, series: str) -> Path:
        if series in self._files:
            return self._files[series]
        folder = self.root.joinpath(*series.split("/"))
        folder.mkdir(parents=True, exist_ok=True)
        stamp = int(time.time())
        path = next(
            p
            for n in itertools.count()
            if not (p := folder / f"events.out.tfevents.{stamp}.{self._suffix}.{n}").exists()
        )
        with open(path, "wb") as fh:  # every event file starts with its version
            version = self._event(wall_time=time.time(), file_version="brain.Event:2")
            self._records(fh).write(version.SerializeToString())
        self._files[series] = path
        return path
