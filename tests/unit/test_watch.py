"""The run logic without Ray: fake agents that answer with typed updates drive the watch loop
(exit triage, a lost node against its echo, agent silence, the hang watchdog, success) and the
restart policy of ``Launch.run_attempts``."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable

import pytest
import yaml
from fixtures.fake_launch import Agents, cpu_job, two_nodes
from fixtures.stacks import STUCK, WAITING

from launcher.errors import PreflightError, SpecError
from launcher.orchestrate import run as run_mod
from launcher.orchestrate.diagnose import rank_failure
from launcher.orchestrate.elastic import RestartRefused, check_shared_checkpoints, job_for_world
from launcher.orchestrate.plan import plan
from launcher.orchestrate.records import AgentUpdate, ExitStatus, FailureKind, RankError, Status
from launcher.orchestrate.run import Launch
from launcher.orchestrate.rundir import RunDir
from launcher.orchestrate.watch import Watcher
from launcher.spec import ClusterSpec, JobSpec

ROOT_CAUSE = [
    "Root Cause (first observed failure):",
    "[0]:",
    "  rank      : 1 (local_rank: 0)",
    "  exitcode  : 1 (pid: 4242)",
]


def step(rank: int, n: int) -> tuple[int, dict]:
    return rank, {"type": "step", "step": n, "time": float(n), "tokens": 10}


def failing_round(node: int = 1) -> dict:
    return {node: AgentUpdate(exit=ExitStatus(1))}


def done_round(nodes: int = 2) -> dict:
    return {i: AgentUpdate(exit=ExitStatus(0)) for i in range(nodes)}


class FakeAgents(Agents):
    """Answers each poll with the next scripted round: {agent: AgentUpdate | exception}."""

    def __init__(
        self,
        rounds: Iterable[dict],
        *,
        unreachable: int | None = None,
        silent: int | None = None,
        tails: dict | None = None,
        errors: dict | None = None,
    ):
        self.rounds = list(rounds)
        self._unreachable = unreachable
        self._silent = silent
        self.tails = tails or {}
        self.error_files = errors or {}
        super().__init__()
        self.stops = 0
        self.ports = iter(range(30000, 30100))

    def poll(self, wait_s: float) -> list:
        answers = self.rounds.pop(0) if self.rounds else {}
        return sorted(answers.items())

    def silent(self, limit_s: float) -> int | None:
        return self._silent if not self.rounds else None

    def unreachable(self, exclude: int):
        if self._unreachable is not None:
            return self._unreachable, ConnectionError("actor died")
        return None

    def tail(self, i: int, local_rank: int | None, n: int) -> list[str]:
        return self.tails.get((i, local_rank), [])[-n:]

    def errors(self, i: int) -> list[RankError]:
        return self.error_files.get(i, [])

    # what Launch.run_attempts needs besides
    def free_port(self) -> int:
        return next(self.ports)

    def start(self, launch_plan, files) -> None:
        super().start(launch_plan, files)
        self.files = files

    def stop(self, grace_s: float, first: int = 15) -> list:
        self.stops += 1
        return []

    def collect(self, subdir: str) -> dict:
        return {i: {"trace.json": f"agent {i} of {id(self)}".encode()} for i in range(3)}


def two_node_plan():
    return plan(cpu_job(), two_nodes(), None, run_id="r", master_port=29500, launcher_env={})


def watch(agents: FakeAgents, hang_timeout_s=None, **watcher):
    """The watch loop's failure over a two-node plan, and every update it handed on."""
    seen = []
    failure = Watcher(
        agents,
        two_node_plan(),
        on_update=lambda node, update: seen.append((node.name, update)),
        hang_timeout_s=hang_timeout_s,
        **watcher,
    ).run()
    return failure, seen


def test_every_node_exiting_0_is_success_and_every_update_is_handed_on():
    rounds = [
        {
            0: AgentUpdate(lines=[(0, "out", "hello")], records=[step(0, 5)]),
            1: AgentUpdate(records=[step(1, 5)]),
        },
        {0: AgentUpdate(exit=ExitStatus(0))},
        {1: AgentUpdate(lines=[(0, "out", "bye")], exit=ExitStatus(0))},
    ]
    failure, seen = watch(FakeAgents(rounds))
    assert failure is None
    assert [name for name, _ in seen] == ["a", "b", "a", "b"]


