"""Preflight: probe every node in parallel, compare under parity policies, fail before any
worker starts.

    report = run_preflight(cluster, job)
    report.raise_for_failure()      # PreflightError (exit 3) naming every bad node
"""

from __future__ import annotations

import json
import logging
import shlex
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from launcher import signals
from launcher.errors import EXIT_OK, EXIT_PREFLIGHT
from launcher.preflight.network import Route
from launcher.preflight.parity import PreflightReport, error_record, evaluate, resolve_policies
from launcher.remote import (
    BAD_JSON,
    INTERNAL,
    INTERPRETER_MISSING,
    PROBE_CRASHED,
    CommandResult,
    NodeError,
    fan_out,
    runner_for,
)
from launcher.spec.cluster import ClusterSpec, NodeSpec
from launcher.spec.fit import gpus_needed, nodes_for_job, spec_env
from launcher.spec.job import JobSpec

log = logging.getLogger(__name__)

PROBE_SOURCE = (Path(__file__).parent / "probe.py").read_text()
DEEP_TIMEOUT_S = 120.0
COMMAND_MARGIN_S = 30.0


@dataclass(frozen=True)
class NodeFacts:
    """What the plan needs to know about a node that only the node can say: its GPUs and,
    on a multi-node run, the interface through which it reaches the head."""

    gpus: int
    route: Route | None = None


def run_preflight(
    cluster: ClusterSpec,
    job: JobSpec | None = None,
    *,
    deep: bool = True,
    nodes: list[NodeSpec] | None = None,
) -> PreflightReport:
    """Probe ``nodes`` (default: the job's, else all) in parallel and judge them; never raises
    for a bad node (``PreflightReport.raise_for_failure`` does)."""
    targets = list(nodes) if nodes is not None else nodes_for_job(cluster, job)
    packages = parity_packages(cluster, job)
    policies = resolve_policies(dict(cluster.parity.policies), packages)
    started = time.monotonic()

    head = targets[0].net_address if len(targets) > 1 else None
    probe = partial(probe_node, cluster=cluster, job=job, deep=deep, route_to=head)
    group = fan_out(targets, probe, max_parallel=cluster.ssh.max_parallel)
    probes: dict[str, dict[str, Any]] = {}
    for node in targets:
        outcome = group[node.name]
        if isinstance(outcome, BaseException) and not isinstance(outcome, NodeError):
            log.debug("probing %s raised", node.name, exc_info=outcome)
            outcome = NodeError(INTERNAL, f"{type(outcome).__name__}: {outcome}")
        if isinstance(outcome, NodeError):
            outcome = error_record(node.name, node.host, outcome.kind, outcome.message)
        probes[node.name] = outcome
    log.info("probed %d node(s) in %.2f s", len(targets), time.monotonic() - started)
    return evaluate(probes, packages=packages, policies=policies, deep=deep)


def parity_packages(cluster: ClusterSpec, job: JobSpec | None) -> list[str]:
    """The packages whose versions must agree across nodes: cluster.yaml's ``parity.packages``,
    then those that decide the built-in trainer's kernels for this job (``JobSpec.kernel_packages``)."""
    extra = job.kernel_packages if job is not None else []
    return list(dict.fromkeys([*cluster.parity.packages, *extra]))


def probe_node(
    node: NodeSpec,
    cluster: ClusterSpec,
    job: JobSpec | None,
    *,
    deep: bool,
    route_to: str | None = None,
) -> dict[str, Any]:
    """Run the probe on one node (``route_to``: the head's address, to find the route there);
    raises NodeError with the reason when that fails."""
    python = node.interpreter()
    args = ["-"]
    if deep:
        args += ["--deep", "--deep-timeout", f"{DEEP_TIMEOUT_S:g}"]
    options = {  # those without a value are left out
        "--packages": ",".join(parity_packages(cluster, job)),
        "--gpus-needed": str(gpus_needed(node, job) or ""),
        "--nccl-socket-ifname": spec_env(node, job).get("NCCL_SOCKET_IFNAME"),
        "--route-to": route_to,
    }
    args += [arg for flag, value in options.items() if value for arg in (flag, value)]
    args += shared_code_args(job)
    command = " ".join(shlex.quote(a) for a in [python, *args])
    timeout = cluster.ssh.connect_timeout_s + COMMAND_MARGIN_S + (DEEP_TIMEOUT_S if deep else 0)

    started = time.monotonic()
    with runner_for(node, cluster.ssh) as runner:
        result = runner.run(command, stdin=PROBE_SOURCE, timeout=timeout)
    received = time.time()
    probe = parse_probe_output(result, python)
    probe.update(node=node.name, host=node.host, probe_s=round(time.monotonic() - started, 3))
    if isinstance(probe.get("time"), int | float):
        probe["clock_skew_s"] = round(probe["time"] - received, 3)
    return probe


