"""Drive one job end to end: run dir → preflight beside Ray → agents → attempts → summary.

``Launch.execute()`` runs the stages in order; whatever happens, the teardown stops every
worker and the run directory keeps the logs, the metrics and a summary.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from launcher import signals
from launcher.errors import (
    Interrupted,
    JobFailed,
    LauncherError,
    PreflightError,
    UntrustedCheckpoint,
)
from launcher.orchestrate import elastic
from launcher.orchestrate.agents import AgentGroup
from launcher.orchestrate.code import CodePlan, plan_code
from launcher.orchestrate.elastic import Restart, RestartRefused
from launcher.orchestrate.plan import (
    DEFAULT_MASTER_PORT,
    PROFILE_SUBDIR,
    LaunchPlan,
    gpus_per_node,
    plan,
    render,
    worker_counts,
)
from launcher.orchestrate.ray_cluster import RaySession, open_session
from launcher.orchestrate.reach import REACH_TIMEOUT_S
from launcher.orchestrate.records import Failure, FailureKind, Outcome, Status
from launcher.orchestrate.rundir import RunDir, spec_yaml
from launcher.orchestrate.runlog import RunLog
from launcher.orchestrate.sinks import ReportSinks
from launcher.orchestrate.watch import Watcher
from launcher.preflight import NodeFacts, Route, preflight_facts
from launcher.preflight.network import choose_routes
from launcher.remote import Background
from launcher.results.summary import before_training, summarize, write_summary
from launcher.results.summary import render as render_summary
from launcher.spec import ClusterSpec, JobSpec, NodeSpec, nodes_for_job
from launcher.util import divert_logger, process_started, unsafe_path

log = logging.getLogger(__name__)

RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
PREFLIGHT_GRACE_S = 5.0  # interrupted: how long the preflight's stopped probes get to end


@dataclass
class Launch:
    """One launch of one job. A Ray session and a preflight's facts may be passed in (scale).

    ``code`` is a script job's workdir plan (``code.plan_code``); the built-in trainer has none.
    """

    job: JobSpec
    cluster: ClusterSpec
    run_dir: RunDir
    code: CodePlan | None = None
    skip_parity: bool = False
    keep_ray: bool = False
    session: RaySession | None = None
    facts: dict[str, NodeFacts] | None = None
    quiet: bool = False
    # the launching shell's environment (a detached job's: the submitting shell's)
    shell_env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    agents: AgentGroup | None = field(default=None, init=False)
    plan: LaunchPlan | None = field(default=None, init=False)
    log: RunLog = field(init=False)
    timings: dict[str, float] = field(default_factory=dict, init=False)
    plans: list[LaunchPlan] = field(default_factory=list, init=False)  # one per attempt
    restarts: list[Restart] = field(default_factory=list, init=False)
    _used: set[str] = field(default_factory=set, init=False)  # nodes any attempt ran on
    _first_world: int = field(default=0, init=False)
    _own_session: bool = field(default=False, init=False)
    _workers_started: bool = field(default=False, init=False)  # asked any node to start torchrun
    _then: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, init=False)

    def __post_init__(self) -> None:
        self.log = RunLog(self.run_dir, quiet=self.quiet)

    @property
    def nodes(self) -> list[NodeSpec]:
        return nodes_for_job(self.cluster, self.job)

    # -- the stages, in order ----------------------------------------------------------------

    def execute(self) -> Outcome:
        outcome = Outcome(Status.FAILED, self.run_dir.root)
        started = process_started()
        if started is not None and self.session is None:  # one launch per process (not scale's)
            self.timings["start"] = time.time() - started  # Python, imports, the spec
        try:
            with self._timed("run dir"):
                self.run_dir.prepare(self.job, self.cluster)
                if self.job.report.tensorboard or self.job.report.mlflow is not None:
                    self.log.sinks = ReportSinks(self.job, self.run_dir)
            # Ray's notices go to the run's logs, not the console: its token-auth notice from
            # ray.init, everything else once ray.init has cleared the handlers of its logger
            ray_log = self.run_dir.root / "logs" / "ray.log"
            self._then.callback(divert_logger(RAY_AUTH_LOGGER, ray_log))
            if self.facts is None:
                beside = "preflight+ray+agents" if self.agents_need_no_facts else "preflight+ray"
                with self._timed(beside):
                    self.facts = self.preflight_beside_ray(ray_log)
            else:
                self.connect(ray_log)
            if self.agents is None:
                with self._timed("agents"):
                    self.agents = self.place_agents()
            with self._timed("workers"):
                outcome = self.run_attempts(self.agents)
        except KeyboardInterrupt:
            outcome = Outcome(Status.INTERRUPTED, self.run_dir.root)
        except LauncherError as err:
            outcome = Outcome(
                Status.FAILED, self.run_dir.root, Failure(FailureKind.LAUNCHER, str(err))
            )
            raise
        except OSError as err:  # writing the run directory (a full disk), or Ray's connection lost
            reason = f"the launcher could not go on: {type(err).__name__}: {err}"
            outcome = Outcome(
                Status.FAILED, self.run_dir.root, Failure(FailureKind.LAUNCHER, reason)
            )
            # the launch failed before training (exit 3), not the job (4)
            if not self._workers_started:
                raise PreflightError(
                    f"{reason}. No worker was started; what was recorded is in {self.run_dir}"
                ) from err
            raise JobFailed(
                f"{reason}. Every worker was stopped; what was recorded is in {self.run_dir}"
            ) from err
        finally:
            try:
                self.finish(outcome)
            finally:
                self._then.close()
        return outcome

    @property
    def agents_need_no_facts(self) -> bool:
        """A CPU job's agents reserve no GPUs: they can be placed before the preflight's end."""
        return self.job.resources.device == "cpu"

    def preflight_beside_ray(self, ray_log: Path) -> dict[str, NodeFacts] | None:
        """The preflight in a thread while this one connects Ray and, where they need no facts,
        places the agents; the preflight's facts.

        A failed preflight's error wins, raised once Ray's start has ended; interrupted, the
        preflight's probes are stopped.
        """
        self.timings["preflight"] = 0.0
        preflight = Background(self.preflight, name="preflight")
        try:
            self.connect(ray_log)
            if self.agents_need_no_facts and not preflight.failed:
                with self._timed("agents"):
                    self.agents = self.place_agents()
        except Exception:
            self._preflight_verdict(preflight)  # its error first, else Ray's
            raise
        except BaseException:
            preflight.cancel(PREFLIGHT_GRACE_S)
            raise
        return self._preflight_verdict(preflight)

    def _preflight_verdict(
        self, preflight: Background[dict[str, NodeFacts] | None]
    ) -> dict[str, NodeFacts] | None:
        try:
            return preflight.result()
        except BaseException:
            preflight.cancel(PREFLIGHT_GRACE_S)  # interrupted while waiting for it
            raise
        finally:
            self.timings["preflight"] = preflight.seconds

    def preflight(self, nodes: list[NodeSpec] | None = None) -> dict[str, NodeFacts] | None:
        """The preflight of the job's nodes, saved in the run directory, or of ``nodes`` (the
        nodes left and a spare), not saved."""
        return preflight_facts(
            self.job,
            self.cluster,
            skip=self.skip_parity,
            save_to=None if nodes else self.run_dir.preflight,
            show=not self.quiet,
            nodes=nodes,
        )

    def connect(self, ray_log: Path) -> None:
        with self._timed("ray"):
            self.connect_ray()
        self._then.callback(divert_logger("ray", ray_log))

    def connect_ray(self) -> None:
        if self.session is None:
            self.session = open_session(self.cluster, self.nodes, self.code)
            self._own_session = True

    def place_agents(
        self, nodes: list[NodeSpec] | None = None, job: JobSpec | None = None, suffix: str = ""
    ) -> AgentGroup:
        """One agent per node (a placement group of one bundle each); an elastic restart's
        ``nodes`` and ``job`` get a group of their own (``suffix``)."""
        assert self.session is not None
        nodes, job = nodes or self.nodes, job or self.job
        gpus = gpus_per_node(job, nodes, self.facts)
        name = f"launcher-{self.run_dir.run_id}{suffix}"
        agents = AgentGroup.place(self.session, nodes, gpus, name=name)
        signals.check()
        return agents

    def run_attempts(self, agents: AgentGroup) -> Outcome:
        """Plan, start and watch attempts until one succeeds or a failure may not be restarted
        (elastic jobs leave a failed node out: ``reshape``)."""
        attempt, nodes, job, restarted_after = 0, self.nodes, self.job, None
        while True:
            self.plan = self.start_attempt(agents, attempt, nodes=nodes, job=job)
            if restarted_after is not None:
                self.restarts.append(
                    Restart(
                        attempt=attempt,
                        reason=restarted_after.reason,
                        failed_node=restarted_after.node,
                        nodes=[n.name for n in self.plan.nodes],
                        world_size=self.plan.world_size,
                    )
                )
            failure = self._watch(agents)
            if failure is None:
                return Outcome(Status.SUCCEEDED, self.run_dir.root)
            if attempt >= self.job.launch.max_restarts or not (
                failure.restartable
                or (self.job.elastic and failure.kind is not FailureKind.NONFINITE)
            ):
                return self._failed(failure)
            attempt += 1
            log.warning(
                "%s; restarting every worker (restart %d of %d)",
                failure.reason,
                attempt,
                self.job.launch.max_restarts,
            )
            self._ingest(agents.stop(self.job.launch.stop_grace_s))
            if self.job.elastic:
                try:
                    nodes, job = self.reshape(failure, nodes)
                except RestartRefused as err:
                    return self._failed(replace(failure, reason=str(err)))
                if self.job.records_profile:  # closing the agents removes their node dirs
                    self._collect(agents, PROFILE_SUBDIR)
                agents.close()
                agents = self.agents = self.place_agents(nodes, job, f"-{attempt}")
            restarted_after = failure

    def reshape(self, failure: Failure, nodes: list[NodeSpec]) -> tuple[list[NodeSpec], JobSpec]:
        """The next attempt's nodes (the failed one out, a spare in if one passes) and job."""
        left = [n for n in nodes if n.name != failure.node]
        for spare in [n for n in self.cluster.nodes if n.name not in self._used]:  # file order
            self._used.add(spare.name)
            if self.admit(spare, left):
                left.append(spare)
                break
        elastic.check_enough(self.job, left, failure.reason)
        try:
            world = sum(worker_counts(self.job, left, self.facts).values())
        # e.g. a spare admitted without a preflight and no gpus declared
        except LauncherError as err:
            raise RestartRefused(
                f"{failure.reason}; the nodes left cannot be planned: {err}"
            ) from None
        job = elastic.job_for_world(self.job, self._first_world, world)
        if job.train.grad_accum != self.job.train.grad_accum:
            log.warning(
                "world size %d -> %d: grad_accum %d -> %d keeps the global batch",
                self._first_world,
                world,
                self.job.train.grad_accum,
                job.train.grad_accum,
            )
        return left, job

    def admit(self, spare: NodeSpec, nodes: list[NodeSpec]) -> bool:
        """A spare joins when it passes the preflight beside ``nodes`` and joins this Ray."""
        try:
            facts = self.preflight([*nodes, spare])
            assert self.session is not None
            self.session.add_node(spare)
        except LauncherError as err:
            log.warning("spare node %s was not taken: %s", spare.name, err)
            return False
        if facts is not None:
            self.facts = {**(self.facts or {}), **facts}
        log.warning("spare node %s (%s) takes the failed node's place", spare.name, spare.host)
        return True

    def start_attempt(
        self,
        agents: AgentGroup,
        attempt: int,
        *,
        nodes: list[NodeSpec] | None = None,
        job: JobSpec | None = None,
    ) -> LaunchPlan:
        """Plan attempt ``attempt`` on a fresh port (``launch.master_port`` when set), record it,
        start a fresh torchrun on every node (docs/running.md: why not torchrun's restarts)."""
        job = job or self.job
        nodes = nodes or self.nodes
        port = job.launch.master_port or agents.free_port()
        with self._timed("network"):
            routes = self.routes(agents, nodes, attempt)
        launch_plan = plan(
            job,
            self.cluster,
            self.facts,
            run_id=self.run_dir.run_id,
            run_name=self.run_dir.name,
            attempt=attempt,
            master_port=port,
            launcher_env=self.shell_env,
            code=self.code,
            nodes=nodes,
            routes=routes,
        )
        self.run_dir.write_plan(launch_plan)
        if len(nodes) > 1:
            with self._timed("network"):
                self.check_reach(agents, launch_plan)
        self.plan = launch_plan  # from here on the agents' updates are this attempt's
        self.plans.append(launch_plan)
        self._first_world = self._first_world or launch_plan.world_size
        self._used.update(n.name for n in launch_plan.nodes)
        self.log.open(launch_plan)
        # from here on a worker may run (some nodes may start before one fails)
        self._workers_started = True
        # job.yaml on the nodes has env values masked: workers get them from the plan's env.
        agents.start(launch_plan, {"job.yaml": spec_yaml(job)})
        log.info(
            "Started %d worker(s) on %d node(s): %s",
            launch_plan.world_size,
            len(launch_plan.nodes),
            ", ".join(f"{n.name} ranks {n.ranks[0]}-{n.ranks[-1]}" for n in launch_plan.nodes),
        )
        signals.check()
        return launch_plan

    def routes(self, agents: AgentGroup, nodes: list[NodeSpec], attempt: int) -> dict[str, Route]:
        """Each node's interface towards the head: the preflight's, else (no preflight, or a
        head it did not route to) what the agents find themselves."""
        if len(nodes) < 2:
            return {}
        head = nodes[0].net_address
        known = {
            n.name: f.route
            for n in nodes
            if (f := (self.facts or {}).get(n.name)) and f.route and f.route.head == head
        }
        if len(known) == len(nodes):
            return known
        routes, problems = choose_routes(agents.routes(nodes), origin="agent")
        if problems:
            self._network_failed(problems, attempt)
        return routes

    def check_reach(self, agents: AgentGroup, launch_plan: LaunchPlan) -> None:
        """Every node connects to the rendezvous port from its workers' interface (exit 3)."""
        failed = agents.check_reach(launch_plan, REACH_TIMEOUT_S)
        if failed:
            self._network_failed(
                failed,
                launch_plan.attempt,
                f" (master {launch_plan.master_addr}:{launch_plan.master_port}, "
                f"{launch_plan.master_addr_source})",
            )

    def _network_failed(self, problems: dict[str, str], attempt: int, where: str = "") -> None:
        what = "; ".join(f"node {n}: {m}" for n, m in problems.items())
        message = (
            f"{len(problems)} node(s) cannot reach the head's rendezvous port{where}: {what}. "
            f"No worker of this attempt was started. Check the route and firewall between the nodes, or set "
            f"GLOO_SOCKET_IFNAME (and the head's address: in cluster.yaml) by hand"
        )
        if attempt == 0:
            raise PreflightError(message)
        raise JobFailed(message)

    def finish(self, outcome: Outcome) -> None:
        """Teardown, then the summary and the report sinks' last writes; the summary is written
        also when the teardown failed, whose error is logged, not raised over the run's."""
        try:
            with self._timed("teardown"):
                self.teardown()
        except Exception as err:
            log.error(
                "the teardown did not finish cleanly: %s: %s",
                type(err).__name__,
                err,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
        finally:
            try:
                self.write_summary(outcome)
            except OSError as err:
                log.error("could not write the summary into %s: %s", self.run_dir, err)
            if self.log.sinks is not None:
                self.log.sinks.close(outcome.status.value)

    def teardown(self) -> None:
        """Stop every agent's workers, remove the placement group, close what we opened.

        Each step runs even when one before it raised (its error is raised after the rest).
        """
        with contextlib.ExitStack() as then:
            if self._own_session and self.session is not None:
                then.callback(self.session.close, keep_ray=self.keep_ray)
            then.callback(self.log.close)
            if self.agents is not None:
                then.callback(self.agents.close)
                # Ctrl-C reaches the ranks as SIGINT (their KeyboardInterrupt handlers run)
                first = signal.SIGINT if signals.pending() == signal.SIGINT else signal.SIGTERM
                self._ingest(self.agents.stop(self.job.launch.stop_grace_s, first))
                if self.job.records_profile:
                    self._collect(self.agents, PROFILE_SUBDIR)

    def write_summary(self, outcome: Outcome) -> None:
        """summary.{json,csv,txt}: the last attempt's ranks, every restart, each attempt's totals."""
        status = outcome.status.value

        def summary_of(p: LaunchPlan | None, failure: dict | None = None) -> dict:
            records = self.log.by_attempt.get(p.attempt, {}) if p else {}
            ranks = p.ranks() if p else []
            return summarize(self.job.name, ranks, records, status=status, failure=failure)

        # An interruption is no rank's failure: the status says it all.
        failed = outcome.failure if outcome.status is Status.FAILED else None
        failure = failed.to_json() if failed else None
        last = self.plans[-1] if self.plans else None
        summary = summary_of(last, failure)
        summary["restarts"] = [
            r.to_json() for r in elastic.with_steps(self.restarts, self.log.by_attempt)
        ]
        if len(self.plans) > 1:
            summary["attempts"] = [
                {
                    "attempt": p.attempt,
                    "nodes": [n.name for n in p.nodes],
                    "world_size": p.world_size,
                    **summary_of(p)["totals"],
                }
                for p in self.plans
            ]
        summary["stragglers"] = [s.to_json() for s in self.log.stragglers.found.values()]
        summary["launcher_timings_s"] = {k: round(v, 2) for k, v in self.timings.items()}
        write_summary(self.run_dir.root, summary)
        outcome.summary = summary
        if not self.quiet:
            # before training, the error that follows says why: no empty tables
            text = render_summary(summary) if last else before_training(summary, reason=False)
            times = " · ".join(f"{k} {v:.1f} s" for k, v in self.timings.items())
            print(f"{text}\nLauncher time: {times}", flush=True)

    # -- helpers ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _timed(self, stage: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.timings[stage] = self.timings.get(stage, 0.0) + time.monotonic() - start

    def _watch(self, agents: AgentGroup) -> Failure | None:
        assert self.plan is not None
        self.log.start_progress(self.job.train.steps)
        try:
            return Watcher(
                agents,
                self.plan,
                on_update=self.log.ingest,
                hang_timeout_s=self.job.launch.hang_timeout_s,
                on_stacks=self.run_dir.write_stacks,
            ).run()
        finally:
            self.log.stop_progress()

    def _failed(self, failure: Failure) -> Outcome:
        log.error("%s; stopping every worker", failure.reason)
        return Outcome(Status.FAILED, self.run_dir.root, failure)

    def _ingest(self, owed: list) -> None:
        """Updates that came after an attempt was judged (its last lines and records)."""
        if self.plan is not None:
            for i, update in owed:
                self.log.ingest(self.plan.nodes[i], update)

    def _collect(self, agents: AgentGroup, subdir: str) -> None:
        """Copy each node's ``<node dir>/<subdir>`` into ``<run dir>/<subdir>/<node>/``."""
        if self.plan is None:  # no attempt was planned: nothing ran
            return
        for i, files in agents.collect(subdir).items():
            for name, data in files.items():
                path = self.run_dir.node_files(subdir, self.plan.nodes[i].name) / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)