def test_a_failed_rank_is_named_from_torchruns_root_cause():
    tails = {(1, None): ["noise", *ROOT_CAUSE], (1, 0): ["Traceback", "RuntimeError: x"]}
    failure, _ = watch(FakeAgents([failing_round()], tails=tails))
    assert failure.kind is FailureKind.RANK and failure.restartable
    assert (failure.rank, failure.node, failure.exit_code, failure.signal) == (1, "b", 1, None)
    assert failure.reason == "rank 1 on node b (198.18.0.11) exited with code 1"
    assert failure.log_tail == "Traceback\nRuntimeError: x"


def test_the_structured_error_file_names_the_rank_and_its_exception():
    error = RankError(
        local_rank=0,
        message="ValueError: bad batch",
        traceback="Traceback ...\nValueError: bad batch",
        timestamp=1.0,
    )
    tails = {(0, 0): ["step 3", "[rank0]: something went wrong"]}
    failure, _ = watch(FakeAgents([failing_round(0)], errors={0: [error]}, tails=tails))
    assert (failure.rank, failure.node) == (0, "a")
    assert failure.reason == "rank 0 on node a (198.18.0.10) raised ValueError: bad batch"
    # the traceback, as the rank's lines hold none
    assert failure.log_tail.endswith("ValueError: bad batch")


def test_a_non_finite_stop_is_its_own_kind_and_is_not_restarted():
    """The built-in trainer's NonFiniteError: a restart from the last checkpoint would train the
    same steps into the same NaN, so launch.max_restarts does not apply."""
    error = RankError(local_rank=0, message="NonFiniteError: non-finite at step 5: the loss is nan")
    failure, _ = watch(FakeAgents([failing_round(0)], errors={0: [error]}))
    assert failure.kind is FailureKind.NONFINITE and not failure.restartable
    assert failure.reason.endswith("raised NonFiniteError: non-finite at step 5: the loss is nan")


def torchrun_report(failures: list[tuple[str, int, int]], root: tuple[str, int, int]) -> list[str]:
    """torchrun's failure report: (time, rank, exit code) of the other failures and the root cause."""

    def entry(i: int, when: str, rank: int, code: int) -> list[str]:
        return [
            f"[{i}]:",
            f"  time      : 2026-12-02_08:10:{when}",
            "  host      : h",
            f"  rank      : {rank} (local_rank: {rank})",
            f"  exitcode  : {code} (pid: 1)",
        ]

    lines = ["script.py FAILED", "-" * 20, "Failures:"]
    for i, f in enumerate(failures, start=1):
        lines += entry(i, *f)
    return [*lines, "-" * 20, "Root Cause (first observed failure):", *entry(0, *root), "=" * 20]


PEER = [
    "[rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:931. This is typically "
    "caused by a remote worker crashing.",
    "terminate called without an active exception",
]
OWN = ["Traceback (most recent call last):", "RuntimeError: injected failure at step 30"]


@pytest.mark.parametrize(
    ("other_second", "root_tail", "named"),
    [
        # the same second, and the root cause's log shows its peer's failure: the other rank
        ("52", PEER, 1),
        ("53", PEER, 0),  # a later second: torchrun's order stands
        ("52", OWN, 0),  # the root cause failed on its own: it stands
    ],
)
def test_a_rank_failing_on_its_peer_in_the_same_second_is_not_named(other_second, root_tail, named):
    """torchrun names the lowest rank of failures within one second: rank 0 when it died on the
    broken connection that rank 1's crash left."""
    report = torchrun_report([(other_second, 1, 1)], root=("52", 0, -6))
    agents = FakeAgents(
        [failing_round(0)], tails={(0, None): report, (0, 0): root_tail, (0, 1): OWN}
    )
    node = dataclasses.replace(two_node_plan().nodes[0], nproc=2, ranks=[0, 1])
    failure = rank_failure(agents, 0, node, ExitStatus(1))
    assert failure.rank == named
    assert failure.exit_code == (1 if named == 1 else -6)


def test_a_signal_is_read_from_the_exit_code():
    tails = {(1, None): ROOT_CAUSE[:3] + ["  exitcode  : -9 (pid: 1)"]}
    failure, _ = watch(FakeAgents([failing_round()], tails=tails))
    assert (failure.exit_code, failure.signal) == (-9, "SIGKILL")
    assert "signal SIGKILL" in failure.reason


def test_a_lost_node_is_named_not_its_echo():
    """Node a's ranks fail with 'Connection reset' because node b is gone: blame b."""
    agents = FakeAgents(
        [{0: AgentUpdate(lines=[(0, "err", "Connection reset by peer")], exit=ExitStatus(1))}],
        unreachable=1,
    )
    failure, _ = watch(agents)
    assert failure.kind is FailureKind.LOST_NODE and not failure.restartable
    assert failure.node == "b" and "node b (198.18.0.11) was lost" in failure.reason


