"""The preflight in a thread beside Ray's start and the agents' placement
(``Launch.preflight_beside_ray``), stages faked: a failed preflight wins over Ray's failure, an
interrupt stops its probes. The real run: test_launch_local."""

from __future__ import annotations

import json
import threading

import pytest
from fixtures.fake_launch import Session, cpu_job
from fixtures.launching import processes

from launcher.errors import EXIT_PREFLIGHT, JobFailed, PreflightError
from launcher.orchestrate.run import Launch
from launcher.orchestrate.rundir import RunDir
from launcher.preflight import NodeFacts
from launcher.remote import fan_out, runner_for
from launcher.spec import ClusterSpec, NodeSpec
from launcher.spec.cluster import SSHSpec

WAIT_S = 30.0  # a stage that waits this long for the other one: they did not overlap


class Agents:
    """Placed agents that never start a worker: the run stops before its first attempt."""

    def __init__(self) -> None:
        self.closed = False

    def stop(self, grace_s: float, first: int = 15) -> list:
        return []

    def close(self) -> None:
        self.closed = True


class Stages:
    """What the fake launch did, in order, and with what."""

    def __init__(self) -> None:
        self.session = Session()
        self.agents = Agents()
        self.placed_with: list[object] = []  # the facts known when the agents were placed


@pytest.fixture
def launch(tmp_path, monkeypatch):
    """``launch(preflight=, connect=, place=, device=)``: a Launch whose preflight, Ray and
    agents' placement are ``preflight()``, ``connect()`` and ``place()``; the session is made
    once ``connect`` returns. The first attempt stops the run (PreflightError "stop here")."""

    def make(*, preflight, connect, place=lambda: None, device="cpu"):  # (Launch, Stages)
        stages = Stages()

        def connect_ray(self: Launch) -> None:
            connect()
            self.session, self._own_session = stages.session, True

        def place_agents(self: Launch) -> Agents:
            stages.placed_with.append(self.facts)
            place()
            return stages.agents

        def run_attempts(self: Launch, agents: Agents):  # noqa: ANN202 - ends the run here
            raise PreflightError("stop here: the attempts are not what this test is about")

        monkeypatch.setattr(Launch, "preflight", lambda self: preflight())
        monkeypatch.setattr(Launch, "connect_ray", connect_ray)
        monkeypatch.setattr(Launch, "place_agents", place_agents)
        monkeypatch.setattr(Launch, "run_attempts", run_attempts)
        launcher = Launch(
            job=cpu_job(device=device),
            cluster=ClusterSpec.model_validate({"nodes": [{"name": "a", "host": "localhost"}]}),
            run_dir=RunDir(tmp_path / "run"),
            quiet=True,
        )
        return launcher, stages

    return make


def summary(launcher: Launch) -> dict:
    return json.loads((launcher.run_dir.root / "summary.json").read_text())


def test_the_preflight_runs_while_ray_connects_and_the_agents_are_placed(launch):
    """Each side waits for the other to have begun (run one after the other, the first would
    time out), then lasts 0.2 s: the recorded wall of the three is less than the sum of their
    own times. A CPU job's agents are placed before the preflight's facts are in."""
    preflight_began, placing = threading.Event(), threading.Event()

    def preflight() -> dict[str, NodeFacts]:
        preflight_began.set()
        assert placing.wait(WAIT_S), "the agents were not placed while the preflight ran"
        threading.Event().wait(0.2)
        return {"a": NodeFacts(gpus=0)}

    def connect() -> None:
        assert preflight_began.wait(WAIT_S), "the preflight did not begin while Ray started"
        threading.Event().wait(0.1)

    def place() -> None:
        placing.set()
        threading.Event().wait(0.1)

    launcher, stages = launch(preflight=preflight, connect=connect, place=place)
    with pytest.raises(PreflightError, match="stop here"):
        launcher.execute()
    assert launcher.facts == {"a": NodeFacts(gpus=0)} and stages.placed_with == [None]
    timings = summary(launcher)["launcher_timings_s"]
    parts = ("preflight", "ray", "agents")
    assert [k for k in timings if k in parts or "+" in k] == [*parts, "preflight+ray+agents"]
    assert timings["preflight+ray+agents"] < sum(timings[k] for k in parts) - 0.05
    assert stages.session.closed and stages.agents.closed


