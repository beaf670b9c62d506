"""The preflight runs in a thread while Ray connects (``Launch.preflight_beside_ray``): fake
stages that wait for each other, a failed preflight that wins over Ray, an interrupt that stops
the preflight's probes. Ray itself is faked; the real run is in test_launch_local."""

from __future__ import annotations

import json
import threading

import pytest
from fixtures.launching import processes

from launcher.errors import EXIT_PREFLIGHT, PreflightError
from launcher.orchestrate.run import Launch
from launcher.orchestrate.rundir import RunDir
from launcher.preflight import NodeFacts
from launcher.remote import fan_out, runner_for
from launcher.spec import ClusterSpec, JobSpec, NodeSpec
from launcher.spec.cluster import SSHSpec

WAIT_S = 30.0  # a stage that waits this long for the other one: they did not overlap


def job() -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "t",
            "resources": {"device": "cpu", "nproc_per_node": 1},
            "precision": {"dtype": "fp32"},
            "train": {"steps": 10, "warmup_steps": 1},
        }
    )


class Session:
    def __init__(self) -> None:
        self.closed = False

    def close(self, *, keep_ray: bool = False) -> None:
        self.closed = True


def launch(tmp_path, monkeypatch, *, preflight, connect) -> tuple[Launch, Session, list[str]]:
    """A Launch whose preflight and Ray are ``preflight()`` and ``connect()``; the session is
    made once ``connect`` returns. The agents' placement stops the run (``placed``)."""
    session = Session()
    placed: list[str] = []

    def connect_ray(self: Launch) -> None:
        connect()
        self.session, self._own_session = session, True

    def place_agents(self: Launch):  # noqa: ANN202 - ends the run here
        placed.append("placed")
        raise PreflightError("stop here: the agents are not what this test is about")

    monkeypatch.setattr(Launch, "preflight", lambda self: preflight())
    monkeypatch.setattr(Launch, "connect_ray", connect_ray)
    monkeypatch.setattr(Launch, "place_agents", place_agents)
    launcher = Launch(
        job=job(),
        cluster=ClusterSpec.model_validate({"nodes": [{"name": "a", "host": "localhost"}]}),
        run_dir=RunDir(tmp_path / "run"),
        quiet=True,
    )
    return launcher, session, placed


def summary(tmp_path) -> dict:
    return json.loads((tmp_path / "run" / "summary.json").read_text())


def test_the_preflight_runs_while_ray_connects_and_both_are_timed(tmp_path, monkeypatch):
    """Each stage waits for the other to have begun: run one after the other, the first would
    time out. Both then last 0.2 s: the recorded wall of both is less than the sum of their
    own times."""
    preflight_began, ray_began = threading.Event(), threading.Event()

    def preflight() -> dict[str, NodeFacts]:
        preflight_began.set()
        assert ray_began.wait(WAIT_S), "Ray's start did not begin while the preflight ran"
        threading.Event().wait(0.2)
        return {"a": NodeFacts(gpus=0)}

    def connect() -> None:
        ray_began.set()
        assert preflight_began.wait(WAIT_S), "the preflight did not begin while Ray started"
        threading.Event().wait(0.2)

    launcher, session, placed = launch(tmp_path, monkeypatch, preflight=preflight, connect=connect)
    with pytest.raises(PreflightError, match="stop here"):
        launcher.execute()
    assert launcher.facts == {"a": NodeFacts(gpus=0)} and placed == ["placed"]
    timings = summary(tmp_path)["launcher_timings_s"]
    stages = [k for k in timings if k in ("preflight", "ray", "preflight+ray")]
    assert stages == ["preflight", "ray", "preflight+ray"]
    assert timings["preflight+ray"] < timings["preflight"] + timings["ray"] - 0.05
    assert session.closed


def test_a_failed_preflight_while_ray_starts_is_exit_3_and_ray_is_closed(tmp_path, monkeypatch):
    ray_up = threading.Event()

    def preflight() -> None:
        raise PreflightError("node a: torch 2.13.0 where the others have 2.11.0")

    def connect() -> None:
        ray_up.set()

    launcher, session, placed = launch(tmp_path, monkeypatch, preflight=preflight, connect=connect)
    with pytest.raises(PreflightError, match="torch 2.13.0") as err:
        launcher.execute()
    assert err.value.exit_code == EXIT_PREFLIGHT
    assert ray_up.is_set() and session.closed and placed == []
    assert summary(tmp_path)["status"] == "failed"
    assert "torch 2.13.0" in summary(tmp_path)["failure"]["reason"]


def test_a_failed_preflight_wins_over_rays_own_failure(tmp_path, monkeypatch):
    """Ray fails first; the preflight, still running, fails after: its verdict is the error."""
    ray_failed = threading.Event()

    def preflight() -> None:
        assert ray_failed.wait(WAIT_S)
        raise PreflightError("node a: the driver does not answer")

    def connect() -> None:
        ray_failed.set()
        raise PreflightError("could not start the embedded Ray on this machine: no memory")

    launcher, session, placed = launch(tmp_path, monkeypatch, preflight=preflight, connect=connect)
    with pytest.raises(PreflightError, match="the driver does not answer"):
        launcher.execute()
    assert placed == [] and not session.closed  # no session was made
    assert "the driver does not answer" in summary(tmp_path)["failure"]["reason"]


def test_rays_failure_is_the_error_when_the_preflight_passes(tmp_path, monkeypatch):
    def connect() -> None:
        raise PreflightError("could not start the embedded Ray on this machine: no memory")

    launcher, _, placed = launch(
        tmp_path, monkeypatch, preflight=lambda: {"a": NodeFacts(gpus=0)}, connect=connect
    )
    with pytest.raises(PreflightError, match="embedded Ray"):
        launcher.execute()
    assert placed == []


@pytest.mark.processes
def test_an_interrupt_while_ray_starts_stops_the_preflights_probes(tmp_path, monkeypatch):
    """Ctrl-C during Ray's start: the preflight's command (a real process, started through a
    fan-out as the probes are) is killed, and the run ends interrupted."""
    marker = tmp_path / "probe-ran"
    node = NodeSpec(name="a", host="localhost")
    probing = threading.Event()
    outcome: dict[str, object] = {}

    def preflight() -> None:
        def probe(n: NodeSpec) -> str:
            with runner_for(n, SSHSpec()) as runner:
                probing.set()
                return runner.run(f"sleep 60 && touch {marker}", timeout=120).stdout

        outcome.update(fan_out([node], probe))

    def connect() -> None:
        assert probing.wait(WAIT_S)
        raise KeyboardInterrupt("signal SIGINT")

    launcher, session, placed = launch(tmp_path, monkeypatch, preflight=preflight, connect=connect)
    assert launcher.execute().status.value == "interrupted"
    assert placed == [] and not session.closed
    assert "was stopped: the runner was closed" in str(outcome["a"])
    assert not [pid for pid, cmd in processes().items() if str(marker) in cmd]
    assert summary(tmp_path)["status"] == "interrupted"
