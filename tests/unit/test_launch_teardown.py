"""Launch.execute's ending with fake agents and session failing where a real run's can: every agent
and the session are closed, summary.json is written, and the error is one paragraph with its exit
code."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field

import pytest
from fixtures.fake_launch import Agents as Reaching
from fixtures.fake_launch import Session
from fixtures.fake_launch import cpu_job as job
from fixtures.fake_launch import two_nodes as cluster

from launcher.errors import EXIT_JOB_FAILED, EXIT_PREFLIGHT, JobFailed, PreflightError, UsageError
from launcher.orchestrate import rundir
from launcher.orchestrate.records import AgentUpdate, ExitStatus
from launcher.orchestrate.run import Launch
from launcher.orchestrate.rundir import RunDir


@dataclass
class Agents(Reaching):
    """Records what the launch asked; ``fail`` maps a method name to the error it raises."""

    fail: dict[str, BaseException] = field(default_factory=dict)
    rounds: list = field(default_factory=list)  # what each poll returns
    refused: dict[str, str] = field(default_factory=dict)  # the reach check's: node → what failed
    calls: list[str] = field(default_factory=list)
    checked: list[tuple[str, int, list]] = field(default_factory=list)

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise self.fail[name]

    def check_reach(self, launch_plan, timeout_s: float) -> dict[str, str]:
        ifnames = [n.env.get("GLOO_SOCKET_IFNAME") for n in launch_plan.nodes]
        self.checked.append((launch_plan.master_addr, launch_plan.master_port, ifnames))
        return self.refused

    def start(self, launch_plan, files) -> None:
        self._call("start")

    def poll(self, wait_s: float) -> list:
        self._call("poll")
        return sorted((self.rounds.pop(0) if self.rounds else {}).items())

    def silent(self, limit_s: float) -> None:
        return None

    # what the watcher asks about a failed rank: every other agent answers, no log lines, no
    # structured errors (the failure is a plain exit code 1)
    def unreachable(self, exclude: int) -> None:
        return None

    def tail(self, i: int, local_rank, lines: int) -> list[str]:
        return []

    def errors(self, i: int) -> list:
        return []

    def stop(self, grace_s: float, first: int = 15) -> list:
        self._call("stop")
        return []

    def collect(self, subdir: str) -> dict:
        self._call("collect")
        return {}

    def close(self) -> None:
        self._call("close")


@pytest.fixture
def launch(tmp_path, monkeypatch):
    """``launch(job_spec, run_dir=None, **agents) -> (Launch, Agents, Session)``: a launch of
    ``job_spec`` (the default job) onto fake agents made with ``agents`` and a fake session."""

    def make(job_spec=None, run_dir=None, **agents_kw) -> tuple[Launch, Agents, Session]:
        agents, session = Agents(**agents_kw), Session()
        folder = RunDir(run_dir or tmp_path / "run")
        launcher = Launch(
            job=job_spec or job(), cluster=cluster(), run_dir=folder, facts={}, quiet=True
        )

        def connect_ray(self: Launch) -> None:
            self.session, self._own_session = session, True

        monkeypatch.setattr(Launch, "connect_ray", connect_ray)
        monkeypatch.setattr(Launch, "place_agents", lambda self: agents)
        return launcher, agents, session

    return make


def summary(tmp_path) -> dict:
    return json.loads((tmp_path / "run" / "summary.json").read_text())


def test_a_profiled_job_whose_torchrun_cannot_start_fails_with_exit_4_and_closes_everything(
    tmp_path, launch
):
    failed = JobFailed("torchrun could not be started on node b: no such file")
    launcher, agents, session = launch(job(profile={"start_step": 2}), fail={"start": failed})
    with pytest.raises(JobFailed, match="could not be started on node b"):
        launcher.execute()
    assert agents.calls == ["start", "stop", "collect", "close"] and session.closed
    assert summary(tmp_path)["status"] == "failed"
    assert "could not be started" in summary(tmp_path)["failure"]["reason"]


@pytest.mark.parametrize(
    "error, raised, match, status",
    [
        (None, None, None, "succeeded"),
        (ConnectionError("Ray lost"), JobFailed, "ConnectionError: Ray lost", "failed"),
        (KeyboardInterrupt("signal SIGINT"), KeyboardInterrupt, None, "interrupted"),
    ],
)
def test_success_a_lost_connection_or_a_second_interrupt_end_in_one_teardown(
    tmp_path, launch, error, raised, match, status
):
    done = {0: AgentUpdate(exit=ExitStatus(0)), 1: AgentUpdate(exit=ExitStatus(0))}
    fail = {"poll": error, "stop": error} if error else {}
    launcher, agents, session = launch(fail=fail, rounds=[done])
    with pytest.raises(raised, match=match) if raised else contextlib.nullcontext():
        launcher.execute()
    assert agents.calls == ["start", "poll", "stop", "close"] and session.closed
    assert summary(tmp_path)["status"] == status


def test_a_run_dir_that_cannot_be_made_is_exit_2_before_anything_starts(tmp_path, launch):
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    launcher, agents, session = launch(run_dir=in_the_way / "run")
    with pytest.raises(UsageError, match="cannot write the run directory .*a-file/run"):
        launcher.execute()
    assert agents.calls == [] and not session.closed


def test_two_launches_in_the_same_second_get_their_own_run_directories(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir, "utc_stamp", lambda: "20261202-190000")
    first, second = RunDir.new("j", base=tmp_path), RunDir.new("j", base=tmp_path)
    assert (first.name, second.name) == ("j-20261202-190000", "j-20261202-190000-2")
    assert first.root.is_dir() and second.root.is_dir()
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    with pytest.raises(UsageError, match="cannot make a run directory"):
        RunDir.new("j", base=in_the_way / "runs")


@pytest.mark.parametrize(
    ("cls", "method", "error", "calls"),
    [  # a full disk while writing plan.json; the code that cannot be staged on Ray
        (RunDir, "write_plan", OSError(28, "No space left on device"), ["stop", "close"]),
        (Launch, "connect_ray", PermissionError(13, "Permission denied", "/work/train.py"), []),
    ],
)
def test_an_oserror_before_any_worker_starts_is_exit_3_with_a_summary(
    tmp_path, monkeypatch, launch, cls, method, error, calls
):
    """No node was asked to start torchrun, so the launch failed before training (exit 3), not
    the job (exit 4); what was opened is closed, the summary written."""

    def fail(*args):
        raise error

    launcher, agents, session = launch()
    monkeypatch.setattr(cls, method, fail)
    with pytest.raises(PreflightError, match=f"{error.strerror}.*No worker was started") as err:
        launcher.execute()
    assert err.value.exit_code == EXIT_PREFLIGHT
    assert agents.calls == calls and session.closed == bool(calls)  # no session: nothing placed
    assert summary(tmp_path)["status"] == "failed"
    assert error.strerror in summary(tmp_path)["failure"]["reason"]


def test_an_oserror_after_workers_started_stays_exit_4(tmp_path, monkeypatch, launch):
    """The first attempt's workers ran (and failed); the restart's plan.json cannot be written:
    a run failure (exit 4), not a launch that failed before training."""
    writes = []
    real_write_plan = RunDir.write_plan

    def second_write_fails(self, launch_plan):
        writes.append(launch_plan.attempt)
        if len(writes) > 1:
            raise OSError(28, "No space left on device", str(self.root / "plan.attempt1.json"))
        return real_write_plan(self, launch_plan)

    monkeypatch.setattr(RunDir, "write_plan", second_write_fails)
    failed = {0: AgentUpdate(exit=ExitStatus(1)), 1: AgentUpdate(exit=ExitStatus(0))}
    launcher, agents, session = launch(job({"max_restarts": 1}), rounds=[failed])
    with pytest.raises(JobFailed, match="No space left on device") as err:
        launcher.execute()
    assert err.value.exit_code == EXIT_JOB_FAILED
    assert writes == [0, 1] and agents.calls.count("start") == 1 and session.closed
    assert summary(tmp_path)["status"] == "failed"


def test_a_node_that_cannot_reach_the_rendezvous_port_is_exit_3_before_any_worker(tmp_path, launch):
    """Without preflight facts the agents find each node's interface; the rendezvous check
    runs with it, and a node that fails it stops the launch (exit 3) naming it."""
    refused = {"b": "cannot connect to 198.18.0.10:29500 from eth0"}
    launcher, agents, session = launch(refused=refused)
    with pytest.raises(PreflightError, match="node b: cannot connect to 198.18.0.10:29500") as err:
        launcher.execute()
    assert err.value.exit_code == EXIT_PREFLIGHT
    assert agents.checked == [("198.18.0.10", 29500, ["eth0", "eth0"])]
    assert "start" not in agents.calls and agents.calls[-1] == "close" and session.closed
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["nodes"][1]["env_sources"]["GLOO_SOCKET_IFNAME"].startswith("agent: ")
    assert summary(tmp_path)["status"] == "failed"
    assert "network" in summary(tmp_path)["launcher_timings_s"]
