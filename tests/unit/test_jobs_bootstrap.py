"""A bootstrapped cluster kept up for detached jobs: when the launcher starts Ray again, and
when it must not (a Ray that runs is never stopped by a failed second start). SSH and Ray are
stubbed here; tests/integration/test_jobs_netns.py does it for real."""

from __future__ import annotations

import contextlib
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest

from launcher.errors import PreflightError, UsageError
from launcher.jobs import api, commands, records
from launcher.orchestrate import ray_cluster
from launcher.remote import CommandResult
from launcher.spec import ClusterSpec


def two_nodes(first: dict | None = None, second: dict | None = None) -> ClusterSpec:
    """node0 (198.18.250.10) and node1 (.11), with ``first`` and ``second`` as more of their keys."""
    more = enumerate([first or {}, second or {}])
    nodes = [{"name": f"node{i}", "host": f"198.18.250.1{i}", **keys} for i, keys in more]
    return ClusterSpec.model_validate({"nodes": nodes})


CLUSTER = two_nodes()
NODE_TEMP = "/tmp/launcher-ray-node-0-x1y2z3"


@pytest.fixture(autouse=True)
def state(tmp_path, monkeypatch):
    monkeypatch.setenv(records.STATE_ENV, str(tmp_path / "state"))


def session(monkeypatch, answers):
    """A bootstrap session whose SSH commands get ``answers(command)``; returns it and the
    commands it ran and the nodes it stopped."""
    ran: list[str] = []
    stopped: list[str] = []

    def on_node(cluster, node, command, *, stdin=None, timeout):
        ran.append(command)
        answer = answers(command)
        if "mktemp -d" in command and answer.exit_code == 0:  # Ray's private temp dir there
            return CommandResult(f"{NODE_TEMP}\n", "", 0)
        return answer

    monkeypatch.setattr(ray_cluster, "_on_node", on_node)
    monkeypatch.setattr(
        ray_cluster,
        "stop_ray",
        lambda cluster, nodes, addresses=None: stopped.extend(n.name for n in nodes),
    )
    s = ray_cluster.RaySession(
        mode="bootstrap",
        address="ray://198.18.250.10:10001",
        node_ips={"node0": "198.18.250.10", "node1": "198.18.250.11"},
        _cluster=CLUSTER,
        _head_ip="198.18.250.10",
        _token="t" * 64,
    )
    return s, ran, stopped


def test_a_head_whose_gcs_port_answers_is_refused_and_left_running(monkeypatch):
    s, ran, stopped = session(
        monkeypatch, lambda command: CommandResult("", "", ray_cluster.PORT_TAKEN_EXIT)
    )
    with pytest.raises(PreflightError, match="port 6379 on the head node 'node0' .* is in use"):
        s._start_ray(CLUSTER.nodes[0], head=True)
    s.close()
    assert stopped == [] and not any("ray.scripts.scripts start" in c for c in ran), ran
    assert "connect_ex" in ran[0] and "cat > " in ran[0]  # checked before the token file is written


ALREADY_RUNNING = (
    "ConnectionError: Ray is trying to start at 198.18.250.10:6379, but is already running at "
    "198.18.250.10:6379. Please specify a different port"
)


@pytest.mark.parametrize(
    ("node", "stderr", "match", "stopped"),
    [
        (0, ALREADY_RUNNING, "already running", []),  # a Ray that runs is never stopped
        (1, "raylet died", "raylet died", ["node1"]),  # one that failed midway is
    ],
)
def test_a_failed_ray_start_is_stopped_unless_ray_was_running(
    monkeypatch, node, stderr, match, stopped
):
    def answers(command):
        return CommandResult("", stderr, 1) if " start " in command else CommandResult("", "", 0)

    s, ran, were_stopped = session(monkeypatch, answers)
    with pytest.raises(PreflightError, match=match):
        s._start_ray(CLUSTER.nodes[node], head=node == 0)
    s.close()
    assert were_stopped == stopped
    assert f"--temp-dir {NODE_TEMP}/ray " in ran[-1]  # never the shared /tmp/ray