class Dying(FakeAgents):
    def tail(self, i: int, local_rank: int | None, n: int) -> list[str]:
        raise ConnectionError("the actor died")


@pytest.mark.parametrize(
    "agents, node, said",
    [
        (FakeAgents([{1: RuntimeError("The actor died")}]), "b", "The actor died"),
        # the failed rank's node lost before its log is read
        (Dying([failing_round()]), "b", "the actor died"),
        (FakeAgents([{0: AgentUpdate(records=[step(0, 1)])}], silent=0), "a", "no answer for 30 s"),
    ],
)
def test_an_agent_that_raises_dies_or_falls_silent_is_a_lost_node(agents, node, said):
    failure, _ = watch(agents)
    assert (failure.kind, failure.node) == (FailureKind.LOST_NODE, node)
    assert said in failure.reason


def test_the_hang_watchdog_blames_the_rank_that_got_least_far():
    """Both ranks go quiet (rank 1 hangs, rank 0 waits for it in a collective): rank 1 got least far."""
    rounds = [{0: AgentUpdate(records=[step(0, 8)]), 1: AgentUpdate(records=[step(1, 5)])}]
    agents = FakeAgents(rounds + [{}] * 10, tails={(1, 0): ["step 5", "sleeping"]})
    now = [0.0]
    poll = agents.poll

    def ten_seconds_a_round(wait_s: float) -> list:
        now[0] += 10.0
        return poll(wait_s)

    agents.poll = ten_seconds_a_round
    failure, _ = watch(agents, hang_timeout_s=25.0, clock=lambda: now[0])
    assert failure.kind is FailureKind.HANG and failure.rank == 1 and failure.node == "b"
    assert "launch.hang_timeout_s=25" in failure.reason and failure.log_tail == "step 5\nsleeping"


def test_a_node_that_finished_is_not_hung_while_another_works_on():
    """Node a's torchrun exited 0; node b's rank goes on reporting (an evaluation after training)."""
    rounds = [
        {
            0: AgentUpdate(records=[step(0, 10)], exit=ExitStatus(0)),
            1: AgentUpdate(records=[step(1, 10)]),
        }
    ]
    rounds += [{1: AgentUpdate(records=[step(1, 10 + n)])} for n in range(1, 8)]
    rounds += [{1: AgentUpdate(exit=ExitStatus(0))}]
    clock = iter(range(0, 10**6, 10)).__next__  # 10 s a reading: node a is quiet for 80 s
    assert watch(FakeAgents(rounds), hang_timeout_s=25.0, clock=clock)[0] is None


def test_no_hang_without_the_watchdog():
    rounds = [{0: AgentUpdate(records=[step(0, 1)])}, {}, {}, done_round()]
    assert watch(FakeAgents(rounds), clock=iter(range(0, 10**6, 1000)).__next__)[0] is None


# -- the restart policy -----------------------------------------------------------------------


def attempts(tmp_path, agents: FakeAgents, **launch):
    run_dir = RunDir(tmp_path / "run")
    run_dir.prepare(cpu_job(launch), two_nodes())
    launcher = Launch(job=cpu_job(launch), cluster=two_nodes(), run_dir=run_dir, quiet=True)
    return launcher.run_attempts(agents), run_dir


def test_a_failed_rank_restarts_every_node_with_a_new_plan(tmp_path):
    agents = FakeAgents([failing_round(), done_round()], tails={(1, None): ROOT_CAUSE})
    outcome, run_dir = attempts(tmp_path, agents, max_restarts=1)
    assert outcome.status is Status.SUCCEEDED and agents.stops == 1
    assert [p.attempt for p in agents.plans] == [0, 1]
    first, second = (json.loads(run_dir.plan_file(a).read_text()) for a in (0, 1))
    assert first["master_port"] != second["master_port"]  # a fresh port per attempt
    assert [n["env"]["LAUNCHER_RESTART_COUNT"] for n in second["nodes"]] == ["1", "1"]
    assert all(
        f"--master-port {second['master_port']}" in " ".join(n["argv"]) for n in second["nodes"]
    )


def test_restarts_run_out(tmp_path):
    rounds = [failing_round(), failing_round(), done_round()]
    agents = FakeAgents(rounds, tails={(1, None): ROOT_CAUSE})
    outcome, run_dir = attempts(tmp_path, agents, max_restarts=1)
    assert outcome.status is Status.FAILED and outcome.failure.rank == 1
    assert len(agents.plans) == 2 and not run_dir.plan_file(2).exists()


