"""benchmarks/ab.py for real: a revision exported next to this tree, a command run in both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.launching import sets

REPO = Path(__file__).resolve().parents[2]
AB = REPO / "benchmarks" / "ab.py"
WHERE = "import launcher; print(launcher.__file__)"

pytestmark = pytest.mark.skipif(
    not (REPO / ".git").exists(), reason="needs a git checkout (the tool exports a revision)"
)


def ab(tmp_path: Path, *command: str, base: str = "HEAD") -> dict:
    out = tmp_path / "ab.json"
    cmd = [sys.executable, str(AB), "--base", base, "--rounds", "1", "--out", str(out)]
    proc = subprocess.run(
        [*cmd, "--work", str(tmp_path / "work"), "--", *command],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_a_process_started_elsewhere_imports_its_trees_launcher(tmp_path: Path):
    """What the built-in trainer's workers under ``launch`` do: they start in another folder and
    find ``launcher`` through PYTHONPATH, which must name the run's own tree."""
    script = f"cd {tmp_path} && {sys.executable} -c '{WHERE}'"
    result = ab(tmp_path, "sh", "-c", script)
    base, this = result["runs"]
    assert (base["tree"], this["tree"]) == ("base", "this tree")
    base_file = Path(base["log"]).read_text().strip()
    this_file = Path(this["log"]).read_text().strip()
    assert base_file == base["launcher"] and this_file == this["launcher"]
    assert base_file == str(tmp_path / "work" / "tree" / "launcher" / "__init__.py")
    assert this_file == str(REPO / "launcher" / "__init__.py")


def test_the_trainer_in_both_trees_and_its_ratio(tmp_path: Path):
    train = [sys.executable, "-m", "launcher.train", "--job", "jobs/quickstart.yaml"]
    result = ab(tmp_path, *train, *sets("train.steps=4", "train.warmup_steps=1"))
    assert [r["returncode"] for r in result["runs"]] == [0, 0]
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None for r in result["runs"])  # no CPU MFU
    base, this = result["runs"]
    assert result["median_ratio"] == pytest.approx(this["tokens_per_s"] / base["tokens_per_s"])


def test_a_folder_as_the_base_is_run_as_it_is(tmp_path: Path):
    """Where this tree has no .git (a machine that got a copy of the files), the base is a tree
    exported before: it runs from that folder, with that folder first on PYTHONPATH."""
    tree = tmp_path / "base-tree" / "launcher"
    tree.mkdir(parents=True)
    (tree / "__init__.py").write_text("")
    result = ab(tmp_path, sys.executable, "-c", WHERE, base=str(tree.parent))
    base, this = result["runs"]
    assert Path(base["log"]).read_text().strip() == str(tree / "__init__.py") == base["launcher"]
    assert Path(this["log"]).read_text().strip() == str(REPO / "launcher" / "__init__.py")
    assert not (tmp_path / "work" / "tree").exists()  # nothing exported
