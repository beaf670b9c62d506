"""Drive one job end to end: run dir → preflight → plan → Ray → agents → watch → summary.

``Launch`` holds one launch's state; its stages are methods named after what they do and
``execute()`` runs them in order. Whatever happens (a failed rank, Ctrl-C, SIGTERM, a lost
node) the ``finally`` path stops every agent, removes the placement group and closes the Ray
session, and the run directory keeps the logs, the metrics so far and a summary.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from launcher import signals
from launcher.errors import Interrupted, JobFailed, LauncherError
from launcher.orchestrate.code import CodePlan, plan_code
from launcher.orchestrate.plan import (
    DEFAULT_MASTER_PORT,
    PROFILE_SUBDIR,
    LaunchPlan,
    NodeFacts,
    mask_env,
    plan,
    render,
)
from launcher.orchestrate.ray_cluster import RaySession, open_session
from launcher.spec import ClusterSpec, JobSpec, NodeSpec, nodes_for_job

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5
NODE_SILENCE_S = 30.0  # an agent that answers no poll for this long is a lost node
ROOT_CAUSE_RANK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
ROOT_CAUSE_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")
ERROR_LINE = re.compile(r"Traceback|Error|Exception|FAILED|Signal \d+", re.IGNORECASE)


@dataclass
class Outcome:
    status: str  # succeeded | failed | interrupted
    failure: dict[str, Any] | None = None
    summary: dict[str, Any] | None = None
    run_dir: Path | None = None


@dataclass
class _Agent:
    node: NodeSpec
    handle: Any
    plan: Any = None
    pending: Any = None
    pending_since: float = 0.0
    exit: dict[str, Any] | None = None


@dataclass
class Launch:
    """One launch of one job. Reusable pieces (a Ray session, a preflight) may be passed in.

    ``code`` is a script job's workdir plan (``code.plan_code``); the built-in trainer has none.
    """

    job: JobSpec
    cluster: ClusterSpec
    run_dir: Path
    code: CodePlan | None = None
    skip_parity: bool = False
    keep_ray: bool = False
    session: RaySession | None = None
    facts: dict[str, NodeFacts] | None = None
    quiet: bool = False
    _own_session: bool = False
    _agents: list[_Agent] = field(default_factory=list)
    _pg: Any = None
    _plan: LaunchPlan | None = None
    _records: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    _last_seen: dict[int, float] = field(default_factory=dict)
    _last_step: dict[int, tuple[int, float]] = field(default_factory=dict)
    _logs: dict[tuple[str, int | None], Any] = field(default_factory=dict)
    _started_at: float = 0.0
    _attempt: int = 0
    _timings: dict[str, float] = field(default_factory=dict)

    @property
    def nodes(self) -> list[NodeSpec]:
        return nodes_for_job(self.cluster, self.job)

    # -- the stages, in order ----------------------------------------------------------------

    def execute(self) -> Outcome:
        outcome = Outcome(status="failed", run_dir=self.run_dir)
        try:
            with self._timed("run dir"):
                self.prepare_run_dir()
            if self.facts is None:
                with self._timed("preflight"):
                    self.facts = self.preflight()
            with self._timed("ray"):
                self.connect_ray()
            with self._timed("agents"):
                self.start_agents()
            with self._timed("workers"):
                outcome = self.watch()
        except KeyboardInterrupt:
            outcome = Outcome(status="interrupted", run_dir=self.run_dir,
                              failure={"reason": "interrupted (SIGINT/SIGTERM)"})
        except LauncherError as err:
            outcome = Outcome(status="failed", run_dir=self.run_dir,
                              failure={"reason": str(err), "exit_code": None, "signal": None})
            self.teardown()
            self.write_summary(outcome)
            raise
        finally:
            if outcome.summary is None:
                self.teardown()
                self.write_summary(outcome)
        return outcome

    def prepare_run_dir(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for sub in ("logs", "metrics", "preflight"):
            (self.run_dir / sub).mkdir(exist_ok=True)
        _write_private(self.run_dir / "job.yaml", _yaml(self.job))
        _write_private(self.run_dir / "cluster.yaml", _yaml(self.cluster))

    def preflight(self) -> dict[str, NodeFacts] | None:
        if self.skip_parity:
            log.warning("PARITY CHECK SKIPPED (--skip-parity): nodes are not probed; GPU counts "
                        "come from cluster.yaml and a mismatched node will not be caught")
            (self.run_dir / "preflight" / "parity.txt").write_text("skipped (--skip-parity)\n")
            return None
        from launcher.preflight import run_preflight

        report = run_preflight(self.cluster, self.job, deep=True)
        report.save(self.run_dir / "preflight")
        if not self.quiet:
            print(report.table(), flush=True)
        report.raise_for_failure()
        signals.check()
        return _node_facts(report, self.nodes)

    def connect_ray(self) -> None:
        if self.session is not None:
            return
        # ray.init() replaces the SIGTERM handler with one that calls sys.exit(15): SIGTERM
        # would then skip the interrupted path (summary, exit 130). Keep ours, also mid-init
        # (keep_handlers; where ours are not installed, put back whatever was there after).
        previous = signal.getsignal(signal.SIGTERM)
        try:
            with signals.keep_handlers():
                self.session = open_session(self.cluster, self.nodes, self.code)
            self._own_session = True
            signals.check()  # a signal whose exception Python dropped while Ray forked
        except SystemExit as exit_:
            if exit_.code != signal.SIGTERM:
                raise
            _shutdown_ray()
            raise KeyboardInterrupt("SIGTERM while Ray was starting") from None
        except KeyboardInterrupt:
            _shutdown_ray()  # a half-started Ray of ours: stop it now, not at interpreter exit
            raise
        finally:
            if previous is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, previous)

    def start_agents(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from launcher.orchestrate.agent import NodeAgent

        assert self.session is not None
        gpus = self._gpus_per_node()
        bundles = [{"CPU": 1, f"node:{self.session.node_ips[n.name]}": 0.001,
                    **({"GPU": gpus[n.name]} if gpus[n.name] else {})} for n in self.nodes]
        # One bundle per node, pinned to it, so bundle i (agent i) is node_rank i.
        self._pg = placement_group(bundles, strategy="STRICT_SPREAD" if len(bundles) > 1 else "PACK",
                                   name=f"launcher-{self.run_dir.name}")
        try:
            ray.get(self._pg.ready(), timeout=60)
        except Exception as err:
            raise JobFailed(
                f"Ray could not place one agent per node (bundles {bundles}) within 60 s: "
                f"{str(err).splitlines()[0] if str(err) else type(err).__name__}. Check `ray "
                f"status`: every node needs a free CPU and its GPUs"
            ) from err
        actor = ray.remote(NodeAgent)
        for i, node in enumerate(self.nodes):
            handle = actor.options(
                num_cpus=1, num_gpus=gpus[node.name],
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i),
            ).remote(node.name)
            self._agents.append(_Agent(node=node, handle=handle))
        port = self.job.launch.master_port or ray.get(self._agents[0].handle.free_port.remote(), timeout=60)
        self._plan = plan(self.job, self.cluster, self.facts, run_id=self.run_dir.name,
                          master_port=port, launcher_env=os.environ, code=self.code)
        _write_private(self.run_dir / "plan.json", json.dumps(self._plan.to_json(), indent=2) + "\n")
        for agent, node_plan in zip(self._agents, self._plan.nodes, strict=True):
            agent.plan = node_plan
            for rank in node_plan.ranks:
                self._log_file(node_plan.name, rank)  # every rank has a log, even a silent one
        self._start_workers(port)
        log.info("Started %d worker(s) on %d node(s): %s", self._plan.world_size, len(self.nodes),
                 ", ".join(f"{n.name} ranks {n.ranks[0]}-{n.ranks[-1]}" for n in self._plan.nodes))
        signals.check()

    def _start_workers(self, port: int) -> None:
        """Start torchrun on every node (attempt ``self._attempt``, rendezvous on ``port``).

        Restarts are the launcher's, not torchrun's: torchrun's own ``--max-restarts`` reuses its
        rendezvous store, and the restarted workers read the previous attempt's addresses from
        it (gloo: "connectFullMesh ... Connection refused"; torch 2.13, static and c10d
        rendezvous alike). A fresh torchrun on a fresh port per attempt has no such state, and
        restarts every node, not just the one whose worker failed.
        """
        import ray

        assert self._plan is not None
        job_text = _yaml(self.job)  # env values masked: workers get them from the plan's env
        starts = []
        for agent in self._agents:
            node_plan = agent.plan
            argv = _with_option(node_plan.argv, "--master-port", str(port))  # a fresh port per attempt
            env = {**node_plan.env, "LAUNCHER_RESTART_COUNT": str(self._attempt)}
            payload = {"node_dir": node_plan.node_dir, "cwd": node_plan.cwd, "argv": argv, "env": env}
            starts.append(agent.handle.start.remote(payload, {"job.yaml": job_text}))
            agent.exit, agent.pending = None, None
        ray.get(starts, timeout=120)
        # The hang watchdog counts from here: preflight and Ray start-up are not a rank's silence.
        self._started_at = time.monotonic()
        self._last_seen.clear()

    def _restart(self, failure: dict[str, Any]) -> None:
        """Stop every node's workers and start them again (the job resumes from its checkpoint)."""
        import ray

        self._attempt += 1
        log.warning("%s; restarting every worker (restart %d of %d)", failure["reason"], self._attempt,
                    self.job.launch.max_restarts)
        grace = self.job.launch.stop_grace_s
        for agent in self._agents:  # answers to polls already sent: the old attempt's last lines
            if agent.pending is not None:
                with contextlib.suppress(Exception):
                    self._ingest(agent, ray.get(agent.pending, timeout=NODE_SILENCE_S))
                agent.pending = None
        ray.get([a.handle.stop.remote(grace) for a in self._agents], timeout=grace + 30)
        self._drain_after_stop()
        port = self.job.launch.master_port or ray.get(self._agents[0].handle.free_port.remote(), timeout=60)
        self._start_workers(port)

    def watch(self) -> Outcome:
        import ray

        progress = _Progress(self.job, disable=self.quiet)
        try:
            while True:
                signals.check()
                now = time.monotonic()
                for agent in self._agents:
                    if agent.pending is None and agent.exit is None:
                        agent.pending, agent.pending_since = agent.handle.poll.remote(POLL_INTERVAL_S), now
                pending = [a.pending for a in self._agents if a.pending is not None]
                # Agents long-poll (answer at once when there is news): wait for the first answer.
                ready, _ = (ray.wait(pending, num_returns=1, timeout=2 * POLL_INTERVAL_S)
                            if pending else ([], []))
                ready_set = set(ready)
                exits: list[tuple[_Agent, dict[str, Any]]] = []
                for agent in self._agents:
                    if agent.pending is None or agent.pending not in ready_set:
                        continue
                    ref, agent.pending = agent.pending, None
                    try:
                        update = ray.get(ref)
                    except Exception as err:
                        return self._fail(self._lost(agent, err))
                    self._ingest(agent, update, progress)
                    if update["exit"] is not None:
                        agent.exit = update["exit"]
                        exits.append((agent, update["exit"]))
                failed = [(agent, status) for agent, status in exits if status["exit_code"] != 0]
                if failed:
                    # A lost node makes the ranks elsewhere fail too ("Connection reset by peer"),
                    # sometimes before Ray reports its agent gone: name the node, not the echo.
                    lost = self._unreachable(exclude=failed[0][0])
                    if lost is not None:
                        return self._fail(lost)
                    failure = self._failure(*failed[0])
                    if self._attempt >= self.job.launch.max_restarts:
                        return self._fail(failure)
                    self._restart(failure)
                    continue
                if all(a.exit is not None for a in self._agents):
                    return Outcome(status="succeeded", run_dir=self.run_dir)
                silent = [a for a in self._agents
                          if a.pending is not None and time.monotonic() - a.pending_since > NODE_SILENCE_S]
                if silent:
                    return self._fail(self._lost(silent[0], TimeoutError(
                        f"no answer for {NODE_SILENCE_S:.0f} s")))
                hung = self._hung_rank()
                if hung is not None:
                    return self._fail(hung)
        finally:
            progress.close()

    @contextlib.contextmanager
    def _timed(self, stage: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self._timings[stage] = self._timings.get(stage, 0.0) + time.monotonic() - start

    def teardown(self) -> None:
        """Stop every agent's workers, remove the placement group, close what we opened."""
        with self._timed("teardown"):
            self._teardown()

    def _teardown(self) -> None:
        if not self._agents and self._pg is None and self.session is None:
            # Nothing of Ray's to undo (interrupted in the preflight: importing ray now could
            # trip over a module that the interrupt left half-imported).
            self._close_logs()
            return
        import ray

        if self._agents and ray.is_initialized():
            grace = self.job.launch.stop_grace_s
            stops = [a.handle.stop.remote(grace) for a in self._agents]
            try:
                ray.get(stops, timeout=grace + 15)
            except Exception as err:
                log.warning("could not confirm that every agent stopped: %s", str(err).splitlines()[0])
            self._drain_after_stop()
            if self.job.records_profile:
                self._collect(PROFILE_SUBDIR)
            cleanups = [a.handle.cleanup.remote() for a in self._agents]
            with contextlib.suppress(Exception):
                ray.get(cleanups, timeout=15)
            for agent in self._agents:
                with contextlib.suppress(Exception):
                    ray.kill(agent.handle)
            self._agents = []
        if self._pg is not None and ray.is_initialized():
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
            self._pg = None
        self._close_logs()
        if self._own_session and self.session is not None:
            self.session.close(keep_ray=self.keep_ray)
            self.session = None

    def _collect(self, subdir: str) -> None:
        """Copy each node's ``<node dir>/<subdir>`` into ``<run dir>/<subdir>/<node>/``."""
        import ray

        for agent in self._agents:
            try:
                files = ray.get(agent.handle.collect.remote(subdir), timeout=60)
            except Exception as err:
                log.warning("could not fetch %s/ from node %s: %s", subdir, agent.node.name, str(err).splitlines()[0])
                continue
            for name, data in files.items():
                path = self.run_dir / subdir / agent.node.name / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)

    def _close_logs(self) -> None:
        for fh in self._logs.values():
            fh.close()
        self._logs.clear()

    def write_summary(self, outcome: Outcome) -> None:
        from launcher.report.summary import render as render_summary
        from launcher.report.summary import summarize, write_summary

        ranks = self._plan.ranks() if self._plan else []
        # An interruption is no rank's failure: the status says it all.
        failure = None if outcome.status == "interrupted" else _summary_failure(outcome.failure)
        summary = summarize(self.job.name, ranks, self._records, status=outcome.status, failure=failure)
        summary["launcher_timings_s"] = {k: round(v, 2) for k, v in self._timings.items()}
        write_summary(self.run_dir, summary)
        outcome.summary = summary
        if not self.quiet:
            print(render_summary(summary), flush=True)
            print("Launcher time: " + " · ".join(f"{k} {v:.1f} s" for k, v in self._timings.items()),
                  flush=True)

    # -- watch helpers ------------------------------------------------------------------------

    def _ingest(self, agent: _Agent, update: dict[str, Any], progress: _Progress | None = None) -> None:
        """An agent's update into the run directory; rank 0's lines and errors shown.

        ``progress`` is watch()'s bar. The drains after a stop have none: their lines are printed
        plainly, as a disabled bar would, and their step records move no bar.
        """
        node_plan = agent.plan
        for local_rank, text in update["lines"]:
            rank = node_plan.rank_of(local_rank) if local_rank is not None and local_rank < node_plan.nproc else None
            self._log_file(node_plan.name, rank).write(text + "\n")
            if not self.quiet and (rank == 0 or ERROR_LINE.search(text)):
                shown = f"[{node_plan.name}/{'rank' + str(rank) if rank is not None else 'torchrun'}] {text}"
                if progress is not None:
                    progress.write(shown)
                else:
                    print(shown, flush=True)
        for fh in self._logs.values():
            fh.flush()
        now = time.monotonic()
        for rank, record in update["records"]:
            self._records.setdefault(rank, []).append(record)
            self._last_seen[rank] = now
            if record.get("type") == "step" and isinstance(record.get("step"), int):
                self._last_step[rank] = (record["step"], float(record.get("time") or 0.0))
            with open(self.run_dir / "metrics" / f"rank{rank}.jsonl", "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")
            if progress is not None:
                progress.update(rank, record)

    def _log_file(self, node: str, rank: int | None) -> Any:
        key = (node, rank)
        if key not in self._logs:
            name = f"rank{rank}.log" if rank is not None else "torchrun.log"
            (self.run_dir / "logs" / node).mkdir(parents=True, exist_ok=True)
            self._logs[key] = open(self.run_dir / "logs" / node / name, "a", encoding="utf-8")  # noqa: SIM115
        return self._logs[key]

    def _drain_after_stop(self) -> None:
        import ray

        for agent in self._agents:
            with contextlib.suppress(Exception):
                self._ingest(agent, ray.get(agent.handle.poll.remote(), timeout=10))

    def _failure(self, agent: _Agent, status: dict[str, Any]) -> dict[str, Any]:
        import ray

        node_plan = agent.plan
        lines = ray.get(agent.handle.tail.remote(None, 200), timeout=10)
        rank, local_rank, code = None, None, status["exit_code"]
        # The last "Root Cause" block: after a restart the tail still holds the earlier ones.
        starts = [i for i, line in enumerate(lines) if "Root Cause" in line]
        for line in lines[starts[-1]:] if starts else []:
            if (m := ROOT_CAUSE_RANK.search(line)) and rank is None:
                rank, local_rank = int(m.group(1)), int(m.group(2))
            elif (m := ROOT_CAUSE_EXIT.search(line)) and rank is not None:
                code = int(m.group(1))
                break
        signal_name = None
        if code is not None and code < 0:
            with contextlib.suppress(Exception):
                signal_name = signal.Signals(-code).name
        tail = ray.get(agent.handle.tail.remote(local_rank, 20), timeout=10) if local_rank is not None else lines[-20:]
        return {"rank": rank, "node": node_plan.name, "host": node_plan.host, "exit_code": code,
                "signal": signal_name or status.get("signal"), "log_tail": "\n".join(tail),
                "reason": f"rank {rank if rank is not None else '?'} on node {node_plan.name} "
                          f"({node_plan.host}) exited with "
                          + (f"signal {signal_name}" if signal_name else f"code {code}")}

    def _unreachable(self, exclude: _Agent) -> dict[str, Any] | None:
        """The first other agent that does not answer a trivial call within a few seconds, as a lost node."""
        import ray

        others = [a for a in self._agents if a is not exclude]
        refs = [a.handle.hostname.remote() for a in others]
        ray.wait(refs, num_returns=len(refs), timeout=5.0)
        for agent, ref in zip(others, refs, strict=True):
            try:
                ray.get(ref, timeout=0.1)
            except Exception as err:
                return self._lost(agent, err)
        return None

    def _lost(self, agent: _Agent, err: BaseException) -> dict[str, Any]:
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return {"rank": agent.plan.ranks[0] if agent.plan else None, "node": agent.node.name,
                "host": agent.node.host, "exit_code": None, "signal": None, "log_tail": "",
                "reason": f"node {agent.node.name} ({agent.node.host}) was lost: its agent stopped "
                          f"answering ({text})"}

    def _hung_rank(self) -> dict[str, Any] | None:
        limit = self.job.launch.hang_timeout_s
        if not limit or self._plan is None:
            return None
        now = time.monotonic()
        silent = [e for e in self._plan.ranks()
                  if now - self._last_seen.get(e["rank"], self._started_at) > limit]
        # A hung rank stalls the others at their next collective, so several go silent at
        # once: blame the one that got least far (lowest step, then the oldest record).
        silent.sort(key=lambda e: self._last_step.get(e["rank"], (-1, 0.0)))
        if not silent:
            return None
        entry = silent[0]
        rank = entry["rank"]
        quiet_s = now - self._last_seen.get(rank, self._started_at)
        return {"rank": rank, "node": entry["node"], "host": entry["host"], "exit_code": None,
                "signal": None, "log_tail": self._rank_tail(entry["node"], entry["local_rank"]),
                "reason": f"rank {rank} on node {entry['node']} made no progress (no metrics "
                          f"record) for {quiet_s:.0f} s > launch.hang_timeout_s={limit:g}"}

    def _rank_tail(self, node: str, local_rank: int) -> str:
        import ray

        agent = next((a for a in self._agents if a.node.name == node), None)
        if agent is None:
            return ""
        try:
            return "\n".join(ray.get(agent.handle.tail.remote(local_rank, 20), timeout=10))
        except Exception:  # a lost agent has no tail to give; the logs on disk remain
            return ""

    def _fail(self, failure: dict[str, Any]) -> Outcome:
        log.error("%s; stopping every worker", failure["reason"])
        return Outcome(status="failed", failure=failure, run_dir=self.run_dir)

    def _gpus_per_node(self) -> dict[str, int]:
        if self.job.resources.device == "cpu":
            return {n.name: 0 for n in self.nodes}
        want = self.job.resources.nproc_per_node
        out = {}
        for node in self.nodes:
            have = self.facts[node.name].gpus if self.facts else node.gpus
            out[node.name] = have if want == "auto" else want
        return out


