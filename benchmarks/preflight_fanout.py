"""Wall time of the fast preflight (``launch check --fast``) over 1, 4 and 16 simulated nodes.

Each simulated node is a network namespace with its own sshd (tests/netns.py), so every probe
pays a real SSH handshake, a login shell and a Python start. A parallel fan-out keeps the wall
time of 16 nodes close to that of one (target: within 3x); a serial one would be ~16x.

    sudo python benchmarks/preflight_fanout.py [--nodes 1,4,16] [--repeat 3] [--cli]

On this machine every login runs ~/.bashrc (pyenv init: ~0.4 s of CPU), and all simulated
nodes share its cores, so a large fan-out becomes CPU-bound on the *nodes'* side. The table
therefore also shows the floor any SSH fan-out pays here (``ssh true`` on every node at once),
and ``--bare-login`` hides ~/.bashrc inside the nodes to measure the launcher's own cost.

``--cli`` times ``python -m launcher check --fast`` as a subprocess (adds interpreter start-up
and imports); the default times ``run_preflight(cluster, deep=False)`` in-process.
"""

from __future__ import annotations

import argparse
import json
import os
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
from launcher.preflight.runners import fan_out, runner_for  # noqa: E402
from launcher.spec import ClusterSpec, NodeSpec, load_cluster  # noqa: E402


def time_once(cluster_file: Path, cli: bool) -> tuple[float, float, bool]:
    """(wall seconds, sum of per-node probe seconds, all ok)."""
    started = time.monotonic()
    if cli:
        proc = subprocess.run(
            [sys.executable, "-m", "launcher", "check", "--cluster", str(cluster_file), "--fast", "--json"],
            capture_output=True, text=True, timeout=300, cwd=REPO,
        )
        wall = time.monotonic() - started
        doc = json.loads(proc.stdout)
        return wall, sum(p.get("probe_s", 0.0) for p in doc["probes"].values()), proc.returncode == 0
    report = run_preflight(load_cluster(cluster_file), deep=False)
    wall = time.monotonic() - started
    if not report.ok:
        print(f"  (a run failed: {report.verdict})", file=sys.stderr)
    return wall, sum(p.get("probe_s", 0.0) for p in report.probes.values()), report.ok


def ssh_true(cluster: ClusterSpec) -> float:
    """Wall time of connecting and running ``true`` on every node at once: this machine's floor."""
    started = time.monotonic()

    def run_true(node: NodeSpec) -> None:
        with runner_for(node, cluster.ssh) as runner:
            runner.run("true", timeout=60)

    group = fan_out(cluster.nodes, run_true, cluster.ssh.max_parallel)
    if group.failed:
        raise RuntimeError(f"ssh true failed: {group.failed}")
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1,4,16", help="comma-separated cluster sizes")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per size (after one warm-up)")
    parser.add_argument("--cli", action="store_true", help="time `python -m launcher check --fast` instead of the API")
    parser.add_argument("--bare-login", action="store_true", help="hide ~/.bashrc inside the simulated nodes")
    args = parser.parse_args()
    reason = missing_requirements()
    if reason:
        print(f"cannot simulate nodes here: {reason}", file=sys.stderr)
        return 2

    rows, base = [], None
    for n in (int(x) for x in args.nodes.split(",")):
        with NetnsCluster(n, bare_login=args.bare_login) as cluster, tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
            cluster_file = cluster.cluster_yaml(Path(tmp) / "cluster.yaml", ssh={"max_parallel": 32})
            time_once(cluster_file, args.cli)  # warm-up: page cache, host-key parsing
            runs = [time_once(cluster_file, args.cli) for _ in range(args.repeat)]
            floor = statistics.median(ssh_true(load_cluster(cluster_file)) for _ in range(args.repeat))
        walls = [r[0] for r in runs]
        wall = statistics.median(walls)
        serial = statistics.median(r[1] for r in runs)
        base = base if base is not None else wall
        rows.append(
            [n, f"{wall:.2f}", f"{min(walls):.2f}", f"{floor:.2f}", f"{serial:.2f}", f"{serial / wall:.1f}x",
             f"{wall / base:.2f}x", "yes" if all(r[2] for r in runs) else "NO"]
        )
    headers = ["nodes", "wall_s (median)", "wall_s (min)", "ssh true, all nodes", "sum of per-node probe_s",
               "overlap", "vs 1 node", "all ok"]
    mode = "python -m launcher check --fast" if args.cli else "run_preflight(deep=False)"
    login = "~/.bashrc hidden in nodes" if args.bare_login else "nodes run ~/.bashrc on login"
    print(f"{mode}, {args.repeat} runs per size after a warm-up; {login}; {os.cpu_count()} CPU cores")
    print(tabulate(rows, headers=headers, tablefmt="simple"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