@pytest.mark.parametrize(
    "script",
    [
        [{1: RuntimeError("gone")}],  # a lost node
        [{0: AgentUpdate(records=[step(0, 1)])}],  # a silent agent
    ],
)
def test_a_lost_node_is_not_restarted(tmp_path, script):
    agents = FakeAgents(script, silent=1)
    outcome, _ = attempts(tmp_path, agents, max_restarts=3)
    assert outcome.status is Status.FAILED and outcome.failure.kind is FailureKind.LOST_NODE
    assert len(agents.plans) == 1


# -- elastic restarts -------------------------------------------------------------------------


def three_nodes_and_a_spare() -> ClusterSpec:
    return ClusterSpec.model_validate(
        {"nodes": [{"name": f"n{i}", "host": f"198.18.0.{10 + i}"} for i in range(4)]}
    )


def elastic_job(precision: dict | None = None, **train: object) -> JobSpec:
    checkpoint = {"dir": "/shared/ckpt", "every_steps": 2}
    train = {"steps": 10, "warmup_steps": 1, "micro_batch": 4, "grad_accum": 2, **train}
    return JobSpec.model_validate(
        {
            "name": "e",
            "precision": precision or {"dtype": "fp32"},
            "resources": {"device": "cpu", "nproc_per_node": 1, "nodes": 3, "min_nodes": 2},
            "train": {"checkpoint": checkpoint, **train},
            "launch": {"max_restarts": 1},
        }
    )


class FakeSession:
    def __init__(self, refuse: set[str] = frozenset()):
        self.node_ips = {f"n{i}": f"198.18.0.{10 + i}" for i in range(4)}
        self.refuse, self.added = refuse, []

    def add_node(self, node) -> None:
        if node.name in self.refuse:
            raise PreflightError(f"{node.name} cannot join")
        self.added.append(node.name)


@pytest.fixture
def elastic_run(tmp_path, monkeypatch):
    """Runs attempts of a job on three_nodes_and_a_spare() where each attempt's agents are a new
    FakeAgents with the next script: (launch, outcome, the nodes of each placement)."""
    runs = iter(range(10))

    def run(job: JobSpec, rounds_per_attempt, session):
        cluster = three_nodes_and_a_spare()
        scripts = iter(rounds_per_attempt)
        placed, placed_agents = [], []

        def place(session_, nodes, gpus, name):
            placed.append([n.name for n in nodes])
            placed_agents.append(FakeAgents(next(scripts)))
            return placed_agents[-1]

        monkeypatch.setattr(run_mod.AgentGroup, "place", staticmethod(place))
        run_dir = RunDir(tmp_path / f"run{next(runs)}")
        run_dir.prepare(job, cluster)
        launcher = Launch(job=job, cluster=cluster, run_dir=run_dir, quiet=True, skip_parity=True)
        launcher.session = session
        first = FakeAgents(next(scripts))
        first.close = lambda: None
        launcher.placed_agents = placed_agents
        return launcher, launcher.run_attempts(first), placed

    return run


def lost(i: int) -> dict:
    return {i: RuntimeError("actor died")}


def test_a_lost_node_is_replaced_by_the_spare(elastic_run):
    session = FakeSession()
    launcher, outcome, placed = elastic_run(elastic_job(), [[lost(2)], [done_round(3)]], session)
    assert outcome.status is Status.SUCCEEDED
    assert placed == [["n0", "n1", "n3"]] and session.added == ["n3"]
    assert [p.world_size for p in launcher.plans] == [3, 3]
    [restart] = launcher.restarts
    assert (restart.attempt, restart.failed_node, restart.world_size) == (1, "n2", 3)
    assert restart.nodes == ["n0", "n1", "n3"]


def test_without_a_spare_the_job_goes_on_smaller_with_the_same_global_batch(elastic_run):
    session = FakeSession(refuse={"n3"})  # the spare does not join
    job = elastic_job(micro_batch=4, grad_accum=2)
    launcher, outcome, placed = elastic_run(job, [[lost(2)], [done_round()]], session)
    assert outcome.status is Status.SUCCEEDED and placed == [["n0", "n1"]]
    assert [p.world_size for p in launcher.plans] == [3, 2]
    # 4 x 2 x 3 = 24 samples per step; on 2 ranks of 4: 3 micro-batches
    assert json.loads(launcher.run_dir.plan_file(1).read_text())["world_size"] == 2
    assert yaml.safe_load(launcher.placed_agents[0].files["job.yaml"])["train"]["grad_accum"] == 3
    assert launcher.restarts[0].world_size == 2


