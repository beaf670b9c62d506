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


def test_a_submissions_reservation_is_taken_by_its_own_job_only(tmp_path):
    """`launch submit` to a head on this machine reserves the folder for its job; nothing else
    (a foreground run, another job's driver, another submission) gets it, the job's driver does."""
    path = tmp_path / "r"
    RunDir.reserve(path, "job-1")
    assert sorted(p.name for p in path.iterdir()) == [".launcher-job", "logs"]
    for take in (lambda: RunDir.claim(path), lambda: RunDir.claim(path, job_id="job-2"),
                 lambda: RunDir.reserve(path, "job-2")):
        with pytest.raises(UsageError, match=r"is reserved for job job-1, submitted before .*`launch status job-1`"):
            take()
    taken = RunDir.claim(path, job_id="job-1")
    assert taken.root == path and [p.name for p in path.iterdir()] == ["logs"]  # the reservation is gone
    with pytest.raises(UsageError, match="is not empty"):  # now the job's own: taken once
        RunDir.claim(path, job_id="job-1")


def test_a_reservation_written_into_since_is_refused_to_its_job(tmp_path):
    path = tmp_path / "r"
    RunDir.reserve(path, "job-1")
    (path / "summary.json").write_text("{}")
    with pytest.raises(UsageError, match=r"reserved for this job .* put into it since \(summary.json\)"):
        RunDir.claim(path, job_id="job-1")


def test_a_released_reservation_leaves_the_folder_as_it_was(tmp_path):
    """A submission that fails before Ray has the job frees the folder: what the reservation
    made is removed, a folder that was there stays."""
    release = RunDir.reserve(tmp_path / "a" / "b", "job-1")
    release()
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "empty").mkdir()
    release = RunDir.reserve(tmp_path / "empty", "job-2")
    release()
    assert (tmp_path / "empty").is_dir() and list((tmp_path / "empty").iterdir()) == []
    release = RunDir.reserve(tmp_path / "c", "job-3")
    RunDir.claim(tmp_path / "c", job_id="job-3")  # the driver took it: a late release leaves it
    release()
    assert (tmp_path / "c" / "logs").is_dir()


@pytest.fixture
def local_submit(tmp_path, monkeypatch):
    """`launch submit` to this machine's head with the preflight and the Jobs API faked: returns
    a function that submits with ``--run-dir`` and gives (exit code, stderr), and the fake client."""
    import contextlib
    import types

    from launcher.jobs import commands

    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: q\nresources: {device: cpu, nproc_per_node: 1}\nprecision: {dtype: fp32}\n")
    (tmp_path / "cluster.yaml").write_text("nodes: [{name: local, host: localhost}]\n")
    monkeypatch.setattr("launcher.preflight.preflight_facts", lambda *a, **k: None)
    monkeypatch.setenv("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0")  # submit sets it: restored after
    client = types.SimpleNamespace(submitted=[], error=None)

    def submit_job(**kw):
        if client.error is not None:
            raise client.error
        client.submitted.append(kw)

    client.submit_job = submit_job

    @contextlib.contextmanager
    def connect(spec, *, start=False):
        yield types.SimpleNamespace(head_is_local=True, cluster=spec, client=client, head=spec.nodes[0])

    monkeypatch.setattr(commands, "connect", connect)

    def submit(run_dir, capsys):
        rc = main(["submit", str(job_file), "--cluster", str(tmp_path / "cluster.yaml"), "--run-dir",
                   str(run_dir), "--json"])
        return rc, capsys.readouterr()

    return submit, client


def test_two_queued_submits_to_one_run_dir_the_second_is_refused(tmp_path, local_submit, capsys):
    """Both submissions find the folder new (the first job has not started yet): the first
    reserves it at once, so the second is refused (exit 2), naming the first job."""
    submit, client = local_submit
    run_dir = tmp_path / "shared"
    rc, out = submit(run_dir, capsys)
    assert rc == 0, out.err
    first = json.loads(out.out)["job_id"]
    assert (run_dir / ".launcher-job").read_text().strip() == first
    rc, out = submit(run_dir, capsys)
    assert rc == 2 and len(client.submitted) == 1
    assert out.err.startswith(f"error: --run-dir {run_dir} is reserved for job {first}") and out.err.count("\n") == 1


def test_a_submission_that_fails_frees_its_run_dir(tmp_path, local_submit, capsys):
    from launcher.errors import PreflightError

    submit, client = local_submit
    client.error = PreflightError("the Ray Jobs API at http://127.0.0.1:1 failed (submit_job): boom")
    rc, out = submit(tmp_path / "d", capsys)
    assert rc == 3 and "boom" in out.err
    assert not (tmp_path / "d").exists()
    client.error = None
    assert submit(tmp_path / "d", capsys)[0] == 0  # submitting again works


def driven(tmp_path, monkeypatch, run_dir, job_id="q-1"):
    """The driver on a submission to ``run_dir`` (Ray and the launch faked): (exit code,
    its log, the run directory the launch got or None)."""
    import io

    from launcher import signals
    from launcher.jobs import driver

    got = []
    monkeypatch.setattr(signals, "install", lambda: None)
    monkeypatch.setattr(driver.Driver, "run", lambda self: got.append(self.run_dir) or 0)
    monkeypatch.setattr("sys.stdout", out := io.StringIO())
    (tmp_path / "submission.json").write_text(json.dumps({
        "job_id": job_id, "job": job().model_dump(mode="json"), "run_dir": str(run_dir)}))
    rc = driver.main([str(tmp_path / "submission.json")])
    return rc, out.getvalue(), (got[0] if got else None)


def test_the_driver_refuses_a_run_dir_that_holds_a_run(tmp_path, monkeypatch):
    """A submission to a remote head cannot look at the folder from here: the driver does, on
    the head. The job fails (exit 2) with the refusal in its log and as its failure; the
    folder is left as it was."""
    from launcher.jobs import state

    old = tmp_path / "old"
    old.mkdir()
    (old / "summary.json").write_text('{"status": "succeeded"}')
    rc, log, got = driven(tmp_path, monkeypatch, old)
    assert rc == 2 and got is None
    assert f"error: --run-dir {old} is not empty (summary.json)" in log and "Pick a new folder" in log
    final = state.last_state(log)
    assert final["state"] == "done" and final["status"] == "failed"
    assert f"--run-dir {old} is not empty" in final["failure"]["reason"]
    assert [p.name for p in old.iterdir()] == ["summary.json"]
    assert (old / "summary.json").read_text() == '{"status": "succeeded"}'


def test_the_driver_takes_its_own_submissions_reservation_and_no_other(tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    RunDir.reserve(mine, "q-1")
    rc, log, got = driven(tmp_path, monkeypatch, mine, job_id="q-1")
    assert rc == 0 and got is not None and got.root == mine, log
    assert not (mine / ".launcher-job").exists()
    theirs = tmp_path / "theirs"
    RunDir.reserve(theirs, "q-2")
    rc, log, got = driven(tmp_path, monkeypatch, theirs, job_id="q-3")
    assert rc == 2 and got is None and "reserved for job q-2" in log
    assert (theirs / ".launcher-job").read_text().strip() == "q-2"
