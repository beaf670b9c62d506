"""``launch logs RUN_DIR --rank R | --node N`` on a finished run directory."""

from __future__ import annotations

import pytest

from launcher.cli import main
from launcher.errors import UsageError
from launcher.results.logs import rank_logs


@pytest.fixture
def run(tmp_path):
    for node, ranks in (("a", (0, 1)), ("b", (2, 10))):
        (tmp_path / "logs" / node).mkdir(parents=True)
        for r in ranks:
            (tmp_path / "logs" / node / f"rank{r}.log").write_text(f"hello from {r}\nbye {r}\n")
        (tmp_path / "logs" / node / "torchrun.log").write_text("torchrun\n")
    (tmp_path / "plan.json").write_text("{}")
    return tmp_path


def test_one_rank_as_written_and_one_node_marked_by_rank(run):
    assert rank_logs(run, rank=10) == "hello from 10\nbye 10\n"
    assert rank_logs(run, node="b").splitlines() == [
        "[b/rank2] hello from 2",
        "[b/rank2] bye 2",
        "[b/rank10] hello from 10",
        "[b/rank10] bye 10",
    ]
    assert len(rank_logs(run).splitlines()) == 8


def test_a_rank_or_node_not_in_the_run_names_those_that_are(run):
    with pytest.raises(UsageError, match="ranks are 0, 1, 2, 10"):
        rank_logs(run, rank=5)
    with pytest.raises(UsageError, match="nodes are a, b"):
        rank_logs(run, node="c")


def test_the_command_reads_a_run_directory(run, capsys):
    assert main(["logs", str(run), "--rank", "1"]) == 0
    assert capsys.readouterr().out == "hello from 1\nbye 1\n"
    assert main(["logs", str(run), "--rank", "7"]) == 2