def checked_code(job: JobSpec, cluster: ClusterSpec) -> CodePlan | None:
    """The workdir's plan, after what ``run``, ``dry_run`` and ``launch submit`` check first
    (exit 2): the workdir can travel, an elastic job's checkpoints are shared, and the folder
    it would resume from is not another user's to change."""
    nodes = nodes_for_job(cluster, job)
    code = plan_code(job, nodes)
    elastic.check_shared_checkpoints(job, nodes)
    ckpt = job.train.checkpoint
    resumes = job.uses_builtin and ckpt.resume == "auto"
    if resumes and ckpt.dir is not None and (found := unsafe_path(ckpt.dir)):
        raise UntrustedCheckpoint(*found)
    return code


def run(
    job: JobSpec,
    cluster: ClusterSpec,
    *,
    run_dir: Path | None = None,
    skip_parity: bool = False,
    keep_ray: bool = False,
) -> Outcome:
    """``launch JOB.yaml``: JobFailed (exit 4) or Interrupted (130) after the summary;
    PreflightError (3) where the launcher failed before any worker started; SpecError or
    UsageError (2) for a workdir that cannot travel or a ``run_dir`` that is not empty."""
    code = checked_code(job, cluster)
    where = RunDir.claim(run_dir) if run_dir else RunDir.new(job.name)
    launch = Launch(job, cluster, where, code, skip_parity=skip_parity, keep_ray=keep_ray)
    outcome = launch.execute()
    print(f"Run directory: {outcome.run_dir}", flush=True)
    if outcome.status is Status.INTERRUPTED:
        raise Interrupted(
            f"interrupted: every worker was stopped; logs, metrics so far and a summary "
            f"marked interrupted are in {outcome.run_dir}"
        )
    if outcome.status is Status.FAILED:
        failure = outcome.failure
        tail = "\n".join((failure.log_tail if failure else "").splitlines()[-8:])
        raise JobFailed(
            f"job {job.name!r} failed: {failure.reason if failure else 'a worker failed'}. Every other "
            f"worker was stopped; logs and the summary are in {outcome.run_dir}."
            + (f"\nLast lines of the failing rank:\n{tail}" if tail else "")
        )
    return outcome


def dry_run(job: JobSpec, cluster: ClusterSpec, *, skip_parity: bool = False) -> str:
    """``launch plan``: preflight (unless skipped) and the exact per-node commands; starts nothing.

    A failed preflight prints its parity table here and raises PreflightError (exit 3).
    """
    code = checked_code(job, cluster)
    facts = preflight_facts(job, cluster, skip=skip_parity)
    launch_plan = plan(
        job,
        cluster,
        facts,
        run_id=f"{job.name}-<timestamp>-<id>",
        run_name=f"{job.name}-<timestamp>",
        master_port=job.launch.master_port or DEFAULT_MASTER_PORT,
        launcher_env=os.environ,
        code=code,
    )
    note = "" if job.launch.master_port else " (a free port on the first node is picked at launch)"
    return render(launch_plan, port_note=note)