def test_the_bootstrap_records_the_addresses_its_ray_start_was_given(monkeypatch):
    """The record of a cluster bootstrapped for detached jobs keeps the address each node's
    `ray start` was given (the session's), which `launch down` matches later, beside the spec."""
    started_with = {"node0": "10.0.0.1", "node1": "10.0.0.2"}  # not what the hosts resolve to
    left = []
    session = types.SimpleNamespace(
        node_ips=dict(started_with), leave_running=lambda: left.append(True)
    )
    monkeypatch.setattr(ray_cluster, "open_session", lambda cluster, nodes, code=None: session)
    spec = api._bootstrap(CLUSTER)
    assert records.saved_cluster(CLUSTER) == spec
    assert records.saved_addresses(CLUSTER) == started_with
    assert left == [True]  # Ray left running, its watchdog stood down


def test_a_record_that_cannot_be_read_has_no_addresses(monkeypatch):
    records.cluster_record(CLUSTER).write_text("{not json")
    with pytest.raises(records.UnreadableRecord):
        records.saved_cluster(CLUSTER)
    assert records.saved_addresses(CLUSTER) == {}


def kept_up(monkeypatch, *errors: BaseException | None) -> list[float]:
    """Stubs the bootstrap (0.3 s long), Ray's client and the SSH tunnel, whose calls raise each
    of ``errors`` in turn (None: it answers; the last one ever after). Returns when each
    bootstrap began."""
    calls: list[float] = []
    left = list(errors) or [None]

    def bootstrap(cluster):
        calls.append(time.monotonic())
        time.sleep(0.3)
        records.save_cluster(cluster)
        return cluster

    @contextlib.contextmanager
    def tunnel(cluster, *, token=False):
        error = left.pop(0) if len(left) > 1 else left[0]
        if error is not None:
            raise error
        yield "http://127.0.0.1:1", "secret"

    monkeypatch.setattr(api, "_bootstrap", bootstrap)
    monkeypatch.setattr(api, "_client", lambda url, token: object())
    monkeypatch.setattr(api, "_tunnel", tunnel)
    return calls


@pytest.mark.parametrize(
    "error",
    [
        PreflightError("cannot reach the head node node0 (198.18.250.10) over SSH: timed out"),
        TimeoutError("timed out"),
    ],
)
def test_a_head_that_ssh_cannot_reach_keeps_its_record_and_ray(monkeypatch, error):
    records.save_cluster(CLUSTER)
    calls = kept_up(monkeypatch, error)
    with (
        pytest.raises(PreflightError, match="does not answer: .*`launch down --yes`"),
        api.connect(CLUSTER, start=True),
    ):
        pass
    assert calls == [] and records.saved_cluster(CLUSTER) == CLUSTER


def test_a_head_without_the_token_is_bootstrapped_again(monkeypatch):
    records.save_cluster(CLUSTER)
    calls = kept_up(monkeypatch, api.NoToken("no launcher token on node0"), None)
    with api.connect(CLUSTER, start=True) as jobs:
        assert jobs.kind == "bootstrap"
    assert len(calls) == 1
    calls = kept_up(monkeypatch, api.NoToken("no launcher token on node0"))
    with pytest.raises(PreflightError, match="does not answer"), api.connect(CLUSTER):
        pass  # without start: never bootstrapped
    assert calls == []


def test_two_submits_at_once_bootstrap_once(monkeypatch):
    calls = kept_up(monkeypatch)

    def submit():
        with api.connect(CLUSTER, start=True):
            pass

    with ThreadPoolExecutor(3) as pool:
        submits = [pool.submit(submit) for _ in range(3)]
        assert [s.exception(timeout=30) for s in submits] == [None] * 3
    assert len(calls) == 1


def test_a_submit_for_other_nodes_than_the_running_ray_is_refused(monkeypatch):
    saved = CLUSTER.model_copy(update={"ray": CLUSTER.ray.model_copy(update={"dashboard": True})})
    records.save_cluster(saved)
    calls = kept_up(monkeypatch)
    edited = two_nodes(second={"host": "198.18.250.12"})
    with (
        pytest.raises(
            UsageError,
            match=r"started for other nodes .*node node1: host '198.18.250.11' → "
            r"'198.18.250.12'.*`launch down --yes` first",
        ),
        api.connect(edited, start=True),
    ):
        pass
    with api.connect(edited) as jobs:  # status, logs, down: the saved cluster, as it runs
        assert jobs.cluster == saved
    same = CLUSTER.model_copy(
        update={"ssh": CLUSTER.ssh.model_copy(update={"connect_timeout_s": 3.0})}
    )
    with api.connect(same, start=True) as jobs:  # SSH settings are not the nodes
        assert jobs.cluster == saved
    # Nor are the workers' env and GPU counts: the submission carries them as given now.
    retuned = two_nodes({"gpus": 2}, {"env": {"NCCL_SOCKET_IFNAME": "eth1"}})
    with api.connect(retuned, start=True) as jobs:
        assert jobs.cluster == saved
    assert calls == []


