"""Detached jobs end to end on this machine: the launcher's own Ray head, real Ray Jobs,
real torchrun (gloo, CPU). One head serves the module (starting one costs ~8 s on 2 cores);
its state dir and temp dir are the module's own (``LAUNCHER_STATE_DIR``), never a user's,
and ``launch down`` stops it at the end. Every test waits until its jobs have ended."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from fixtures.launching import (
    QUICK,
    assert_none_left,
    env_of,
    kill,
    launch,
    launcher_env,
    node_dirs,
    ours,
    processes,
    sets,
    slow_batches,
    wait_for,
    what_nobody_can_touch,
    write_job,
)

ROOT = Path(__file__).resolve().parents[2]
SLOW = tuple(
    sets(
        "train.steps=100000", "train.warmup_steps=2", "train.log_every=1", "train.lr_warmup_steps=2"
    )
)


ENDED = {"SUCCEEDED", "FAILED", "STOPPED"}


class Jobs:
    """``python -m launcher`` against the module's head, from fresh processes each time;
    ``flags`` follow every command."""

    def __init__(self, state: Path, cwd: Path, *flags: str):
        self.cwd, self.flags = cwd, flags
        self.mark = uuid.uuid4().hex
        self.env = launcher_env(self.mark, LAUNCHER_STATE_DIR=str(state))

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return launch(*args, *self.flags, cwd=self.cwd, env=self.env, timeout=timeout)

    def submit(self, *args: str, job: Path = ROOT / "jobs/quickstart.yaml") -> dict:
        result = self.run("submit", str(job), "--json", *args)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return submitted(result)

    def status(self, job_id: str) -> dict:
        result = self.run("status", job_id, "--json")
        assert result.returncode == 0, result.stdout + result.stderr
        return json.loads(result.stdout)

    def wait_status(
        self, job_id: str, wanted: set[str], timeout: float, seen: list | None = None
    ) -> dict:
        def check():
            state = self.status(job_id)
            if seen is not None:
                seen.append(state["status"])
            return state if state["status"] in wanted else None

        return wait_for(check, timeout=timeout, what=f"job {job_id} to be {wanted}", poll=0.5)

    def wait_step(self, job_id: str) -> None:
        """Until the job has taken a step."""
        what = f"job {job_id}'s first step"
        wait_for(lambda: self.status(job_id)["step"], timeout=180, what=what, poll=1.0)

    def head(self) -> dict:
        path = Path(self.env["LAUNCHER_STATE_DIR"]) / "local/head.json"
        return json.loads(path.read_text())


def submitted(result: subprocess.CompletedProcess[str]) -> dict:
    """What ``launch submit --json`` printed: its last line."""
    return json.loads(result.stdout.strip().splitlines()[-1])


def job_processes(job_id: str) -> dict[int, str]:
    """The job's driver and workers (the driver's environment names the job id)."""
    out = {}
    for pid, cmd in processes().items():
        env = env_of(pid)
        if env.get("LAUNCHER_RUN_ID") == job_id or job_id in env.get(
            "RAY_JOB_CONFIG_JSON_ENV_VAR", ""
        ):
            out[pid] = cmd
    return out


def assert_job_gone(job_id: str, wait_s: float = 20.0) -> None:
    deadline = time.monotonic() + wait_s
    while (left := job_processes(job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"left running by job {job_id}: {left}"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("jobs")
    runner = Jobs(root / "state", root)
    started = runner.run("up", timeout=180)
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        yield runner
    finally:
        down = runner.run("down", "--yes", timeout=120)
        head = runner.head() if (root / "state/local/head.json").exists() else None
        try:  # Ray's per-job watcher (`while kill -s 0 <supervisor>; do sleep 1`) ends within 1 s
            assert_none_left(runner.mark, wait_s=10)
        finally:
            kill(list(ours(runner.mark)))
        assert down.returncode == 0, down.stdout + down.stderr
        assert head is None, f"launch down left its head: {head}"


@pytest.fixture(scope="module")
def slow(tmp_path_factory) -> tuple[str, ...]:
    """Overrides for a job that runs until stopped. Its batches come 0.5 s late
    (``slow_batches``): it holds its CPU slots and leaves the CPUs to the tests."""
    plant = slow_batches(tmp_path_factory.mktemp("slow"), 0.5)
    path = os.pathsep.join((str(plant), str(ROOT)))
    return (*SLOW, "--set", f"launch.env.PYTHONPATH={path}")


def test_submit_follow_fetch_and_report_survive_the_submitter(jobs, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # What any command costs here (a fresh interpreter, the launcher's and Ray's imports, the
    # head's API): the job id must come within a few seconds of that, not after the job starts.
    began = time.monotonic()
    assert jobs.run("list", "--json").returncode == 0
    baseline = time.monotonic() - began
    # The submitter is SIGKILLed as soon as it has printed the job id: the job does not need it.
    argv = [sys.executable, "-m", "launcher", "submit", str(ROOT / "jobs/quickstart.yaml")]
    argv += ["--json", "--skip-parity", *QUICK, *sets("report.tensorboard=true")]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    proc = subprocess.Popen(argv, cwd=jobs.cwd, env=jobs.env, **pipes)
    started = time.monotonic()
    first = proc.stdout.readline()
    took = time.monotonic() - started
    proc.kill()
    proc.wait(timeout=10)
    submitted = json.loads(first)
    assert set(submitted) == {"job_id", "name", "cluster", "run_dir"}
    assert submitted["name"] == "quickstart"
    late = f"the job id came after {took:.1f} s (a `launch list`: {baseline:.1f} s)"
    assert took < baseline + 5.0, late
    job_id = submitted["job_id"]

    seen: list[str] = []
    done = jobs.wait_status(job_id, ENDED, timeout=180, seen=seen)
    assert done["status"] == "SUCCEEDED", done
    assert set(seen) <= {"PENDING", "RUNNING", "SUCCEEDED"}, seen
    assert done["world_size"] == 2 and done["tokens_per_s"] > 0 and done["failure"] is None
    assert done["run_dir"] == submitted["run_dir"]
    board = EventAccumulator(str(Path(done["run_dir"]) / "tensorboard" / "job"))  # the driver's
    board.Reload()
    assert [e.step for e in board.Scalars("loss")] == [2, 4, 6]
    assert all(e.value > 0 for e in board.Scalars("tokens_per_s"))

    logs = jobs.run("logs", job_id)
    assert logs.returncode == 0
    assert "[local/rank0] step 6/6" in logs.stdout and "Per rank" in logs.stdout
    assert "Job" in logs.stdout
    assert "::launcher-state::" not in logs.stdout
    listed = json.loads(jobs.run("list", "--json").stdout)
    mine = next(r for r in listed if r["job_id"] == job_id)
    assert mine["status"] == "SUCCEEDED" and mine["tokens_per_s"] == done["tokens_per_s"]
    table = jobs.run("list").stdout
    assert job_id in table and f"{done['tokens_per_s']:,.0f}" in table

    # finished job: following or stopping it says so and exits 0
    follow = jobs.run("logs", job_id, "--follow")
    assert follow.returncode == 0 and "has ended (SUCCEEDED); nothing to follow" in follow.stdout
    stop = jobs.run("stop", job_id)
    assert stop.returncode == 0 and "has already ended (SUCCEEDED); nothing to stop" in stop.stdout

    fetched = tmp_path / "fetched"
    result = jobs.run("fetch", job_id, "--to", str(fetched))
    assert result.returncode == 0, result.stderr
    summary = json.loads((fetched / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["world_size"] == 2
    assert (fetched / "preflight/parity.txt").read_text().startswith("skipped")
    report = jobs.run("report", str(fetched))
    assert report.returncode == 0 and "Per rank" in report.stdout and "SUCCEEDED" in report.stdout


def test_a_running_job_is_private_holds_the_queue_and_stop_tears_it_down_within_15_s(jobs, slow):
    """One running job serves what needs one:
    - while it runs, user nobody (when we are root) can create no file under the head's temp dir
      (where Ray unpacks the code its drivers run), the job's node folder or the state dir, and
      can read none of them (the job driver logs hold rank 0's output);
    - its workers take every CPU slot Ray counts on this machine: a second such job waits, held
      by it; a third queues behind the second and, stopped while it waits, ends STOPPED at once;
    - ``launch down`` refuses while it runs; ``launch stop`` tears it down within 15 s;
    - then the second runs to its end, its workers started after the first's summary was
      written. The first runs until it is stopped, so every check sees it running, however slow
      the machine."""
    nproc = ("--set", f"resources.nproc_per_node={os.cpu_count()}")
    first = jobs.submit(*slow, *nproc)["job_id"]  # with the preflight, as a real submit
    submitted = [first]
    try:
        second = jobs.submit("--skip-parity", *QUICK, *nproc)["job_id"]
        submitted.append(second)
        jobs.wait_step(first)
        assert jobs.status(first)["status"] == "RUNNING"

        def second_waits() -> str | None:
            reason = jobs.run("status", second).stdout  # its driver may not have said why yet
            pending = reason.startswith(f"job {second} (quickstart): PENDING")
            held = pending and f"held by job {first}" in reason and "CPU slot" in reason
            return reason if held else None

        wait_for(
            second_waits, timeout=180, what="the second job pending, held by the first", poll=1.0
        )
        third = jobs.submit("--skip-parity", *QUICK, *nproc)["job_id"]
        submitted.append(third)
        wait_for(
            lambda: "queued behind job " + second in jobs.run("status", third).stdout,
            timeout=60,
            what="the third job queued behind the second",
            poll=1.0,
        )
        assert jobs.run("stop", third, timeout=60).returncode == 0
        assert jobs.status(third)["status"] == "STOPPED"
        waited = json.loads((Path(jobs.status(third)["run_dir"]) / "summary.json").read_text())
        assert waited["status"] == "interrupted" and waited["ranks"] == []

        assert job_processes(first), "no worker of the job found while it runs"
        if os.getuid() == 0:  # switching to user nobody needs root
            temp_dir = Path(jobs.head()["temp_dir"]).parent  # Ray's own (0777) is in there
            assert temp_dir.stat().st_mode & 0o777 == 0o700
            assert list(temp_dir.rglob("job-driver-*.log")), "the job's driver log"
            assert list(temp_dir.rglob("_ray_pkg_*")), "the code Ray unpacked for the driver"
            [node_dir] = node_dirs(job_processes(first))
            state = Path(jobs.env["LAUNCHER_STATE_DIR"])
            touched = what_nobody_can_touch([temp_dir, node_dir, state])
            assert touched == [], touched

        busy = jobs.run("down")  # a running job: down refuses without --yes
        assert busy.returncode == 2 and first in busy.stderr
        assert jobs.status(second)["status"] == "PENDING"  # still held by the first
    except BaseException:
        for job_id in submitted:
            jobs.run("stop", job_id, timeout=60)
        raise

    started = time.monotonic()
    stopped = jobs.run("stop", first, timeout=60)  # returns once the job has ended
    took = time.monotonic() - started
    assert stopped.returncode == 0, stopped.stderr
    state = jobs.status(first)
    assert state["status"] == "STOPPED" and took <= 15.0, (state, took)
    assert_job_gone(first, wait_s=5)
    summary = json.loads((Path(state["run_dir"]) / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["ranks"], summary["status"]
    assert "interrupted" in jobs.run("logs", first).stdout

    done = jobs.wait_status(second, ENDED, timeout=240)
    assert done["status"] == "SUCCEEDED", done
    one, two = (Path(jobs.status(j)["run_dir"]) for j in (first, second))
    # the second one's workers started after the first one's summary was written
    assert (two / "plan.json").stat().st_mtime >= (one / "summary.json").stat().st_mtime


def test_bad_input(jobs, tmp_path):
    unknown = jobs.run("status", "no-such-job")
    assert unknown.returncode == 2 and "no job 'no-such-job'" in unknown.stderr
    assert "known job ids:" in unknown.stderr
    # no launcher Ray at all (another state dir): status says so and exits 0
    empty = Jobs(tmp_path / "empty-state", tmp_path)
    result = empty.run("status")
    assert result.returncode == 0
    assert "no jobs: nothing was submitted on this cluster" in result.stdout
    assert empty.run("logs", "x").returncode == 2
    assert "nothing to stop" in empty.run("down").stdout
    # a failed preflight submits nothing (exit 3): a node with 4 GPUs declared, none found
    cluster = tmp_path / "gpu-cluster.yaml"
    cluster.write_text(
        yaml.safe_dump({"nodes": [{"name": "local", "host": "localhost", "gpus": 4}]})
    )
    before = {r["job_id"] for r in json.loads(jobs.run("list", "--json").stdout)}
    failed = jobs.run("submit", str(ROOT / "jobs/quickstart.yaml"), "--cluster", str(cluster))
    assert failed.returncode == 3, failed.stdout[-2000:] + failed.stderr[-2000:]
    assert {r["job_id"] for r in json.loads(jobs.run("list", "--json").stdout)} == before


def test_jobs_api_needs_the_token(jobs):
    from launcher.jobs.head import api_status

    head = jobs.head()
    url = f"http://127.0.0.1:{head['dashboard_port']}"
    token = Path(head["token_file"]).read_text().strip()
    assert api_status(url, None) == 401
    assert api_status(url, "0" * 64) in (401, 403)
    assert api_status(url, token) == 200
    assert oct(Path(head["token_file"]).stat().st_mode & 0o777) == "0o600"
    # bound to 127.0.0.1 only
    listening = subprocess.run(
        ["ss", "-ltnH", f"sport = :{head['dashboard_port']}"], capture_output=True, text=True
    ).stdout
    assert listening and all("127.0.0.1:" in line for line in listening.splitlines()), listening


def test_attached_cluster_at_its_jobs_address(jobs, tmp_path):
    # A Ray the launcher did not start (here: the module's head, reached as a user's cluster):
    # ray.address and ray.jobs_address given, Ray's own token from RAY_AUTH_TOKEN_PATH.
    head = jobs.head()
    cluster = tmp_path / "attached.yaml"
    cluster.write_text(
        yaml.safe_dump(
            {
                "nodes": [{"name": "local", "host": "localhost"}],
                "ray": {
                    "address": f"127.0.0.1:{head['gcs_port']}",
                    "jobs_address": f"http://127.0.0.1:{head['dashboard_port']}",
                },
            }
        )
    )
    # no launcher state: nothing of ours is used
    attached = Jobs(tmp_path / "no-state", tmp_path, "--cluster", str(cluster))
    attached.env["RAY_AUTH_TOKEN_PATH"] = head["token_file"]
    job_id = attached.submit("--skip-parity", *QUICK)["job_id"]
    state = attached.wait_status(job_id, ENDED, timeout=180)
    assert state["status"] == "SUCCEEDED" and state["tokens_per_s"] > 0, state
    down = attached.run("down")
    assert down.returncode == 0 and "is not the launcher's" in down.stdout
    assert jobs.head()["pid"] == head["pid"]  # used as it is: still running
    del attached.env["RAY_AUTH_TOKEN_PATH"]  # without the token the Jobs API refuses
    refused = attached.run("status")
    assert refused.returncode != 0 and job_id not in refused.stdout


def test_ctrl_c_while_the_head_starts_leaves_no_head_behind(tmp_path):
    """SIGINT to `launch submit` while it starts the launcher's Ray head (before head.json names
    it, so no later `launch down` could find it): exit 130, and the half-started head is stopped."""
    state = tmp_path / "state"
    env = {**os.environ, "LAUNCHER_STATE_DIR": str(state), "RAY_USAGE_STATS_ENABLED": "0"}
    token = str(state / "local/auth_token")

    def head_processes() -> list[int]:
        return [pid for pid in processes() if env_of(pid).get("RAY_AUTH_TOKEN_PATH") == token]

    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher", "submit", str(ROOT / "jobs/quickstart.yaml")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(head_processes, timeout=60, what="the head's first process", proc=proc)
        assert not (state / "local/head.json").exists(), (
            "the head was up before the signal: no test"
        )
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 130, err[-3000:]
        assert "Traceback" not in err
        assert not (state / "local/head.json").exists()
        wait_for(
            lambda: not head_processes(), timeout=30, what="the half-started head to be stopped"
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill(head_processes())


def test_a_foreground_run_attaches_to_the_running_head(jobs, tmp_path):
    """``launch up`` finds the module's head running; a foreground run on this machine uses it
    instead of starting Ray, and leaves it running."""
    up = jobs.run("up")
    assert up.returncode == 0 and "runs on this machine" in up.stdout, up.stdout + up.stderr
    pid = up.stdout.split("pid ")[1].split(")")[0]
    run_dir = tmp_path / "foreground"
    run = jobs.run(
        "run", str(ROOT / "jobs/quickstart.yaml"), *QUICK, "--run-dir", str(run_dir), timeout=300
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Using the launcher's Ray head on this machine" in run.stdout
    assert "Starting an embedded Ray" not in run.stdout + run.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["launcher_timings_s"]["ray"] >= 0
    again = jobs.run("up")
    assert again.returncode == 0 and f"pid {pid})" in again.stdout


def test_a_detached_job_gets_the_submitting_shells_environment(jobs, tmp_path, monkeypatch):
    """As a foreground run: the submitting shell's variables reach the workers (the head is
    this machine: all of them), and `launch logs` shows the job's lines, not Ray's."""
    (tmp_path / "env.py").write_text(
        "import os\n"
        "print('SEEN', os.environ.get('MY_OWN_SETTING'), os.environ.get('WANDB_MODE'), flush=True)\n"
    )
    job = write_job(
        tmp_path, {"script": "env.py"}, resources={"nproc_per_node": 1, "device": "cpu"}
    )
    monkeypatch.setitem(jobs.env, "MY_OWN_SETTING", "from-the-submitter")  # this test's alone
    monkeypatch.setitem(jobs.env, "WANDB_MODE", "offline")
    job_id = jobs.submit("--skip-parity", job=job)["job_id"]
    state = jobs.wait_status(job_id, {"SUCCEEDED", "FAILED"}, timeout=240)
    logs = jobs.run("logs", job_id).stdout
    assert state["status"] == "SUCCEEDED", logs[-3000:]
    assert "SEEN from-the-submitter offline" in logs
    assert "job_manager.py" not in logs and "Running entrypoint" not in logs
    assert "job_manager.py" in (Path(state["run_dir"]) / "logs/ray.log").read_text()


def test_a_run_dir_marked_for_a_job_is_refused_until_it_is_removed(jobs, slow, tmp_path):
    """The first submission marks the folder for its job; a second one given the same
    --run-dir is refused (exit 2, naming the remedy) while the folder is there, also after the
    first job ended; removed, the folder is the next job's. The first job ends by its driver
    being SIGKILLed: it fails within 30 s, naming the driver's exit, and leaves no worker."""
    folder = tmp_path / "shared"

    def submit(*extra: str):
        args = ("--json", "--skip-parity", "--run-dir", str(folder), *extra)
        return jobs.run("submit", str(ROOT / "jobs/quickstart.yaml"), *args)

    result = submit(*slow)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    first = submitted(result)["job_id"]
    try:
        refused = submit()
        assert refused.returncode == 2, refused.stderr
        assert f"--run-dir {folder}" in refused.stderr and "remove" in refused.stderr
        jobs.wait_step(first)
        drivers = [
            pid for pid, cmd in job_processes(first).items() if "launcher.jobs.driver" in cmd
        ]
        assert len(drivers) == 1, job_processes(first)
    except BaseException:
        jobs.run("stop", first, timeout=60)
        raise
    os.kill(drivers[0], signal.SIGKILL)
    state = jobs.wait_status(first, ENDED, timeout=30)  # seen by a poll begun within 30 s
    assert state["status"] == "FAILED", state
    assert "exit code -9" in state["failure"]["reason"], state["failure"]
    assert_job_gone(first, wait_s=30)

    assert submit().returncode == 2  # the folder is still there: one run per folder
    shutil.rmtree(folder)
    result = submit()
    assert result.returncode == 0, result.stderr[-2000:]
    second = submitted(result)["job_id"]
    try:
        assert jobs.status(second)["run_dir"] == str(folder)
    finally:
        assert jobs.run("stop", second, timeout=90).returncode == 0
        assert jobs.status(second)["status"] == "STOPPED"