def run(job: JobSpec, cluster: ClusterSpec, *, run_dir: Path | None = None, skip_parity: bool = False,
        keep_ray: bool = False) -> Outcome:
    """``launch JOB.yaml``: raises JobFailed (exit 4) or Interrupted (130) after the summary.

    A workdir that cannot travel raises SpecError (exit 2) before anything is made or started.
    """
    code = plan_code(job, nodes_for_job(cluster, job))
    launch = Launch(job=job, cluster=cluster, run_dir=run_dir or default_run_dir(job.name),
                    code=code, skip_parity=skip_parity, keep_ray=keep_ray)
    outcome = launch.execute()
    print(f"Run directory: {outcome.run_dir}", flush=True)
    if outcome.status == "interrupted":
        raise Interrupted(f"interrupted: every worker was stopped; logs, metrics so far and a summary "
                          f"marked interrupted are in {outcome.run_dir}")
    if outcome.status == "failed":
        f = outcome.failure or {}
        tail = "\n".join((f.get("log_tail") or "").splitlines()[-8:])
        raise JobFailed(
            f"job {job.name!r} failed: {f.get('reason', 'a worker failed')}. Every other worker was "
            f"stopped; logs and the summary are in {outcome.run_dir}."
            + (f"\nLast lines of the failing rank:\n{tail}" if tail else "")
        )
    return outcome