class FakeRay:
    """The Jobs API of one bootstrapped Ray: jobs submitted to it run until it is stopped."""

    def __init__(self, on_list=None):
        self.running: dict[str, int] = {}
        self.on_list = on_list

    def list_jobs(self):
        listed = [
            types.SimpleNamespace(
                submission_id=job_id,
                status=types.SimpleNamespace(value="RUNNING"),
                metadata={api.META_KEY: "0"},
                start_time=t,
                runtime_env=None,
            )
            for job_id, t in self.running.items()
        ]
        if self.on_list is not None:
            self.on_list()
        return listed

    def submit_job(self, *, submission_id, **_):
        self.running[submission_id] = len(self.running)


def test_down_stops_ray_only_under_the_jobs_it_listed(monkeypatch, capsys):
    """`launch down` (no --yes) lists no running job; a submission that comes while it stops Ray
    must not be stopped with that Ray, unlisted: it waits, and runs on a Ray started again."""
    records.save_cluster(CLUSTER)
    calls = kept_up(monkeypatch)
    rays: list[FakeRay] = []
    stopped_with_ray: list[str] = []
    submitted = threading.Event()

    def submit():  # what `launch submit` does with the Jobs API
        with api.connect(CLUSTER, start=True) as jobs:
            jobs.client.submit_job(submission_id="later", entrypoint="x")
        submitted.set()

    submitter = threading.Thread(target=submit)

    def on_list():  # down has listed the jobs: a submission comes now
        if not submitter.is_alive() and not submitted.is_set():
            submitter.start()
            submitted.wait(1.0)

    def client(url, token):
        rays.append(FakeRay(on_list if len(rays) == 0 else None))
        return rays[-1]

    def stop_ray(cluster, nodes, addresses=None):
        stopped_with_ray.extend(rays[-1].running)
        rays[-1].running.clear()
        return []

    monkeypatch.setattr(api, "_client", client)
    monkeypatch.setattr(ray_cluster, "stop_ray", stop_ray)
    assert commands.down(CLUSTER, yes=False) == 0
    submitter.join(timeout=30)
    assert stopped_with_ray == [], "launch down stopped a job it never listed"
    assert submitted.is_set() and len(calls) == 1 and list(rays[-1].running) == ["later"]
    assert "Stopped the launcher's Ray on node0, node1" in capsys.readouterr().out


def test_down_waits_for_a_submission_that_found_ray_before_it(monkeypatch):
    """A submission that found the running Ray (connect) and has not handed it the job yet:
    `launch down` (no --yes) waits for it, then lists that job and refuses to stop it."""
    records.save_cluster(CLUSTER)
    kept_up(monkeypatch)
    ray = FakeRay()
    connected, listed, submitted = threading.Event(), threading.Event(), threading.Event()
    stopped_with_ray: list[str] = []

    def on_list():
        listed.set()
        submitted.wait(1.0)

    def submit():
        with api.connect(CLUSTER, start=True) as jobs:
            connected.set()
            listed.wait(1.0)
            jobs.client.submit_job(submission_id="later", entrypoint="x")
        submitted.set()

    def stop_ray(cluster, nodes, addresses=None):
        stopped_with_ray.extend(ray.running)
        return []

    monkeypatch.setattr(api, "_client", lambda url, token: ray)
    monkeypatch.setattr(ray_cluster, "stop_ray", stop_ray)
    submitter = threading.Thread(target=submit)
    submitter.start()
    assert connected.wait(10)
    ray.on_list = on_list
    with pytest.raises(UsageError, match="1 job.s. still running: later"):
        commands.down(CLUSTER, yes=False)
    submitter.join(timeout=30)
    assert stopped_with_ray == [] and records.saved_cluster(CLUSTER) == CLUSTER
