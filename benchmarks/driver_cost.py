"""The driver's cost against the job's size: CPU and memory of the watch loop and run log fed by
many simulated node agents (no Ray, no torch).

    python benchmarks/driver_cost.py [--nodes 8,64,256] [--ranks-per-node 8] [--rounds 100]
                                     [--tensorboard]

How it measures: docs/performance.md, under its name.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

from launcher.orchestrate.plan import plan
from launcher.orchestrate.records import AgentUpdate, ExitStatus
from launcher.orchestrate.rundir import RunDir
from launcher.orchestrate.runlog import RunLog
from launcher.orchestrate.sinks import ReportSinks
from launcher.orchestrate.watch import Watcher
from launcher.spec import ClusterSpec, JobSpec


class SimulatedAgents:
    """``rounds`` polls in which every node reports one step of each of its ranks."""

    def __init__(self, nodes: int, per_node: int, rounds: int):
        self.nodes, self.per_node, self.rounds, self.round = nodes, per_node, rounds, 0

    def poll(self, wait_s: float) -> list:
        self.round += 1
        step, now = self.round, time.time()
        out = []
        for i in range(self.nodes):
            ranks = range(i * self.per_node, (i + 1) * self.per_node)
            records = [
                (
                    r,
                    {
                        "type": "step",
                        "rank": r,
                        "time": now,
                        "step": step,
                        "tokens": 8192,
                        "samples": 16,
                        "interval_s": 0.1,
                        "step_times_ms": [100.0],
                        "loss": 3.0,
                        "data_wait_s": 0.001,
                        "gpu_util_pct": 98.0,
                        "sm_clock_mhz": 1980.0,
                    },
                )
                for r in ranks
            ]
            lines = [(lr, f"step {step} loss 3.0") for lr in range(self.per_node) for _ in (0, 1)]
            gpus = [{"time": now, "gpu": g, "util_pct": 98.0} for g in range(self.per_node)]
            done = self.round > self.rounds
            out.append(
                (
                    i,
                    AgentUpdate(
                        lines=lines,
                        records=[] if done else records,
                        telemetry=gpus,
                        exit=ExitStatus(0) if done else None,
                    ),
                )
            )
        return out

    def silent(self, limit_s: float) -> None:
        return None

    def unreachable(self, exclude: int) -> None:
        return None

    def tail(self, i: int, local_rank: int | None, n: int) -> list[str]:
        return []

    def errors(self, i: int) -> list:
        return []

    def stacks(self) -> dict:
        return {}


def measure(
    nodes: int, per_node: int, rounds: int, tensorboard: bool = False
) -> tuple[float, float, float]:
    """(CPU ms per round, the watch loop's thread's alone, RSS growth in MiB) of a run of
    ``rounds`` rounds."""
    job = JobSpec.model_validate(
        {
            "name": "bench",
            "resources": {"device": "cpu", "nproc_per_node": per_node},
            "report": {"tensorboard": tensorboard},
        }
    )
    cluster = ClusterSpec.model_validate(
        {
            "nodes": [
                {"name": f"n{i}", "host": f"198.18.{i // 250}.{i % 250 + 1}"} for i in range(nodes)
            ]
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = RunDir(Path(tmp) / "run")
        run_dir.prepare(job, cluster)
        lp = plan(job, cluster, None, run_id="bench-000000", master_port=29500, launcher_env={})
        log = RunLog(run_dir, quiet=True)
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        cpu0, own0 = time.process_time(), time.thread_time()
        if tensorboard:
            log.sinks = ReportSinks(job, run_dir)
        log.open(lp)
        Watcher(
            SimulatedAgents(nodes, per_node, rounds), lp, on_update=log.ingest, hang_timeout_s=600
        ).run()
        own = time.thread_time() - own0
        if log.sinks is not None:
            log.sinks.close("succeeded", timeout_s=3600)
        cpu = time.process_time() - cpu0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
        log.close()
    return 1e3 * cpu / rounds, 1e3 * own / rounds, rss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="8,64,256")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument(
        "--tensorboard", action="store_true", help="with report.tensorboard (its writer thread)"
    )
    args = parser.parse_args()
    print(
        "| nodes | ranks | CPU ms per round | CPU ms per node and round | watch loop's thread "
        "ms per round | peak RSS growth MiB |"
    )
    print("|---|---|---|---|---|---|")
    for n in (int(x) for x in args.nodes.split(",")):
        ms, own, mib = measure(n, args.ranks_per_node, args.rounds, args.tensorboard)
        print(
            f"| {n} | {n * args.ranks_per_node} | {ms:.1f} | {ms / n:.2f} | {own:.1f} | {mib:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