def dry_run(job: JobSpec, cluster: ClusterSpec, *, skip_parity: bool = False) -> str:
    """``launch plan``: preflight (unless skipped) and the exact per-node commands; starts nothing.

    A failed preflight prints its parity table here and raises PreflightError (exit 3).
    """
    code = plan_code(job, nodes_for_job(cluster, job))
    facts = None
    parity = ""
    if skip_parity:
        log.warning("PARITY CHECK SKIPPED (--skip-parity): GPU counts come from cluster.yaml")
    else:
        from launcher.preflight import run_preflight

        report = run_preflight(cluster, job, deep=True)
        if not report.ok:  # the table `launch check` prints, then main()'s error paragraph (exit 3)
            print(report.table(), flush=True)
        report.raise_for_failure()
        parity = report.table() + "\n\n"
        facts = _node_facts(report, nodes_for_job(cluster, job))
    port = job.launch.master_port or DEFAULT_MASTER_PORT
    launch_plan = plan(job, cluster, facts, run_id=f"{job.name}-<timestamp>", master_port=port,
                       launcher_env=os.environ, code=code)
    note = "" if job.launch.master_port else " (a free port on the first node is picked at launch)"
    return parity + render(launch_plan, port_note=note)


def default_run_dir(job_name: str) -> Path:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = Path("runs") / f"{job_name}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = Path("runs") / f"{job_name}-{stamp}-{n}"
    return path


