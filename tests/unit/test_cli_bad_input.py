"""Bad command lines through `python -m launcher`: exit 2, one clear paragraph, and nothing
started (no run directory, no process carrying the launch's environment outlives it)."""

from __future__ import annotations

import uuid

import pytest
from fixtures.launching import ROOT, launch, launcher_env, ours

pytestmark = pytest.mark.processes  # starts processes: not in `just test-fast`

QUICKSTART = str(ROOT / "jobs/quickstart.yaml")


CASES = {
    "unknown flag": ([QUICKSTART, "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    "--set without '='": ([QUICKSTART, "--set", "train.steps"], "KEY=VALUE"),
    "scale without --world": (["scale", QUICKSTART], "--world"),
    "report on a missing dir": (["report", "{tmp}/no-such-run"], "no such directory"),
    "--cluster missing file": (
        [QUICKSTART, "--cluster", "{tmp}/missing-cluster.yaml"],
        "file not found",
    ),
    "more nodes than the cluster": (
        [QUICKSTART, "--set", "resources.nodes=3"],
        "resources.nodes asks for 3 nodes",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_command_line_exits_2_and_starts_nothing(tmp_path, case):
    argv, expected = CASES[case]
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    run_dir = tmp_path / "run"
    if argv[0] not in ("scale", "report"):
        argv = [*argv, "--run-dir", str(run_dir)]
    mark = uuid.uuid4().hex
    result = launch(*argv, cwd=tmp_path, env=launcher_env(mark), timeout=120)
    assert result.returncode == 2, (case, result.returncode, result.stderr[-2000:])
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == "", result.stdout  # nothing ran: no preflight table, no summary
    assert not run_dir.exists() and not (tmp_path / "runs").exists(), "a run directory was created"
    assert not ours(mark), "the command left processes behind"
    assert not list(tmp_path.glob("*/summary.json"))
