"""What the node agents report, into the run directory (rank logs, metrics, telemetry) and
the report sinks, and onto the console (rank 0, error lines, stragglers, a progress bar).
Per rank only a ``RankStats`` stays in memory: the driver's memory stays flat however long
the run. docs/running.md lists the files.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any, TextIO

from launcher.orchestrate.plan import LaunchPlan, NodePlan
from launcher.orchestrate.records import AgentUpdate
from launcher.orchestrate.rundir import RunDir
from launcher.orchestrate.sinks import ReportSinks
from launcher.results.rankstats import RankStats
from launcher.results.stragglers import StragglerWatch, preflight_facts

ERROR_LINE = re.compile(r"Traceback|Error|Exception|FAILED|Signal \d+", re.IGNORECASE)


class RunLog:
    def __init__(self, run_dir: RunDir, *, quiet: bool = False):
        self.run_dir = run_dir
        self.quiet = quiet
        self.attempt = 0  # the attempt whose updates come in now
        self.by_attempt: dict[int, dict[int, RankStats]] = {}  # attempt → rank → its records folded
        self._files: dict[tuple[str, int | None, bool], TextIO] = {}  # (node, rank, stderr)
        self._progress: Progress | None = None
        self.stragglers = StragglerWatch({})  # this attempt's
        self.sinks: ReportSinks | None = None

    def open(self, launch_plan: LaunchPlan) -> None:
        """A new attempt: every rank gets its log file, even one that never prints."""
        self.attempt = launch_plan.attempt
        nodes = {r: n.name for n in launch_plan.nodes for r in n.ranks}
        self.stragglers = StragglerWatch(nodes, preflight_facts(self.run_dir.preflight))
        if self.sinks is not None:
            self.sinks.attempt(launch_plan.world_size)
        for node in launch_plan.nodes:
            for rank in node.ranks:
                self._file(node.name, rank)

    def ingest(self, node: NodePlan, update: AgentUpdate) -> None:
        written = set()
        for local_rank, stream, text in update.lines:
            known = local_rank is not None and local_rank < node.nproc
            rank = node.ranks[local_rank] if local_rank is not None and known else None
            files = [self._file(node.name, rank)]
            if rank is not None and stream == "err":
                files.append(self._file(node.name, rank, stderr=True))
            for fh in files:
                fh.write(text + "\n")
                written.add(fh)
            if not self.quiet and rank is not None and (rank == 0 or ERROR_LINE.search(text)):
                self.show(f"[{node.name}/rank{rank}] {text}")
        for fh in written:  # only this node's files: the cost stays flat as the job grows
            fh.flush()
        if update.telemetry:
            path = self.run_dir.telemetry_file(node.name)
            path.parent.mkdir(exist_ok=True)
            with open(path, "a", encoding="utf-8") as fh:
                fh.writelines(json.dumps(sample) + "\n" for sample in update.telemetry)
            if self.sinks is not None:
                self.sinks.telemetry(node.name, update.telemetry)
        for rank, record in update.records:
            ranks = self.by_attempt.setdefault(self.attempt, {})
            if rank not in ranks:
                ranks[rank] = RankStats()
            ranks[rank].add(record)
            with open(self.run_dir.metrics_file(rank), "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")
            if self.sinks is not None:
                self.sinks.record(rank, record)
            if self._progress is not None:
                self._progress.update(rank, record)
            straggler = self.stragglers.add(rank, record)
            if straggler is not None:
                self.show(straggler.line())

    def show(self, text: str) -> None:
        if self._progress is not None:
            self._progress.write(text)
        elif not self.quiet:
            print(text, flush=True)

    def start_progress(self, total_steps: int) -> None:
        if not self.quiet and sys.stderr.isatty():
            self._progress = Progress(total_steps)

    def stop_progress(self) -> None:
        if self._progress is not None:
            self._progress.close()
            self._progress = None

    def close(self) -> None:
        self.stop_progress()
        for fh in self._files.values():
            fh.close()
        self._files.clear()

    def _file(self, node: str, rank: int | None, *, stderr: bool = False) -> TextIO:
        key = (node, rank, stderr)
        if key not in self._files:
            path = (
                self.run_dir.stderr_log(node, rank)
                if stderr and rank is not None
                else self.run_dir.rank_log(node, rank)
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            self._files[key] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        return self._files[key]


class Progress:
    """A live bar: rank 0's step of total, aggregate tokens/s over ranks."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self.total = total
        self.rates: dict[int, float] = {}
        self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, leave=False)

    def update(self, rank: int, record: dict[str, Any]) -> None:
        if record.get("type") != "step":
            return
        interval = record.get("interval_s")
        if interval:
            self.rates[rank] = record.get("tokens", 0) / interval
        if rank == 0 and "step" in record:
            self.bar.n = min(record["step"], self.total)
            self.bar.set_postfix_str(f"{sum(self.rates.values()) / 1e3:,.1f}k tok/s")

    def write(self, text: str) -> None:
        self.bar.write(text)

    def close(self) -> None:
        self.bar.close()