def test_a_gpu_jobs_agents_wait_for_the_preflights_facts(launch):
    """They reserve the GPUs the preflight found: placed after it, outside the overlap."""
    ray_began = threading.Event()

    def preflight() -> dict[str, NodeFacts]:
        assert ray_began.wait(WAIT_S), "Ray's start did not begin while the preflight ran"
        threading.Event().wait(0.2)
        return {"a": NodeFacts(gpus=2)}

    launcher, stages = launch(preflight=preflight, connect=ray_began.set, device="cuda")
    with pytest.raises(PreflightError, match="stop here"):
        launcher.execute()
    assert stages.placed_with == [{"a": NodeFacts(gpus=2)}]
    timings = summary(launcher)["launcher_timings_s"]
    order = [k for k in timings if k in ("preflight", "ray", "agents") or "+" in k]
    assert order == ["preflight", "ray", "preflight+ray", "agents"]


def test_a_failed_preflight_while_ray_starts_is_exit_3_and_ray_is_closed(launch):
    ray_up = threading.Event()

    def preflight() -> None:
        assert ray_up.wait(WAIT_S)
        raise PreflightError("node a: torch 2.13.0 where the others have 2.11.0")

    launcher, stages = launch(preflight=preflight, connect=ray_up.set)
    with pytest.raises(PreflightError, match="torch 2.13.0") as err:
        launcher.execute()
    assert err.value.exit_code == EXIT_PREFLIGHT
    assert stages.session.closed
    assert not stages.placed_with or stages.agents.closed  # placed meanwhile: closed again
    assert summary(launcher)["status"] == "failed"
    assert "torch 2.13.0" in summary(launcher)["failure"]["reason"]


def test_agents_are_not_placed_once_the_preflight_has_failed(launch):
    failed = threading.Event()

    def preflight() -> None:
        try:
            raise PreflightError("node a: the driver does not answer")
        finally:
            failed.set()

    def connect() -> None:
        assert failed.wait(WAIT_S)
        threading.Event().wait(0.1)  # the preflight's thread has ended

    launcher, stages = launch(preflight=preflight, connect=connect)
    with pytest.raises(PreflightError, match="does not answer"):
        launcher.execute()
    assert stages.placed_with == [] and stages.session.closed


@pytest.mark.parametrize("fails", ["ray", "placement"])
def test_a_failed_preflight_wins_over_a_failure_of_ray_or_the_placement(launch, fails):
    """Ray's start or the placement fails first; the preflight, still running, fails after: its
    verdict is the error."""
    failed = threading.Event()

    def preflight() -> None:
        assert failed.wait(WAIT_S)
        raise PreflightError("node a: the driver does not answer")

    def connect() -> None:
        if fails == "ray":
            failed.set()
            raise PreflightError("could not start the embedded Ray on this machine: no memory")

    def place() -> None:
        failed.set()
        raise JobFailed("Ray could not place one agent per node")

    launcher, stages = launch(preflight=preflight, connect=connect, place=place)
    with pytest.raises(PreflightError, match="the driver does not answer"):
        launcher.execute()
    placed = fails == "placement"
    assert stages.placed_with == ([None] if placed else [])
    assert stages.session.closed == placed  # closed where it was made
    assert "the driver does not answer" in summary(launcher)["failure"]["reason"]


def test_rays_failure_is_the_error_when_the_preflight_passes(launch):
    def connect() -> None:
        raise PreflightError("could not start the embedded Ray on this machine: no memory")

    launcher, stages = launch(preflight=lambda: {"a": NodeFacts(gpus=0)}, connect=connect)
    with pytest.raises(PreflightError, match="embedded Ray"):
        launcher.execute()
    assert stages.placed_with == []


@pytest.mark.processes
def test_an_interrupt_while_ray_starts_stops_the_preflights_probes(launch, tmp_path):
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

    launcher, stages = launch(preflight=preflight, connect=connect)
    assert launcher.execute().status.value == "interrupted"
    assert stages.placed_with == [] and not stages.session.closed
    assert "was stopped: the runner was closed" in str(outcome["a"])
    assert not [pid for pid, cmd in processes().items() if str(marker) in cmd]
    assert summary(launcher)["status"] == "interrupted"