# -- small helpers --------------------------------------------------------------------------


class _Progress:
    """A live bar: rank 0's step of total, aggregate tokens/s over ranks, ETA."""

    def __init__(self, job: JobSpec, *, disable: bool):
        self.total = job.train.steps
        self.rates: dict[int, float] = {}
        self.bar = None
        if not disable and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="step", dynamic_ncols=True, leave=False)

    def update(self, rank: int, record: dict[str, Any]) -> None:
        if record.get("type") != "step":
            return
        interval = record.get("interval_s")
        if interval:
            self.rates[rank] = record.get("tokens", 0) / interval
        if rank == 0 and self.bar is not None and "step" in record:
            self.bar.n = min(record["step"], self.total)
            self.bar.set_postfix_str(f"{sum(self.rates.values()) / 1e3:,.1f}k tok/s")

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _shutdown_ray() -> None:
    import ray

    with contextlib.suppress(Exception):
        ray.shutdown()


def _with_option(argv: list[str], option: str, value: str) -> list[str]:
    """``argv`` with ``option``'s value replaced (unchanged when the option is absent)."""
    out = list(argv)
    if option in out:
        out[out.index(option) + 1] = value
    return out


def _node_facts(report: Any, nodes: list[NodeSpec]) -> dict[str, NodeFacts]:
    """What the plan needs from a passed preflight: each node's GPU count."""
    return {n.name: NodeFacts(gpus=report.gpus(n.name)) for n in nodes}


def _summary_failure(failure: dict[str, Any] | None) -> dict[str, Any] | None:
    if failure is None:
        return None
    keys = ("rank", "node", "host", "exit_code", "signal", "log_tail", "reason")
    return {k: failure.get(k) for k in keys}


def _yaml(model: Any) -> str:
    """A spec as YAML for run records, every ``env`` mapping's secret-looking values masked."""
    return yaml.safe_dump(_mask_envs(model.model_dump(mode="json")), sort_keys=False)


def _mask_envs(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: (mask_env(v) if k == "env" and isinstance(v, dict) else _mask_envs(v))
                for k, v in data.items()}
    if isinstance(data, list):
        return [_mask_envs(v) for v in data]
    return data


def _write_private(path: Path, text: str) -> None:
    """Files that hold environment values are readable by their owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
