"""Run ids and run directories: each launch's node folders are its own, and a run directory
holds one run. Nothing is started: fake agents record what the launch asked of them."""

from __future__ import annotations

import json

import pytest

from launcher.cli import main
from launcher.errors import UsageError
from launcher.orchestrate import run as run_mod
from launcher.orchestrate.run import Launch
from launcher.orchestrate.rundir import RunDir
from launcher.spec import ClusterSpec, JobSpec


def job() -> JobSpec:
    return JobSpec.model_validate({"name": "t", "resources": {"device": "cpu", "nproc_per_node": 1},
                                   "precision": {"dtype": "fp32"}, "train": {"steps": 5, "warmup_steps": 1}})


def cluster() -> ClusterSpec:
    return ClusterSpec.model_validate({"nodes": [{"name": "a", "host": "198.18.0.10"},
                                                 {"name": "b", "host": "198.18.0.11"}]})


class Agents:
    def __init__(self) -> None:
        self.plans: list = []

    def free_port(self) -> int:
        return 29500

    def start(self, launch_plan, files) -> None:
        self.plans.append(launch_plan)


def started(run_dir: RunDir, attempt: int = 0, launch: Launch | None = None):
    """The plan an attempt of a launch into ``run_dir`` hands to its nodes."""
    launch = launch or Launch(job=job(), cluster=cluster(), run_dir=run_dir, facts={}, quiet=True)
    run_dir.prepare(launch.job, launch.cluster)
    agents = Agents()
    launch.start_attempt(agents, attempt)
    launch.log.close()
    return agents.plans[0], launch


def test_runs_whose_folders_share_a_name_get_their_own_node_folders(tmp_path):
    """`--run-dir a/x` and `--run-dir b/x` (or two clusters' runs/<job>-<time>): the same name,
    yet neither's workers write into (or remove) the other's /tmp/launcher/<run id>/<node>."""
    one, _ = started(RunDir(tmp_path / "a" / "x"))
    two, _ = started(RunDir(tmp_path / "b" / "x"))
    dirs_one = {n.node_dir for n in one.nodes}
    dirs_two = {n.node_dir for n in two.nodes}
    assert not dirs_one & dirs_two, (dirs_one, dirs_two)
    for lp, root in ((one, tmp_path / "a" / "x"), (two, tmp_path / "b" / "x")):
        assert lp.run_id.startswith("x-") and lp.run_id != "x"  # readable: the folder's name first
        assert all(n.node_dir == f"/tmp/launcher/{lp.run_id}/{n.name}" for n in lp.nodes)
        assert all(n.env["LAUNCHER_RUN_ID"] == "x" for n in lp.nodes)  # what scripts and tests read
        recorded = json.loads((root / "plan.json").read_text())
        assert recorded["run_id"] == lp.run_id and recorded["run_name"] == "x"
        assert recorded["nodes"][0]["node_dir"].startswith(f"/tmp/launcher/{lp.run_id}/")


def test_a_restart_keeps_the_launchs_run_id(tmp_path):
    """Every attempt of one launch (a restart, an elastic one) is the same run: one run id."""
    run_dir = RunDir(tmp_path / "x")
    first, launch = started(run_dir)
    again, _ = started(run_dir, attempt=1, launch=launch)
    assert again.run_id == first.run_id
    assert [n.node_dir for n in again.nodes] == [n.node_dir for n in first.nodes]
    assert json.loads((tmp_path / "x" / "plan.attempt1.json").read_text())["run_id"] == first.run_id


def test_a_run_dir_that_holds_a_run_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    """Launching into a folder that holds an earlier run would mix logs, metrics and summaries:
    exit 2, one paragraph naming the folder and the way out, nothing started or written."""
    old = tmp_path / "old"
    (old / "logs").mkdir(parents=True)
    (old / "summary.json").write_text('{"status": "succeeded"}')
    before = sorted(p.relative_to(old) for p in old.rglob("*"))
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: q\nresources: {device: cpu, nproc_per_node: 1}\nprecision: {dtype: fp32}\n")

    def started_anything(*args, **kwargs):
        raise AssertionError("the launch went on")

    monkeypatch.setattr(run_mod, "preflight_facts", started_anything)
    monkeypatch.setattr(Launch, "execute", started_anything)
    assert main([str(job_file), "--run-dir", str(old)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert f"--run-dir {old} is not empty" in err and "summary.json" in err
    assert "Pick a new folder" in err and f"remove {old}" in err
    assert sorted(p.relative_to(old) for p in old.rglob("*")) == before
    assert (old / "summary.json").read_text() == '{"status": "succeeded"}'


def test_an_empty_or_new_run_dir_is_taken(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert RunDir.claim(empty).root == empty and (empty / "logs").is_dir()
    new = tmp_path / "a" / "b"
    assert RunDir.claim(new).root == new and (new / "logs").is_dir()
    with pytest.raises(UsageError, match="is not empty"):  # now it is this launch's
        RunDir.claim(new)
    a_file = tmp_path / "f"
    a_file.write_text("")
    with pytest.raises(UsageError, match="is a file"):
        RunDir.claim(a_file)


def test_submit_to_this_machine_refuses_a_run_dir_that_holds_a_run(tmp_path, monkeypatch, capsys):
    """`launch submit --run-dir` where the head is this machine: the same refusal, before the
    preflight and before any Ray is asked for."""
    from launcher.jobs import commands

    old = tmp_path / "old"
    old.mkdir()
    (old / "summary.json").write_text("{}")
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: q\nresources: {device: cpu, nproc_per_node: 1}\nprecision: {dtype: fp32}\n")
    (tmp_path / "cluster.yaml").write_text("nodes: [{name: local, host: localhost}]\n")

    def started_anything(*args, **kwargs):
        raise AssertionError("the submission went on")

    monkeypatch.setattr("launcher.preflight.preflight_facts", started_anything)
    monkeypatch.setattr(commands, "connect", started_anything)
    assert main(["submit", str(job_file), "--cluster", str(tmp_path / "cluster.yaml"), "--run-dir", str(old)]) == 2
    err = capsys.readouterr().err
    assert f"--run-dir {old} is not empty" in err and err.count("\n") == 1
