"""The integration tests' process finder (``fixtures.launching.ours``) finds a launch's torchrun and
workers by the node folder their command lines name, never another run's whose name only begins the
same (sleepers started with the plan's command lines)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fixtures.fake_launch import Agents, cpu_job
from fixtures.launching import ours

from launcher.orchestrate.plan import NODE_DIR
from launcher.orchestrate.run import Launch
from launcher.orchestrate.rundir import RunDir
from launcher.spec import ClusterSpec

pytestmark = pytest.mark.processes  # starts processes: not in `just test-fast`


def node_argv(run_dir: RunDir) -> list[str]:
    """The command line (after the interpreter) the launch into ``run_dir`` gives node ``a``."""
    job = cpu_job()
    cluster = ClusterSpec.model_validate({"nodes": [{"name": "a", "host": "198.18.0.10"}]})
    launch = Launch(job=job, cluster=cluster, run_dir=run_dir, facts={}, quiet=True)
    run_dir.prepare(job, cluster)
    agents = Agents()
    launch.start_attempt(agents, 0)
    launch.log.close()
    (node,) = agents.plans[0].nodes
    return [a.replace(NODE_DIR, f"/tmp/launcher-{run_dir.run_id}-a-x1y2z3") for a in node.argv]


@pytest.fixture
def sleepers():
    procs: list[subprocess.Popen] = []

    def start(argv: list[str]) -> int:
        # The sleeper's command line carries the plan's arguments; its environment has neither
        # the test mark nor LAUNCHER_RUN_ID: only the command line can tell whose it is.
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(120)", *argv],
                env={"PATH": "/usr/bin:/bin"},
            )
        )
        return procs[-1].pid

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_ours_finds_a_launchs_processes_by_their_node_folder(tmp_path, sleepers):
    mine = sleepers(node_argv(RunDir(tmp_path / "runx")))
    other = sleepers(node_argv(RunDir(tmp_path / "runx-b")))  # a run whose name begins the same
    found = ours("no-such-mark", "runx")
    assert mine in found, found
    assert other not in found
    assert other in ours("no-such-mark", "runx-b")
