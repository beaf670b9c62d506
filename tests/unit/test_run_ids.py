"""Run ids and run directories: each launch's node folders are its own, and a run directory
holds one run. Nothing is started: fake agents record what the launch asked of them."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import sys
import threading
import types

import pytest
import requests
from fixtures.fake_launch import Agents, two_nodes
from fixtures.fake_launch import cpu_job as job

from launcher import signals
from launcher.cli import main
from launcher.errors import PreflightError, UsageError
from launcher.jobs import api, claim, commands, driver, head, state
from launcher.orchestrate import run as run_mod
from launcher.orchestrate.plan import NODE_DIR
from launcher.orchestrate.run import Launch
from launcher.orchestrate.rundir import RunDir


@pytest.fixture(autouse=True)
def own_state(tmp_path, monkeypatch):
    """This user's launcher state is the test's own: no record of a real head here is read."""
    monkeypatch.setenv("LAUNCHER_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


@pytest.fixture
def job_file(tmp_path):
    """A CPU job file, beside a cluster.yaml naming this machine."""
    (tmp_path / "cluster.yaml").write_text("nodes: [{name: local, host: localhost}]\n")
    path = tmp_path / "job.yaml"
    path.write_text(
        "name: q\nresources: {device: cpu, nproc_per_node: 1}\nprecision: {dtype: fp32}\n"
    )
    return path


def went_on(*args, **kwargs):
    raise AssertionError("the launch or submission went on")


def started(run_dir: RunDir, attempt: int = 0, launch: Launch | None = None):
    """The plan an attempt of a launch into ``run_dir`` hands to its nodes."""
    launch = launch or Launch(job=job(), cluster=two_nodes(), run_dir=run_dir, facts={}, quiet=True)
    run_dir.prepare(launch.job, launch.cluster)
    agents = Agents()
    launch.start_attempt(agents, attempt)
    launch.log.close()
    return agents.plans[0], launch


def test_runs_whose_folders_share_a_name_get_their_own_run_ids(tmp_path):
    """`--run-dir a/x` and `--run-dir b/x` (or two clusters' runs/<job>-<time>): the same name,
    yet two run ids (which the agents' private node folders are named after)."""
    one, _ = started(RunDir(tmp_path / "a" / "x"))
    two, _ = started(RunDir(tmp_path / "b" / "x"))
    assert one.run_id != two.run_id
    for lp, root in ((one, tmp_path / "a" / "x"), (two, tmp_path / "b" / "x")):
        assert lp.run_id.startswith("x-") and lp.run_id != "x"  # readable: the folder's name first
        assert all(n.node_dir == NODE_DIR for n in lp.nodes)  # the agent makes it on the node
        assert all(n.env["LAUNCHER_RUN_ID"] == "x" for n in lp.nodes)  # what scripts and tests read
        recorded = json.loads((root / "plan.json").read_text())
        assert recorded["run_id"] == lp.run_id and recorded["run_name"] == "x"


def test_a_restart_keeps_the_launchs_run_id(tmp_path):
    """Every attempt of one launch (a restart, an elastic one) is the same run: one run id."""
    run_dir = RunDir(tmp_path / "x")
    first, launch = started(run_dir)
    again, _ = started(run_dir, attempt=1, launch=launch)
    assert again.run_id == first.run_id
    assert [n.node_dir for n in again.nodes] == [n.node_dir for n in first.nodes]
    assert json.loads((tmp_path / "x" / "plan.attempt1.json").read_text())["run_id"] == first.run_id


def test_a_run_dir_that_holds_a_run_is_refused_before_anything_starts(
    tmp_path, job_file, monkeypatch, capsys
):
    """Launching into a folder that holds an earlier run would mix logs, metrics and summaries:
    exit 2, one paragraph naming the folder and the way out, nothing started or written."""
    old = tmp_path / "old"
    (old / "logs").mkdir(parents=True)
    (old / "summary.json").write_text('{"status": "succeeded"}')
    before = sorted(p.relative_to(old) for p in old.rglob("*"))
    monkeypatch.setattr(run_mod, "preflight_facts", went_on)
    monkeypatch.setattr(Launch, "execute", went_on)
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


def test_a_submissions_marker_gives_the_folder_to_its_own_job_only(tmp_path):
    """`launch submit` to a head on this machine marks the folder for its job; nothing else
    (a foreground run, another job's driver, another submission) gets it, the job's driver does."""
    path = tmp_path / "r"
    claim.mark(path, "job-1")
    assert [p.name for p in path.iterdir()] == [".launcher-job"]
    for other in (lambda: claim.take(path, "job-2"), lambda: claim.mark(path, "job-2")):
        with pytest.raises(
            UsageError,
            match=r"is marked for job job-1, submitted before .*`launch status job-1`.* "
            r"remove it if that job has ended",
        ):
            other()
    with pytest.raises(UsageError, match=r"is not empty \(.launcher-job\)"):
        RunDir.claim(path)
    taken = claim.take(path, "job-1")
    assert taken.root == path and [p.name for p in path.iterdir()] == ["logs"]  # marker gone
    with pytest.raises(UsageError, match="is not empty"):  # now the job's own: taken once
        claim.take(path, "job-1")


def test_an_undone_mark_leaves_the_folder_as_it_was(tmp_path):
    """A submission that fails before Ray has the job frees the folder: what marking it made
    is removed, a folder that was there stays, and one its driver took is left alone."""
    claim.mark(tmp_path / "a" / "b", "job-1")()
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "empty").mkdir()
    claim.mark(tmp_path / "empty", "job-2")()
    assert (tmp_path / "empty").is_dir() and list((tmp_path / "empty").iterdir()) == []
    undo = claim.mark(tmp_path / "c", "job-3")
    claim.take(tmp_path / "c", "job-3")
    undo()
    assert (tmp_path / "c" / "logs").is_dir()


@pytest.fixture
def head_here(tmp_path, job_file, monkeypatch):
    """The job commands against a fake Jobs API of a head on this machine, the preflight faked:
    ``submit(run_dir, capsys)`` submits with ``--run-dir`` and gives (exit code, captured
    output); ``add(job id, Ray status, run_dir, log)`` gives ``status`` and ``fetch`` a job;
    ``client.submitted`` and ``client.error`` (raised by the next submission)."""
    monkeypatch.setattr("launcher.preflight.preflight_facts", lambda *a, **k: None)
    monkeypatch.setenv("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0")  # submit sets it: restored after
    client = types.SimpleNamespace(submitted=[], error=None)
    known: dict[str, tuple] = {}

    def submit_job(**kw):
        if client.error is not None:
            raise client.error
        client.submitted.append(kw)

    client.submit_job = submit_job

    def add(job_id, status, run_dir, log=""):
        meta = {"launcher": "x", "name": "q", "run_dir": str(run_dir), "nodes": "1"}
        details = types.SimpleNamespace(
            submission_id=job_id,
            status=types.SimpleNamespace(value=status),
            message=None,
            metadata={**meta, "world_size": "1"},
            start_time=1,
            end_time=2,
            runtime_env={},
        )
        known[job_id] = (details, log)

    def job(job_id):
        if job_id not in known:
            raise UsageError(f"no job {job_id!r}")
        return known[job_id][0]

    @contextlib.contextmanager
    def connect(spec, *, start=False):
        yield types.SimpleNamespace(
            head_is_local=True,
            cluster=spec,
            client=client,
            head=spec.nodes[0],
            job=job,
            logs=lambda d: known[d.submission_id][1],
            state_log=lambda d: known[d.submission_id][1],
        )

    monkeypatch.setattr(commands, "connect", connect)
    flags = ["--cluster", str(tmp_path / "cluster.yaml")]

    def submit(run_dir, capsys):
        rc = main(["submit", str(job_file), *flags, "--run-dir", str(run_dir), "--json"])
        return rc, capsys.readouterr()

    return types.SimpleNamespace(submit=submit, client=client, add=add, flags=flags)


def test_submit_to_this_machine_refuses_a_run_dir_that_holds_a_run(
    tmp_path, head_here, monkeypatch, capsys
):
    """`launch submit --run-dir` where the head is this machine: the same refusal, before the
    preflight and before any Ray is asked for."""
    old = tmp_path / "old"
    old.mkdir()
    (old / "summary.json").write_text("{}")
    monkeypatch.setattr("launcher.preflight.preflight_facts", went_on)
    monkeypatch.setattr(commands, "connect", went_on)
    rc, out = head_here.submit(old, capsys)
    assert rc == 2 and f"--run-dir {old} is not empty" in out.err and out.err.count("\n") == 1


def test_two_queued_submits_to_one_run_dir_the_second_is_refused(tmp_path, head_here, capsys):
    """Both submissions find the folder new (the first job has not started yet): the first
    reserves it at once, so the second is refused (exit 2), naming the first job."""
    submit, client = head_here.submit, head_here.client
    run_dir = tmp_path / "shared"
    rc, out = submit(run_dir, capsys)
    assert rc == 0, out.err
    first = json.loads(out.out)["job_id"]
    assert (run_dir / ".launcher-job").read_text().strip() == first
    rc, out = submit(run_dir, capsys)
    assert rc == 2 and len(client.submitted) == 1
    assert out.err.startswith(f"error: --run-dir {run_dir} is marked for job {first}")
    assert out.err.count("\n") == 1


def test_a_submission_that_fails_frees_its_run_dir(tmp_path, head_here, capsys):
    submit, client = head_here.submit, head_here.client
    client.error = PreflightError(
        "the Ray Jobs API at http://127.0.0.1:1 failed (submit_job): boom"
    )
    rc, out = submit(tmp_path / "d", capsys)
    assert rc == 3 and "boom" in out.err
    assert not (tmp_path / "d").exists()
    client.error = None
    assert submit(tmp_path / "d", capsys)[0] == 0  # submitting again works


def driven(tmp_path, monkeypatch, run_dir, job_id="q-1", fake_run=True):
    """The driver on a submission to ``run_dir`` (Ray and, with ``fake_run``, the launch
    faked): (exit code, its log, the run directory the launch got or None)."""
    got = []
    monkeypatch.setattr(signals, "install", lambda: None)
    if fake_run:
        monkeypatch.setattr(driver, "drive", lambda sub, job, run_dir: got.append(run_dir) or 0)
    submission = {"job_id": job_id, "job": job().model_dump(mode="json"), "run_dir": str(run_dir)}
    (tmp_path / "submission.json").write_text(json.dumps(submission))
    with contextlib.redirect_stdout(out := io.StringIO()):
        rc = driver.main([str(tmp_path / "submission.json")])
    return rc, out.getvalue(), (got[0] if got else None)


def test_the_driver_refuses_a_run_dir_that_holds_a_run(tmp_path, monkeypatch):
    """A submission to a remote head cannot look at the folder from here: the driver does, on
    the head. The job fails (exit 2) with the refusal in its log and as its failure; the
    folder is left as it was."""
    old = tmp_path / "old"
    old.mkdir()
    (old / "summary.json").write_text('{"status": "succeeded"}')
    rc, log, got = driven(tmp_path, monkeypatch, old)
    assert rc == 2 and got is None
    assert f"error: --run-dir {old} is not empty (summary.json)" in log
    assert "Pick a new folder" in log
    final = state.last_state(log)
    assert final["state"] == "done" and final["status"] == "failed"
    assert f"--run-dir {old} is not empty" in final["failure"]["reason"]
    assert [p.name for p in old.iterdir()] == ["summary.json"]
    assert (old / "summary.json").read_text() == '{"status": "succeeded"}'


def test_the_driver_takes_the_folder_marked_for_its_job_and_no_other(tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    claim.mark(mine, "q-1")
    rc, log, got = driven(tmp_path, monkeypatch, mine, job_id="q-1")
    assert rc == 0 and got is not None and got.root == mine, log
    assert not (mine / ".launcher-job").exists()
    theirs = tmp_path / "theirs"
    claim.mark(theirs, "q-2")
    rc, log, got = driven(tmp_path, monkeypatch, theirs, job_id="q-3")
    assert rc == 2 and got is None and "marked for job q-2" in log
    assert (theirs / ".launcher-job").read_text().strip() == "q-2"


# -- requests to a head's 127.0.0.1 ----------------------------------------------------------


@contextlib.contextmanager
def serving(route):
    """An HTTP server on 127.0.0.1 whose GETs ``route(path, headers)`` answers with (status, JSON
    body or None, Location or None), or bytes sent as they are; yields its port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            answer = route(self.path, self.headers)
            if isinstance(answer, bytes):
                return self.wfile.write(answer)
            code, body, location = answer
            data = json.dumps(body).encode() if body is not None else b""
            self.send_response(code)
            if location:
                self.send_header("Location", location)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def jobs_api():
    """A local head's Jobs API: a GET of a path in ``statuses`` with the token answers that job
    status (``redirect:URL``: 302 to URL); other paths 404, no token 401."""
    statuses: dict[str, str] = {}

    def route(path, headers):
        if headers.get("Authorization") != "Bearer secret":
            return 401, None, None
        status = statuses.get(path)
        if status is None:
            return 404, None, None
        if status.startswith("redirect:"):
            return 302, None, status.removeprefix("redirect:")
        return 200, {"submission_id": path, "status": status}, None

    with serving(route) as port:
        yield port, statuses


@pytest.fixture
def listener():
    """Something else listening on 127.0.0.1: what it was asked (path, headers), and for every
    request an answer that would free the folder (FAILED)."""
    asked: list = []

    def route(path, headers):
        asked.append((path, dict(headers)))
        return 200, {"status": "FAILED", "ray_version": "9.9.9", "version": "9"}, None

    with serving(route) as port:
        yield port, asked


def test_the_head_is_asked_without_a_redirect_or_a_proxy(jobs_api, listener, monkeypatch):
    """The token goes to the head's 127.0.0.1 only: a redirect (urllib's handler would resend
    the Authorization header) is not followed, and http_proxy is not used."""
    port, asked = listener
    api_port, statuses = jobs_api
    url = f"http://127.0.0.1:{api_port}"
    statuses["/api/version"] = f"redirect:http://127.0.0.1:{port}/api/version"
    assert head.api_status(url, "secret") == 302
    assert asked == []
    del statuses["/api/version"]
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{port}")
    assert head.api_status(url, "secret") == 404  # the head's own answer, unproxied
    assert asked == []


def test_rays_jobs_client_bypasses_the_proxy_for_a_heads_loopback(jobs_api, listener, monkeypatch):
    """Ray's JobSubmissionClient uses requests, which follows http_proxy: for a head's 127.0.0.1
    (the local head, the SSH tunnel's end) the launcher adds 127.0.0.1 and localhost to
    no_proxy first, keeping what was there."""
    port, asked = listener
    api_port, statuses = jobs_api
    statuses["/api/jobs/x"] = "RUNNING"
    monkeypatch.setenv("no_proxy", "")  # recorded, so that what the launcher sets is undone
    monkeypatch.delenv("no_proxy")
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


# -- detached jobs' run directories: status and fetch -----------------------------------------


def test_fetch_of_a_job_whose_driver_refused_its_run_dir_copies_nothing(
    tmp_path, monkeypatch, head_here, capsys
):
    """The folder given at submission held an earlier run: the driver refused it (exit 2). The
    folder is that run's, not the job's: `fetch` copies nothing and says why (exit 2), `status`
    shows no run directory (null in --json)."""
    add, flags = head_here.add, head_here.flags
    old = tmp_path / "old"
    old.mkdir()
    (old / "summary.json").write_text('{"status": "succeeded", "job": "someone-else"}')
    rc, log, _ = driven(tmp_path, monkeypatch, old, job_id="q-1")
    assert rc == 2
    add("q-1", "FAILED", old, log)
    dest = tmp_path / "fetched"
    assert main(["fetch", "q-1", *flags, "--to", str(dest)]) == 2
    err = capsys.readouterr().err
    refused = f"error: job q-1 has no run directory to fetch (FAILED): its driver refused {old}"
    assert err.startswith(refused) and "launch logs q-1" in err and err.count("\n") == 1
    assert not dest.exists()
    assert main(["status", "q-1", *flags, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["run_dir"] is None
    assert f"--run-dir {old} is not empty" in shown["failure"]["reason"]
    assert main(["status", "q-1", *flags]) == 0
    assert f"run dir: none — its driver refused {old}" in capsys.readouterr().out


def test_fetch_of_a_job_that_ended_before_its_driver_started_copies_nothing(
    tmp_path, head_here, capsys
):
    """Stopped while Ray had not started its driver: the folder was marked, never this job's,
    and may hold a later run by now (removed and used again)."""
    add, flags = head_here.add, head_here.flags
    later = tmp_path / "r"
    later.mkdir()
    (later / "summary.json").write_text("{}")  # a later run's
    add("q-1", "STOPPED", later, "")
    assert main(["fetch", "q-1", *flags, "--to", str(tmp_path / "fetched")]) == 2
    assert "ended before its driver started" in capsys.readouterr().err
    assert not (tmp_path / "fetched").exists()
    assert main(["status", "q-1", *flags, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run_dir"] is None


def test_fetch_of_a_job_with_its_run_dir_copies_it_without_a_marker(tmp_path, head_here, capsys):
    add, flags = head_here.add, head_here.flags
    mine = tmp_path / "mine"
    claim.mark(mine, "q-1")
    (mine / "logs").mkdir()
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
    mine = tmp_path / "mine"
    claim.mark(mine, "q-1")

    def stop_here():
        raise UsageError("stopped here")

    monkeypatch.setattr(driver, "_leave_upload_out", stop_here)
    rc, log, _ = driven(tmp_path, monkeypatch, mine, fake_run=False)
    assert rc == 2
    lines = [json.loads(t[len(state.MARK) :]) for t in log.splitlines() if t.startswith(state.MARK)]
    assert [(x["state"], x["run_dir"]) for x in lines] == [
        ("starting", str(mine)),
        ("done", str(mine)),
    ]


def test_something_that_is_no_http_server_on_the_heads_port_is_no_answer():
    """Garbage on the dashboard's port (``http.client.HTTPException``, not an OSError) is no
    answer, not a traceback."""
    with serving(lambda path, headers: b"not http at all\r\n\r\n") as port:
        assert head.api_status(f"http://127.0.0.1:{port}", "t") is None


def test_a_release_that_fails_leaves_the_submissions_own_error(monkeypatch):
    """A submission that fails before Ray has the job frees its run directory; where freeing it
    fails too, the submission's own error is the one raised."""

    def release():
        raise PermissionError(13, "Permission denied")

    with (
        pytest.raises(RuntimeError, match="the Jobs API said no"),
        commands._released_unless_submitted(release),
    ):
        raise RuntimeError("the Jobs API said no")
