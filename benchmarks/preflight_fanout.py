"""Wall time of the fast preflight (``launch check --fast``) over 1, 4 and 16 simulated nodes.

    sudo python benchmarks/preflight_fanout.py [--nodes 1,4,16] [--repeat 3] [--cli]

How it measures: docs/performance.md, under its name.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from netns import NetnsCluster, missing_requirements  # noqa: E402

from launcher.preflight import run_preflight  # noqa: E402
from launcher.remote import fan_out, runner_for  # noqa: E402
from launcher.spec import ClusterSpec, NodeSpec, load_cluster  # noqa: E402


def busy_cpu_s() -> float:
    """Seconds of CPU time this machine has spent busy (all cores) since boot."""
    with open("/proc/stat", encoding="ascii") as fh:
        fields = [int(x) for x in fh.readline().split()[1:8]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def time_once(cluster_file: Path, cli: bool) -> tuple[float, float, bool, float, float]:
    """(wall seconds, sum of per-node probe seconds, all ok, launcher CPU s, machine busy CPU s)."""
    own0, busy0 = own_cpu_s(), busy_cpu_s()
    started = time.monotonic()
    if cli:
        cmd = [sys.executable, "-m", "launcher", "check", "--fast", "--json"]
        proc = subprocess.run(
            [*cmd, "--cluster", str(cluster_file)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
        )
        wall = time.monotonic() - started
        doc = json.loads(proc.stdout)
        probes = sum(p.get("probe_s", 0.0) for p in doc["probes"].values())
        # the launcher ran in a child process: its CPU is in the machine's busy time only
        return wall, probes, proc.returncode == 0, float("nan"), busy_cpu_s() - busy0
    report = run_preflight(load_cluster(cluster_file), deep=False)
    wall = time.monotonic() - started
    own, busy = own_cpu_s() - own0, busy_cpu_s() - busy0
    if not report.ok:
        print(f"  (a run failed: {report.verdict})", file=sys.stderr)
    return wall, sum(p.get("probe_s", 0.0) for p in report.probes.values()), report.ok, own, busy


def ssh_true(cluster: ClusterSpec) -> float:
    """Wall time of connecting and running ``true`` on every node at once: this machine's floor."""
    started = time.monotonic()

    def run_true(node: NodeSpec) -> None:
        with runner_for(node, cluster.ssh) as runner:
            runner.run("true", timeout=60)

    group = fan_out(cluster.nodes, run_true, cluster.ssh.max_parallel)
    failed = {k: v for k, v in group.items() if isinstance(v, BaseException)}
    if failed:
        raise RuntimeError(f"ssh true failed: {failed}")
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1,4,16", help="comma-separated cluster sizes")
    parser.add_argument(
        "--repeat", type=int, default=3, help="timed runs per size (after one warm-up)"
    )
    parser.add_argument(
        "--cli",
        action="store_true",
        help="time `python -m launcher check --fast` instead of the API",
    )
    parser.add_argument(
        "--bare-login", action="store_true", help="hide ~/.bashrc inside the simulated nodes"
    )
    args = parser.parse_args()
    reason = missing_requirements()
    if reason:
        print(f"cannot simulate nodes here: {reason}", file=sys.stderr)
        return 2

    rows, base = [], None
    for n in (int(x) for x in args.nodes.split(",")):
        with (
            NetnsCluster(n, bare_login=args.bare_login) as cluster,
            tempfile.TemporaryDirectory(dir="/var/tmp") as tmp,
        ):
            cluster_file = cluster.cluster_yaml(
                Path(tmp) / "cluster.yaml", ssh={"max_parallel": 32}
            )
            time_once(cluster_file, args.cli)  # warm-up: page cache, host-key parsing
            runs = [time_once(cluster_file, args.cli) for _ in range(args.repeat)]
            floor = statistics.median(
                ssh_true(load_cluster(cluster_file)) for _ in range(args.repeat)
            )
        walls = [r[0] for r in runs]
        wall = statistics.median(walls)
        serial = statistics.median(r[1] for r in runs)
        own = statistics.median(r[3] for r in runs)
        busy = statistics.median(r[4] for r in runs)
        cores = os.cpu_count() or 1
        base = base if base is not None else wall
        rows.append(
            [
                n,
                f"{wall:.2f}",
                f"{min(walls):.2f}",
                f"{floor:.2f}",
                f"{serial:.2f}",
                f"{serial / wall:.1f}x",
                f"{wall / base:.2f}x",
                "–" if math.isnan(own) else f"{1e3 * own / n:.0f}",
                f"{1e3 * busy / n:.0f}",
                f"{busy / cores / wall:.0%}",
                "yes" if all(r[2] for r in runs) else "NO",
            ]
        )
    headers = [
        "nodes",
        "wall_s (median)",
        "wall_s (min)",
        "ssh true, all nodes",
        "sum of per-node probe_s",
        "overlap",
        "vs 1 node",
        "launcher CPU ms/node",
        "machine CPU ms/node",
        "cores busy",
        "all ok",
    ]
    mode = "python -m launcher check --fast" if args.cli else "run_preflight(deep=False)"
    login = "~/.bashrc hidden in nodes" if args.bare_login else "nodes run ~/.bashrc on login"
    print(
        f"{mode}, {args.repeat} runs per size after a warm-up; {login}; {os.cpu_count()} CPU cores"
    )
    print(tabulate(rows, headers=headers, tablefmt="simple"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
