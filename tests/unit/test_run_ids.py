"""Run ids and run directories: each launch's node folders are its own, and a run directory
holds one run. Nothing is started: fake agents record what the launch asked of them."""

from __future__ import annotations

import json
import os

import pytest

from launcher.cli import main
from launcher.errors import UsageError
from launcher.orchestrate import run as run_mod
from launcher.orchestrate.run import Launch
from launcher.orchestrate.rundir import RunDir
from launcher.spec import ClusterSpec, JobSpec


@pytest.fixture(autouse=True)
def own_state(tmp_path, monkeypatch):
    """This user's launcher state is the test's own: no record of a real head here is read."""
    monkeypatch.setenv("LAUNCHER_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def job() -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "t",
            "resources": {"device": "cpu", "nproc_per_node": 1},
            "precision": {"dtype": "fp32"},
            "train": {"steps": 5, "warmup_steps": 1},
        }
    )


def cluster() -> ClusterSpec:
    return ClusterSpec.model_validate(
        {"nodes": [{"name": "a", "host": "198.18.0.10"}, {"name": "b", "host": "198.18.0.11"}]}
    )


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


def test_a_run_dir_that_holds_a_run_is_refused_before_anything_starts(
    tmp_path, monkeypatch, capsys
):
    """Launching into a folder that holds an earlier run would mix logs, metrics and summaries:
    exit 2, one paragraph naming the folder and the way out, nothing started or written."""
    old = tmp_path / "old"
    (old / "logs").mkdir(parents=True)
    (old / "summary.json").write_text('{"status": "succeeded"}')
    before = sorted(p.relative_to(old) for p in old.rglob("*"))
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        "name: q\nresources: {device: cpu, nproc_per_node: 1}\nprecision: {dtype: fp32}\n"
    )

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
    job_file.write_text(
        "name: q\nresources: {device: cpu, nproc_per_node: 1}\nprecision: {dtype: fp32}\n"
    )
    (tmp_path / "cluster.yaml").write_text("nodes: [{name: local, host: localhost}]\n")

    def started_anything(*args, **kwargs):
        raise AssertionError("the submission went on")

    monkeypatch.setattr("launcher.preflight.preflight_facts", started_anything)
    monkeypatch.setattr(commands, "connect", started_anything)
    assert (
        main(
            [
                "submit",
                str(job_file),
                "--cluster",
                str(tmp_path / "cluster.yaml"),
                "--run-dir",
                str(old),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"--run-dir {old} is not empty" in err and err.count("\n") == 1


def test_a_submissions_reservation_is_taken_by_its_own_job_only(tmp_path):
    """`launch submit` to a head on this machine reserves the folder for its job; nothing else
    (a foreground run, another job's driver, another submission) gets it, the job's driver does."""
    path = tmp_path / "r"
    RunDir.reserve(path, "job-1")
    assert sorted(p.name for p in path.iterdir()) == [".launcher-job", "logs"]
    for take in (
        lambda: RunDir.claim(path),
        lambda: RunDir.claim(path, job_id="job-2"),
        lambda: RunDir.reserve(path, "job-2"),
    ):
        with pytest.raises(
            UsageError, match=r"is reserved for job job-1, submitted before .*`launch status job-1`"
        ):
            take()
    taken = RunDir.claim(path, job_id="job-1")
    assert taken.root == path and [p.name for p in path.iterdir()] == [
        "logs"
    ]  # the reservation is gone
    with pytest.raises(UsageError, match="is not empty"):  # now the job's own: taken once
        RunDir.claim(path, job_id="job-1")


def test_a_reservation_written_into_since_is_refused_to_its_job(tmp_path):
    path = tmp_path / "r"
    RunDir.reserve(path, "job-1")
    (path / "summary.json").write_text("{}")
    with pytest.raises(
        UsageError, match=r"reserved for this job .* put into it since \(summary.json\)"
    ):
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
    job_file.write_text(
        "name: q\nresources: {device: cpu, nproc_per_node: 1}\nprecision: {dtype: fp32}\n"
    )
    (tmp_path / "cluster.yaml").write_text("nodes: [{name: local, host: localhost}]\n")
    monkeypatch.setattr("launcher.preflight.preflight_facts", lambda *a, **k: None)
    monkeypatch.setenv("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0")  # submit sets it: restored after
    client = types.SimpleNamespace(submitted=[], error=None, status={})  # status: job id -> Ray's

    def submit_job(**kw):
        if client.error is not None:
            raise client.error
        client.submitted.append(kw)

    client.submit_job = submit_job

    def jobs():  # JobsCluster.jobs: what was submitted, each PENDING unless told
        return [
            types.SimpleNamespace(
                submission_id=kw["submission_id"],
                status=types.SimpleNamespace(
                    value=client.status.get(kw["submission_id"], "PENDING")
                ),
            )
            for kw in client.submitted
        ]

    @contextlib.contextmanager
    def connect(spec, *, start=False):
        yield types.SimpleNamespace(
            head_is_local=True,
            cluster=spec,
            client=client,
            head=spec.nodes[0],
            local_head=None,
            jobs=jobs,
        )

    monkeypatch.setattr(commands, "connect", connect)

    def submit(run_dir, capsys):
        rc = main(
            [
                "submit",
                str(job_file),
                "--cluster",
                str(tmp_path / "cluster.yaml"),
                "--run-dir",
                str(run_dir),
                "--json",
            ]
        )
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
    assert (
        out.err.startswith(f"error: --run-dir {run_dir} is reserved for job {first}")
        and out.err.count("\n") == 1
    )


def test_a_submission_that_fails_frees_its_run_dir(tmp_path, local_submit, capsys):
    from launcher.errors import PreflightError

    submit, client = local_submit
    client.error = PreflightError(
        "the Ray Jobs API at http://127.0.0.1:1 failed (submit_job): boom"
    )
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
    (tmp_path / "submission.json").write_text(
        json.dumps(
            {"job_id": job_id, "job": job().model_dump(mode="json"), "run_dir": str(run_dir)}
        )
    )
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
    assert (
        f"error: --run-dir {old} is not empty (summary.json)" in log and "Pick a new folder" in log
    )
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


# -- reservations whose job can no longer take them ------------------------------------------------


def test_a_submission_takes_over_the_reservation_of_a_job_that_ended_before_its_driver_ran(
    tmp_path, local_submit, capsys, caplog
):
    """The first job was stopped while it waited (or its runtime_env failed): its driver never
    took the folder, and never will. A later submission to the same Jobs API sees that and
    takes the folder; while the first job still waits, it is refused."""
    import logging

    caplog.set_level(logging.INFO)
    submit, client = local_submit
    run_dir = tmp_path / "shared"
    rc, out = submit(run_dir, capsys)
    first = json.loads(out.out)["job_id"]
    rc, out = submit(run_dir, capsys)
    assert rc == 2 and f"reserved for job {first}" in out.err and "still pending" in out.err
    client.status[first] = "STOPPED"
    rc, out = submit(run_dir, capsys)
    assert rc == 0, out.err
    second = json.loads(out.out)["job_id"]
    assert (
        f"was reserved for job {first}, which ended (STOPPED) before its driver took it"
        in caplog.text
    )
    assert (run_dir / ".launcher-job").read_text().splitlines()[0] == second
    assert sorted(p.name for p in run_dir.iterdir()) == [".launcher-job", "logs"]


def local_head_record(tmp_path, pid: int, port: int = 1):
    """What a reservation records of a local head (``head.reservation_head``): who it is."""
    from launcher.jobs import head

    return head.reservation_head(
        head.LocalHead(
            pid=pid,
            gcs_port=1,
            dashboard_port=port,
            agent_port=1,
            temp_dir=str(tmp_path / "ray-temp"),
            token_file=str(tmp_path / "auth_token"),
        )
    )


def gone_pid() -> int:
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """This machine's id is the test's (``/etc/machine-id`` may be missing): returns a function
    that changes it."""
    from launcher.jobs import head

    path = tmp_path / "machine-id"
    path.write_text("0123456789abcdef0123456789abcdef\n")
    monkeypatch.setattr(head, "MACHINE_ID", str(path), raising=False)

    def change(text: str | None) -> None:
        if text is None:
            path.unlink()
        else:
            path.write_text(text + "\n")

    return change


def test_a_run_takes_over_the_reservation_of_a_job_whose_local_head_is_gone(tmp_path, caplog):
    """`launch down --yes` (or a crash) while the job waited: the head it went to runs no more,
    and its jobs went with it. `launch run` and `launch submit` take the folder, without a Jobs
    API and without starting Ray (the head's process is looked up in /proc)."""
    import logging

    caplog.set_level(logging.INFO)
    record = local_head_record(tmp_path, gone_pid())
    path = tmp_path / "r"
    RunDir.reserve(path, "job-1", head=record)
    taken = RunDir.claim(path)  # launch run --run-dir
    assert taken.root == path and [p.name for p in path.iterdir()] == ["logs"]
    assert (
        "reserved for job job-1, whose Ray runs no more: this run takes the folder" in caplog.text
    )
    other = tmp_path / "s"
    RunDir.reserve(other, "job-1", head=record)
    RunDir.check_free(other)  # submit's first look leaves it to the reservation
    RunDir.reserve(other, "job-2")  # launch submit --run-dir
    assert (other / ".launcher-job").read_text().strip() == "job-2"


def test_a_reservation_made_on_another_machine_or_boot(tmp_path, machine):
    """A shared home directory: a head recorded on another machine cannot be looked at from
    here (the folder stays reserved); one recorded on this machine before it rebooted is gone."""
    path = tmp_path / "r"
    RunDir.reserve(
        path, "job-1", head={**local_head_record(tmp_path, gone_pid()), "host": "elsewhere"}
    )
    with pytest.raises(UsageError, match=r"reserved for job job-1, submitted before .*cannot ask"):
        RunDir.claim(path)
    with pytest.raises(UsageError, match="reserved for job job-1"):
        RunDir.reserve(path, "job-2")
    RunDir.check_free(path)  # left to the submission's Jobs API
    rebooted = tmp_path / "b"
    RunDir.reserve(
        rebooted, "job-1", head={**local_head_record(tmp_path, 1), "boot": "another-boot"}
    )
    assert RunDir.claim(rebooted).root == rebooted


def test_a_machine_of_the_same_name_is_another_machine(tmp_path, machine):
    """Two machines named alike share a home directory: the other's boot id differs from this
    one's, which is no reboot of this machine; its machine id differs too. Its head may run: the
    folder stays reserved. Without a machine id, another boot cannot be told from another
    machine: it stays reserved too."""
    path = tmp_path / "r"
    record = local_head_record(tmp_path, gone_pid())
    RunDir.reserve(path, "job-1", head={**record, "machine": "f" * 32, "boot": "its-boot"})
    with pytest.raises(UsageError, match="reserved for job job-1"):
        RunDir.claim(path)
    machine(None)  # no /etc/machine-id here
    for n, head in enumerate(
        ({**record, "machine": None, "boot": "its-boot"}, {**record, "boot": "its-boot"})
    ):
        RunDir.reserve(tmp_path / f"s{n}", "job-1", head=head)
        with pytest.raises(UsageError, match="reserved for job job-1"):
            RunDir.claim(tmp_path / f"s{n}")
    same = tmp_path / "t"  # this boot, no machine id: the head's process tells
    RunDir.reserve(same, "job-1", head={**record, "machine": None})
    assert RunDir.claim(same).root == same


def test_only_the_reservations_own_user_takes_it_for_gone(tmp_path, monkeypatch):
    """Another user's head (hidepid hides its processes) or a head in another PID namespace is
    not seen in /proc: not seeing it proves nothing, and the folder stays reserved."""
    from launcher.jobs import head

    path = tmp_path / "r"
    record = local_head_record(tmp_path, gone_pid())
    RunDir.reserve(path, "job-1", head=record)
    me = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: me + 1)  # the file is another user's
    with pytest.raises(UsageError, match="reserved for job job-1"):
        RunDir.claim(path)
    monkeypatch.setattr(os, "getuid", lambda: me)
    real = head._pid_namespace
    monkeypatch.setattr(head, "_pid_namespace", lambda: "pid:[1]")
    with pytest.raises(UsageError, match="reserved for job job-1"):
        RunDir.claim(path)
    monkeypatch.setattr(head, "_pid_namespace", real)
    assert RunDir.claim(path).root == path


def this_machine() -> dict[str, str | None]:
    """What a reservation made here says of this machine."""

    def read(path: str) -> str | None:
        try:
            return open(path).read().strip() or None
        except OSError:
            return None

    return {
        "host": os.uname().nodename,
        "machine": read("/etc/machine-id"),
        "boot": read("/proc/sys/kernel/random/boot_id"),
        "pidns": os.readlink("/proc/self/ns/pid"),
    }


@pytest.fixture
def jobs_api():
    """A local head's Jobs API, its one route this needs: GET /api/jobs/<id> with the token (a
    status ``redirect:URL`` answers 302 to URL)."""
    port, statuses, _ = _serve(_jobs_api_handler)
    yield port, statuses


@pytest.fixture
def listener():
    """Something else listening on 127.0.0.1: what it was asked (method, path, headers), and
    for every request an answer that would free the folder (FAILED)."""
    port, _, asked = _serve(_listener_handler)
    yield port, asked


_servers: list = []


def _serve(handler_of):
    import http.server
    import threading

    statuses: dict[str, str] = {}
    asked: list = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler_of(statuses, asked))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _servers.append(server)
    return server.server_address[1], statuses, asked


@pytest.fixture(autouse=True)
def _stop_servers():
    yield
    while _servers:
        server = _servers.pop()
        server.shutdown()
        server.server_close()


def _answering():
    """A quiet request handler with ``answer(code, body, location)``: JSON, length, headers."""
    import http.server

    class Answering(http.server.BaseHTTPRequestHandler):
        def answer(self, code, body=None, location=None):
            data = json.dumps(body).encode() if body is not None else b""
            self.send_response(code)
            if location:
                self.send_header("Location", location)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    return Answering


def _jobs_api_handler(statuses, asked):
    class Handler(_answering()):
        def do_GET(self):  # noqa: N802
            job_id = self.path.removeprefix("/api/jobs/")
            if self.headers.get("Authorization") != "Bearer secret":
                return self.answer(401)
            if job_id not in statuses:
                return self.answer(404)
            if statuses[job_id].startswith("redirect:"):
                return self.answer(302, location=statuses[job_id].removeprefix("redirect:"))
            return self.answer(200, {"submission_id": job_id, "status": statuses[job_id]})

    return Handler


def _listener_handler(statuses, asked):
    class Handler(_answering()):
        def do_GET(self):  # noqa: N802
            asked.append(("GET", self.path, dict(self.headers)))
            self.answer(200, {"status": "FAILED", "ray_version": "9.9.9", "version": "9"})

    return Handler


@pytest.fixture
def own_head(tmp_path, own_state, jobs_api):
    """This user's running local head as its record (``head.json``) names it: a process whose
    command line names the head's temp dir (as each of the head's does), its Jobs API
    (``jobs_api``), its token ("secret")."""
    import subprocess
    import sys
    import time
    from dataclasses import asdict

    from launcher.jobs import head

    port, _ = jobs_api
    folder = own_state / "local"
    folder.mkdir(parents=True)
    (folder / "auth_token").write_text("secret\n")
    temp_dir = str(tmp_path / "launcher-ray-own")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", temp_dir])
    try:
        me = head.LocalHead(
            pid=proc.pid,
            gcs_port=61001,
            dashboard_port=port,
            agent_port=61002,
            temp_dir=temp_dir,
            token_file=str(folder / "auth_token"),
        )
        (folder / "head.json").write_text(json.dumps(asdict(me)))
        deadline = time.monotonic() + 10
        while (
            not head._is_head(me) and time.monotonic() < deadline
        ):  # its command line, once exec'd
            time.sleep(0.02)
        yield me
    finally:
        proc.kill()
        proc.wait()


def test_a_run_asks_the_running_local_head_whether_the_reserved_job_ended(
    tmp_path, jobs_api, own_head
):
    """The head runs, and it is this user's own (its record names it): one request to its Jobs
    API, with the token of that record, says where the job stands. Waiting or running: refused,
    naming it; ended (stopped while it waited): taken; unknown to the head, or a refused token:
    refused (nothing is assumed)."""
    from launcher.jobs import head

    port, statuses = jobs_api
    path = tmp_path / "r"
    RunDir.reserve(path, "job-1", head=head.reservation_head(own_head))
    statuses["job-1"] = "PENDING"
    with pytest.raises(
        UsageError, match=r"reserved for job job-1, .* still pending \(`launch status job-1`\)"
    ):
        RunDir.claim(path)
    with pytest.raises(UsageError, match="still pending"):
        RunDir.check_free(path)
    del statuses["job-1"]
    with pytest.raises(UsageError, match="cannot ask"):
        RunDir.claim(path)
    statuses["job-1"] = "FAILED"
    token = own_head.token_file
    with open(token, "w") as fh:
        fh.write("wrong\n")
    with pytest.raises(UsageError, match="cannot ask"):
        RunDir.claim(path)
    with open(token, "w") as fh:
        fh.write("secret\n")
    assert RunDir.claim(path).root == path
    assert [p.name for p in path.iterdir()] == ["logs"]


# -- a reservation is an identity, never an address or a token --------------------------------------


def test_a_forged_reservation_sends_no_token_anywhere(tmp_path, jobs_api, own_head, listener):
    """Anyone who can write the folder can write its reservation: a head block naming pid 1, an
    empty temp dir (named by every process), the victim's token file (or any file it can read)
    and a port someone else listens on. The victim's run and submission send nothing there, and
    read no file it names: the head block is only compared with the victim's own head's record.
    A block naming the victim's own running head with another port is not that head either."""
    from dataclasses import asdict

    from launcher.jobs import head

    port, asked = listener
    _, statuses = jobs_api
    statuses["job-1"] = "FAILED"  # what the victim's own head would say of it
    here = this_machine()
    forged = [
        {
            "pid": 1,
            "gcs_port": 1,
            "dashboard_port": port,
            "agent_port": 1,
            "temp_dir": "",
            "token_file": own_head.token_file,
            **here,
        },
        {**asdict(own_head), "dashboard_port": port, **here},
        {
            **head.reservation_head(own_head),
            "dashboard_port": port,
            "token_file": own_head.token_file,
        },
    ]
    for n, record in enumerate(forged):
        path = tmp_path / f"r{n}"
        (path / "logs").mkdir(parents=True)
        (path / ".launcher-job").write_text("job-1\n" + json.dumps({"head": record}) + "\n")
        with pytest.raises(UsageError, match="reserved for job job-1"):
            RunDir.claim(path)
        RunDir.check_free(path)
        with pytest.raises(UsageError, match="reserved for job job-1"):
            RunDir.reserve(path, "job-2")
        assert (path / ".launcher-job").read_text().startswith("job-1\n")
    assert asked == []


def test_the_head_is_asked_without_a_redirect_or_a_proxy(
    tmp_path, jobs_api, own_head, listener, monkeypatch
):
    """The token goes to the own head's 127.0.0.1 only: a redirect (urllib's handler would
    resend the Authorization header) is not followed, and http_proxy is not used."""
    from launcher.jobs import head

    port, asked = listener
    _, statuses = jobs_api
    statuses["job-1"] = f"redirect:http://127.0.0.1:{port}/api/jobs/job-1"
    path = tmp_path / "r"
    RunDir.reserve(path, "job-1", head=head.reservation_head(own_head))
    with pytest.raises(UsageError, match="cannot ask"):
        RunDir.claim(path)
    assert head._job_status(own_head.jobs_url, "secret", "job-1") is None
    statuses["/api/version"] = f"redirect:http://127.0.0.1:{port}/api/version"
    assert head.api_status(own_head.jobs_url, "secret") == 302
    assert asked == []
    del statuses["/api/version"]
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{port}")
    statuses["job-1"] = "FAILED"
    assert head._job_status(own_head.jobs_url, "secret", "job-1") == "FAILED"
    assert head.api_status(own_head.jobs_url, "secret") == 404  # the head's own answer, unproxied
    assert asked == []


def test_rays_jobs_client_bypasses_the_proxy_for_a_heads_loopback(jobs_api, listener, monkeypatch):
    """Ray's JobSubmissionClient uses requests, which follows http_proxy: for a head's 127.0.0.1
    (the local head, the SSH tunnel's end) the launcher adds 127.0.0.1 and localhost to
    no_proxy first, keeping what was there."""
    import sys
    import types

    import requests

    from launcher.jobs import api

    port, asked = listener
    api_port, statuses = jobs_api
    statuses["x"] = "RUNNING"
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.setenv("NO_PROXY", "example.com")
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{port}")

    class Client:  # as Ray's: a request at once (its version check)
        def __init__(self, url, headers=None):
            self.status = requests.get(f"{url}/api/jobs/x", headers=headers, timeout=5).status_code

    monkeypatch.setitem(
        sys.modules, "ray.job_submission", types.SimpleNamespace(JobSubmissionClient=Client)
    )
    client = api._client(f"http://127.0.0.1:{api_port}", "secret")
    assert client.status == 200 and asked == []
    assert os.environ["no_proxy"].split(",") == ["example.com", "127.0.0.1", "localhost"]
    assert os.environ["NO_PROXY"] == os.environ["no_proxy"]


def test_a_linked_or_special_reservation_file_is_not_trusted(tmp_path):
    """A reservation with a second link (someone's file linked in) is not taken for this
    user's; a FIFO in its place is never waited on."""
    import threading

    path = tmp_path / "r"
    RunDir.reserve(path, "job-1", head=local_head_record(tmp_path, gone_pid()))
    os.link(path / ".launcher-job", tmp_path / "elsewhere")
    with pytest.raises(UsageError, match="reserved for job job-1"):
        RunDir.claim(path)
    fifo = tmp_path / "f"
    (fifo / "logs").mkdir(parents=True)
    os.mkfifo(fifo / ".launcher-job")
    result: list = []

    def claim():
        try:
            RunDir.claim(fifo)
        except UsageError as err:
            result.append(str(err))

    worker = threading.Thread(target=claim, daemon=True)
    worker.start()
    worker.join(10)
    assert result and "reserved by a submission" in result[0]


# -- a submission cut off between its reservation and Ray -------------------------------------------


def test_a_reservation_whose_submission_was_cut_off_is_taken_under_the_jobs_lock(
    tmp_path, jobs_api, own_head, caplog
):
    """A submission reserves the folder and hands Ray the job under the head's jobs_lock: killed
    in between, its reservation names a job the head does not know. A later submission to the
    same head, holding that lock, takes the folder; without the lock (a run, a first look), or
    for another head, an unknown job tells nothing."""
    import logging

    from launcher.jobs import head

    caplog.set_level(logging.INFO)
    local = ClusterSpec.model_validate({"nodes": [{"name": "local", "host": "localhost"}]})
    path = tmp_path / "r"
    RunDir.reserve(path, "job-1", head=head.reservation_head(own_head))
    with pytest.raises(UsageError, match="cannot ask"):
        RunDir.claim(path)
    RunDir.check_free(path)
    other = tmp_path / "o"  # the head of another state folder of this user's, running
    RunDir.reserve(other, "job-1", head={**head.reservation_head(own_head), "gcs_port": 61003})
    with head.jobs_lock(local):
        with pytest.raises(UsageError, match="reserved for job job-1"):
            RunDir.reserve(other, "job-3", lookup=lambda job_id: None)
        RunDir.reserve(path, "job-2", lookup=lambda job_id: None)
    assert (path / ".launcher-job").read_text().splitlines()[0] == "job-2"
    assert (
        "reserved for job job-1, whose submission was cut off before Ray had the job" in caplog.text
    )


# -- the reservation's own lock for undoing it, and undoing a cut-off reservation -------------------


def test_a_release_waits_for_a_take_over_and_leaves_its_reservation(tmp_path):
    """A submission that fails releases its reservation under the reservation's lock: a run that
    took the folder over meanwhile (its job taken for ended) keeps its own reservation."""
    import threading
    import time

    from launcher.orchestrate import rundir

    path = tmp_path / "r"
    path.mkdir()
    release = RunDir.reserve(path, "job-1")
    late = threading.Thread(target=release)
    with rundir._holding(path, "job-1") as held:  # a submission taking it over holds it
        assert held
        late.start()
        time.sleep(0.3)
        assert (path / ".launcher-job").exists() and (path / "logs").is_dir()  # release waits
        rundir.Reservation("job-2").write(path)
    late.join(10)
    assert (path / ".launcher-job").read_text().strip() == "job-2" and (path / "logs").is_dir()


def test_a_reservation_cut_off_half_made_is_undone(tmp_path, monkeypatch):
    """Ctrl-C (or any error) between making logs/ and writing the reservation: logs/ goes too,
    else the folder would be refused for good as "not empty (logs/)". A folder made for a run
    whose logs/ cannot be made goes as well."""
    from pathlib import Path

    from launcher.orchestrate import rundir

    def interrupted(self, path):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(rundir.Reservation, "write", interrupted)
        with pytest.raises(KeyboardInterrupt):
            RunDir.reserve(tmp_path / "a" / "b", "job-1")
        (tmp_path / "empty").mkdir()
        with pytest.raises(KeyboardInterrupt):
            RunDir.reserve(tmp_path / "empty", "job-1")
    assert not (tmp_path / "a").exists()
    assert list((tmp_path / "empty").iterdir()) == []
    RunDir.reserve(tmp_path / "empty", "job-2")  # free again
    real_mkdir = Path.mkdir

    def no_logs(self, *a, **k):
        if self.name == "logs":
            raise PermissionError(13, "Permission denied")
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", no_logs)
    with pytest.raises(UsageError, match="cannot make the run directory"):
        RunDir.claim(tmp_path / "c" / "d")
    assert not (tmp_path / "c").exists()


def test_the_driver_of_a_job_whose_reservation_was_taken_over_is_refused(tmp_path, monkeypatch):
    """A job stopped while it waited whose driver starts all the same (late): the folder was
    taken over, so the driver writes nothing into it."""
    path = tmp_path / "r"
    RunDir.reserve(path, "q-1", head=local_head_record(tmp_path, gone_pid()))
    RunDir.reserve(path, "q-2")  # taken over by a later submission
    rc, log, got = driven(tmp_path, monkeypatch, path, job_id="q-1")
    assert rc == 2 and got is None and "reserved for job q-2" in log
    assert (path / ".launcher-job").read_text().strip() == "q-2"


def test_of_two_taking_a_reservation_one_gets_it(tmp_path):
    """The job's driver, started late, and a run taking the reservation over at the same time:
    each holds the reservation locked and checks it is still the same file naming the same job,
    so the one that comes second finds it replaced, and takes nothing."""
    import threading
    import time

    from launcher.orchestrate import rundir

    path = tmp_path / "r"
    RunDir.reserve(path, "job-1")
    result: dict[str, str] = {}

    def driver() -> None:
        try:
            rundir._take(path, "job-1")
            result["driver"] = "took it"
        except UsageError as err:
            result["driver"] = str(err)

    late = threading.Thread(target=driver)
    with rundir._holding(path, "job-1") as held:  # a later run taking it over holds it
        assert held
        late.start()
        time.sleep(0.3)
        assert "driver" not in result  # waits for the lock
        rundir.Reservation("job-2").write(path)  # ... and hands it to its own job
    late.join(10)
    assert "is reserved for job job-2" in result["driver"]
    assert (path / ".launcher-job").read_text().strip() == "job-2"
    with rundir._holding(path, "job-1") as held:
        assert not held


# -- a reservation the job's driver can read (C) ---------------------------------------------------


def test_the_reservation_is_readable_by_a_driver_of_another_user(tmp_path):
    """An attached Ray someone else started on this machine runs the job's driver as that user:
    the reservation holds no secret and is not private to the submitter."""
    import stat

    RunDir.reserve(tmp_path / "r", "job-1", head=local_head_record(tmp_path, 1))
    mode = stat.S_IMODE((tmp_path / "r" / ".launcher-job").stat().st_mode)
    assert mode & 0o044 == 0o044 & ~_umask()
    text = (tmp_path / "r" / ".launcher-job").read_text()
    assert "secret" not in text and "auth_token" not in text  # not even the token's path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_reservation_this_user_cannot_read_is_named_as_such(tmp_path, monkeypatch):
    from launcher.orchestrate import rundir

    path = tmp_path / "r"
    RunDir.reserve(path, "job-1")

    def denied(folder):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(rundir, "_open_reservation", denied)  # the one way the file is opened
    with pytest.raises(
        UsageError,
        match=r"reserved by a submission, and user \S+ cannot read .*Permission denied.*"
        r"as the user that started the cluster's Ray",
    ):
        RunDir.claim(path, job_id="job-1")


# -- status and fetch of a job without a run directory (A) ------------------------------------------


@pytest.fixture
def jobs_here(tmp_path, monkeypatch):
    """The job commands against a fake Jobs API of a head on this machine: ``add(job id, Ray
    status, run_dir, log)``, then run ``launch status|fetch``."""
    import contextlib
    import types

    from launcher.jobs import commands

    (tmp_path / "cluster.yaml").write_text("nodes: [{name: local, host: localhost}]\n")
    known: dict[str, tuple] = {}

    def add(job_id, status, run_dir, log=""):
        known[job_id] = (
            types.SimpleNamespace(
                submission_id=job_id,
                status=types.SimpleNamespace(value=status),
                message=None,
                metadata={
                    "launcher": "x",
                    "name": "q",
                    "run_dir": str(run_dir),
                    "nodes": "1",
                    "world_size": "1",
                },
                start_time=1,
                end_time=2,
                runtime_env={},
            ),
            log,
        )

    def job(job_id):
        if job_id not in known:
            raise UsageError(f"no job {job_id!r}")
        return known[job_id][0]

    @contextlib.contextmanager
    def connect(spec, *, start=False):
        yield types.SimpleNamespace(
            head_is_local=True,
            cluster=spec,
            head=spec.nodes[0],
            job=job,
            logs=lambda d: known[d.submission_id][1],
        )

    monkeypatch.setattr(commands, "connect", connect)
    return add, ["--cluster", str(tmp_path / "cluster.yaml")]


def test_fetch_of_a_job_whose_driver_refused_its_run_dir_copies_nothing(
    tmp_path, monkeypatch, jobs_here, capsys
):
    """The folder given at submission held an earlier run: the driver refused it (exit 2). The
    folder is that run's, not the job's: `fetch` copies nothing and says why (exit 2), `status`
    shows no run directory (null in --json)."""
    add, flags = jobs_here
    old = tmp_path / "old"
    old.mkdir()
    (old / "summary.json").write_text('{"status": "succeeded", "job": "someone-else"}')
    import sys

    console = sys.stdout
    rc, log, _ = driven(tmp_path, monkeypatch, old, job_id="q-1")
    assert rc == 2
    monkeypatch.setattr("sys.stdout", console)
    add("q-1", "FAILED", old, log)
    dest = tmp_path / "fetched"
    assert main(["fetch", "q-1", *flags, "--to", str(dest)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(
            f"error: job q-1 has no run directory to fetch (FAILED): its driver refused {old}"
        )
        and "launch logs q-1" in err
        and err.count("\n") == 1
    )
    assert not dest.exists()
    assert main(["status", "q-1", *flags, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (
        shown["run_dir"] is None and f"--run-dir {old} is not empty" in shown["failure"]["reason"]
    )
    assert main(["status", "q-1", *flags]) == 0
    assert f"run dir: none — its driver refused {old}" in capsys.readouterr().out


def test_fetch_of_a_job_that_ended_before_its_driver_started_copies_nothing(
    tmp_path, jobs_here, capsys
):
    """Stopped while Ray had not started its driver: the folder was reserved, never this job's,
    and may hold a later run by now (its reservation was taken over)."""
    add, flags = jobs_here
    later = tmp_path / "r"
    later.mkdir()
    (later / "summary.json").write_text("{}")  # a later run's
    add("q-1", "STOPPED", later, "")
    assert main(["fetch", "q-1", *flags, "--to", str(tmp_path / "fetched")]) == 2
    assert "ended before its driver started" in capsys.readouterr().err
    assert not (tmp_path / "fetched").exists()
    assert main(["status", "q-1", *flags, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run_dir"] is None


def test_fetch_of_a_job_with_its_run_dir_copies_it_without_a_reservation(
    tmp_path, jobs_here, capsys
):
    from launcher.jobs import state

    add, flags = jobs_here
    mine = tmp_path / "mine"
    RunDir.reserve(mine, "q-1")
    (mine / "logs" / "x.log").write_text("hello\n")
    add("q-1", "RUNNING", mine, state.line({"state": "starting", "run_dir": str(mine)}) + "\n")
    assert main(["fetch", "q-1", *flags, "--to", str(tmp_path / "f")]) == 0
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == ["logs"]
    capsys.readouterr()
    assert main(["status", "q-1", *flags, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run_dir"] == str(mine)


def test_the_driver_says_which_run_dir_is_its_own(tmp_path, monkeypatch):
    """The state lines name the folder the driver took (``starting``, ``done``); a refused one
    is null in the final line (above)."""
    import io

    from launcher import signals
    from launcher.jobs import driver, state

    mine = tmp_path / "mine"
    RunDir.reserve(mine, "q-1")

    def stop_here():
        raise UsageError("stopped here")

    monkeypatch.setattr(signals, "install", lambda: None)
    monkeypatch.setattr(driver, "_leave_upload_out", stop_here)
    monkeypatch.setattr("sys.stdout", out := io.StringIO())
    (tmp_path / "submission.json").write_text(
        json.dumps({"job_id": "q-1", "job": job().model_dump(mode="json"), "run_dir": str(mine)})
    )
    assert driver.main([str(tmp_path / "submission.json")]) == 2
    lines = [
        json.loads(t[len(state.MARK) :])
        for t in out.getvalue().splitlines()
        if t.startswith(state.MARK)
    ]
    assert [(x["state"], x["run_dir"]) for x in lines] == [
        ("starting", str(mine)),
        ("done", str(mine)),
    ]


def test_a_reboot_that_cannot_be_told_leaves_the_reservation(tmp_path, machine, monkeypatch):
    """This machine's id matches but its boot id cannot be read (or the record has none): a
    reboot cannot be told from a live head, so the folder stays reserved."""
    from launcher.jobs import head

    record = local_head_record(tmp_path, 1)
    monkeypatch.setattr(head, "BOOT_ID", str(tmp_path / "no-boot-id"))
    path = tmp_path / "r"
    RunDir.reserve(path, "job-1", head={**record, "boot": "some-boot"})
    with pytest.raises(UsageError, match="reserved for job job-1"):
        RunDir.claim(path)


def test_something_that_is_no_http_server_on_the_heads_port_is_no_answer():
    """Garbage on the dashboard's port (``http.client.HTTPException``, not an OSError) is no
    answer, not a traceback."""
    import socket
    import threading

    from launcher.jobs import head

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)

    def serve():
        for _ in range(2):
            conn, _ = server.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(b"not http at all\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    try:
        assert head._job_status(url, "t", "job-1") is None
        assert head.api_status(url, "t") is None
    finally:
        thread.join(10)
        server.close()


def test_a_release_that_fails_leaves_the_submissions_own_error(monkeypatch):
    """A submission that fails before Ray has the job frees its run directory; where freeing it
    fails too, the submission's own error is the one raised."""
    from launcher.jobs import commands

    def release():
        raise PermissionError(13, "Permission denied")

    with (
        pytest.raises(RuntimeError, match="the Jobs API said no"),
        commands._released_unless_submitted(release),
    ):
        raise RuntimeError("the Jobs API said no")