def test_a_global_batch_that_does_not_divide_refuses_the_restart(elastic_run):
    job = elastic_job(micro_batch=4, grad_accum=1)  # 12 samples over 2 ranks of 4: no
    _, outcome, placed = elastic_run(job, [[lost(2)]], FakeSession(refuse={"n3"}))
    assert outcome.status is Status.FAILED and placed == []
    assert "does not divide" in outcome.failure.reason
    assert "elastic_batch: scale" in outcome.failure.reason
    scaled = elastic_job(micro_batch=4, grad_accum=1, elastic_batch="scale")
    _, outcome, _ = elastic_run(scaled, [[lost(2)], [done_round()]], FakeSession(refuse={"n3"}))
    assert outcome.status is Status.SUCCEEDED


def test_fewer_than_min_nodes_ends_the_job(elastic_run):
    job = elastic_job().model_copy(
        update={"resources": elastic_job().resources.model_copy(update={"min_nodes": 3})}
    )
    _, outcome, placed = elastic_run(job, [[lost(1)]], FakeSession(refuse={"n3"}))
    assert outcome.status is Status.FAILED and placed == []
    assert "fewer than resources.min_nodes=3" in outcome.failure.reason


def test_the_new_attempts_job_file_carries_the_raised_grad_accum():
    first = elastic_job(micro_batch=4, grad_accum=2)
    assert job_for_world(first, 3, 2).train.grad_accum == 3
    assert job_for_world(first, 3, 6).train.grad_accum == 1
    assert job_for_world(first, 3, 3) is first


def test_an_elastic_job_on_other_machines_needs_shared_checkpoints():
    nodes = three_nodes_and_a_spare().nodes[:3]
    check_shared_checkpoints(elastic_job(), nodes)  # /shared/ckpt
    private = elastic_job(checkpoint={"dir": "/tmp/ckpt", "every_steps": 2})
    with pytest.raises(SpecError, match="private to each machine"):
        check_shared_checkpoints(private, nodes)
    check_shared_checkpoints(private, ClusterSpec.this_machine().nodes)  # one machine: fine


def test_a_grad_accum_the_job_cannot_run_with_refuses_the_restart():
    """bf16 weights need grad_accum 1: keeping the global batch on fewer ranks would raise it."""
    first = elastic_job({"dtype": "bf16", "weights": "bf16"}, micro_batch=2, grad_accum=1)
    pattern = "needs train.grad_accum 2, which the job cannot run with: .*grad_accum"
    with pytest.raises(RestartRefused, match=pattern) as refused:
        job_for_world(first, 2, 1)
    assert ".." not in str(refused.value)


def test_an_elastic_restart_keeps_the_failed_attempts_profile_traces(elastic_run):
    """Closing the failed attempt's agents removes their node dirs: the traces are fetched first."""
    job = elastic_job(profile={"start_step": 1, "steps": 1})
    session = FakeSession(refuse={"n3"})
    launcher, outcome, _ = elastic_run(job, [[lost(2)], [done_round()]], session)
    assert outcome.status is Status.SUCCEEDED
    assert sorted(
        p.parent.name for p in (launcher.run_dir.root / "profile").glob("*/trace.json")
    ) == ["n0", "n1", "n2"]


def test_the_hang_blames_the_rank_outside_the_collective_from_the_stacks():
    """Rank 0 got least far by its records, but the stacks show it waits in the all-reduce
    while rank 1 is in its own function: rank 1 is blamed, its frames in the reason, and the
    dumps are handed on before anything is stopped."""
    rounds = [{0: AgentUpdate(records=[step(0, 5)]), 1: AgentUpdate(records=[step(1, 6)])}]
    agents = FakeAgents(rounds + [{}] * 10)
    agents.stacks = lambda: {"rank0.txt": WAITING.encode(), "rank1.txt": STUCK.encode()}
    handed: list = []
    clock = iter(range(0, 10**6, 10)).__next__
    failure, _ = watch(agents, hang_timeout_s=25.0, on_stacks=handed.append, clock=clock)
    assert failure.kind is FailureKind.HANG and (failure.rank, failure.node) == (1, "b")
    assert "not in the all_reduce" in failure.reason
    assert "load_batch (train.py:18) ← main (train.py:29)" in failure.reason
    assert handed and set(handed[0]) == {"rank0.txt", "rank1.txt"}