def parse_probe_output(result: CommandResult, python: str) -> dict[str, Any]:
    """The probe's JSON document, or NodeError: interpreter missing, probe crashed, bad JSON."""
    if result.exit_code in (126, 127) or (
        result.exit_code != 0
        and "No such file or directory" in result.stderr
        and python in result.stderr
    ):
        raise NodeError(
            INTERPRETER_MISSING,
            f"{python} cannot run there (exit {result.exit_code}: {result.stderr_tail(1)}); "
            f"set nodes[].python to a Python with torch and the launcher installed",
        )
    if result.exit_code != 0:
        raise NodeError(
            PROBE_CRASHED, f"exit {result.exit_code}: {result.stderr_tail() or 'no stderr'}"
        )
    # The document is the last line; login scripts may print before it.
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    try:
        probe = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        shown = result.stdout.strip()[-200:]
        raise NodeError(
            BAD_JSON,
            f"the probe printed no JSON document (stdout: {shown!r}; stderr: {result.stderr_tail()!r})",
        ) from None
    if not isinstance(probe, dict):
        raise NodeError(BAD_JSON, f"the probe printed {type(probe).__name__}, not a JSON object")
    return probe


def shared_code_args(job: JobSpec | None) -> list[str]:
    """Probe arguments that check and hash the job's workdir on a shared filesystem (sync: false)."""
    entry = job.script_entry if job is not None else None
    if entry is None or entry.sync is not False:
        return []
    script = Path(entry.script)
    workdir = Path(entry.workdir) if entry.workdir is not None else script.parent
    relative = script.relative_to(workdir) if script.is_relative_to(workdir) else script
    exclude = json.dumps(list(entry.exclude))
    return ["--workdir", str(workdir), "--script", str(relative), "--exclude", exclude]


def preflight_facts(
    job: JobSpec,
    cluster: ClusterSpec,
    *,
    skip: bool,
    save_to: Path | None = None,
    show: bool = True,
    nodes: list[NodeSpec] | None = None,
) -> dict[str, NodeFacts] | None:
    """The preflight (unless skipped) and each node's GPU count for the plan; prints the parity
    table, saves it into ``save_to``, and raises PreflightError (exit 3) for a failed one."""
    if skip:
        log.warning(
            "PARITY CHECK SKIPPED (--skip-parity): nodes are not probed; GPU counts come "
            "from cluster.yaml and a mismatched node will not be caught"
        )
        if save_to is not None:
            save_to.mkdir(parents=True, exist_ok=True)
            (save_to / "parity.txt").write_text("skipped (--skip-parity)\n")
        return None
    report = run_preflight(cluster, job, deep=True, nodes=nodes)
    signals.check()  # interrupted beside Ray's start (its probes killed): no verdict to show
    if save_to is not None:
        report.save(save_to)
    if show or not report.ok:
        print(report.table(), flush=True)
    report.raise_for_failure()
    signals.check()
    return {n: NodeFacts(gpus=report.gpus(n), route=report.routes.get(n)) for n in report.nodes}


def check_command(
    cluster_path: str | None, job_path: str | None, *, fast: bool, as_json: bool
) -> int:
    """``launch check``: print the parity table (or JSON); 0 when every node agrees, else 3."""
    from launcher.spec import check_fits, load_cluster, load_job

    cluster = load_cluster(cluster_path)
    job = load_job(job_path) if job_path else None
    if job is not None:
        check_fits(job, cluster, job_source=str(job_path))
    report = run_preflight(cluster, job, deep=not fast)
    if as_json:
        print(json.dumps(report.to_json(), indent=2, sort_keys=False, default=str))
    else:
        print(report.table())
    return EXIT_OK if report.ok else EXIT_PREFLIGHT
