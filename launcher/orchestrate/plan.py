"""The launch plan: a pure function from (job, cluster, node facts) to what runs where.

For every node: its ranks, the exact torchrun argv and the workers' environment with the
source of each variable. ``launch plan`` prints it; ``launch run`` hands it to the agents.
"""

from __future__ import annotations

import ipaddress
import shlex
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from tabulate import tabulate

from launcher import metrics
from launcher.errors import PreflightError, SpecError
from launcher.orchestrate.code import CodePlan, describe
from launcher.preflight import NodeFacts, Route
from launcher.spec import ClusterSpec, JobSpec, NodeSpec, nodes_for_job
from launcher.spec.envforward import forwarded
from launcher.spec.fit import spec_layers
from launcher.spec.job import NCCLSpec
from launcher.util import mask_env

DEFAULT_MASTER_PORT = 29500
# train.profile output: <node dir>/profile on a node, <run dir>/profile/<node> after
PROFILE_SUBDIR = "profile"
STACKS_SUBDIR = "stacks"  # workers' stack dumps and collective traces, on a node and in the run dir
# NCCL's Flight Recorder: the last collectives of every rank, kept in a bounded ring and dumped
# when a collective times out (TORCH_NCCL_DEBUG_INFO_TEMP_FILE is set per node in the plan).
FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
NODE_PASSTHROUGH = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LC_ALL",
    "TZ",
    "TMPDIR",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "LD_LIBRARY_PATH",
    "CUDA_HOME",
    "CUDA_VISIBLE_DEVICES",
)
# The node's folder for a run, in argv, env and cwd: each node's agent puts there a private
# folder it makes (``NodeAgent.start``), as only the node knows its user and temp folder.
NODE_DIR = "{node_dir}"


@dataclass(frozen=True)
class NodePlan:
    name: str
    host: str
    node_rank: int
    nproc: int
    ranks: list[int]
    python: str
    node_dir: str  # NODE_DIR: the launcher's files on the node (job.yaml, metrics/, torchrun/, ...)
    cwd: str | None  # the workers' current directory; None: the copy of the workdir Ray made there
    argv: list[str]
    env: dict[str, str]
    env_sources: dict[str, str] = field(repr=False)
    is_local: bool = False
    route: dict[str, str] | None = None  # Route.to_json: the interface towards the head, and why


@dataclass(frozen=True)
class LaunchPlan:
    job: str
    run_id: str
    world_size: int
    master_addr: str
    master_port: int
    backend: str
    device: str
    nodes: list[NodePlan]
    max_restarts: int = 0
    code: CodePlan | None = None
    attempt: int = 0
    run_name: str = ""  # LAUNCHER_RUN_ID: the run directory's name (``run_id`` adds a suffix)
    master_addr_source: str = "cluster.yaml"

    def ranks(self) -> list[dict[str, Any]]:
        """The rank layout: one entry per global rank."""
        return [
            {
                "rank": rank,
                "node": node.name,
                "host": node.host,
                "local_rank": local_rank,
                "device": f"cuda:{local_rank}" if self.device == "cuda" else "cpu",
            }
            for node in self.nodes
            for local_rank, rank in enumerate(node.ranks)
        ]

    def to_json(self) -> dict[str, object]:
        """plan.json, secrets masked."""
        nodes = [{**asdict(node), "env": mask_env(node.env)} for node in self.nodes]
        return {
            "job": self.job,
            "run_id": self.run_id,
            "run_name": self.run_name,
            "attempt": self.attempt,
            "world_size": self.world_size,
            "master_addr": self.master_addr,
            "master_addr_source": self.master_addr_source,
            "master_port": self.master_port,
            "backend": self.backend,
            "device": self.device,
            "max_restarts": self.max_restarts,
            "code": self.code.to_json() if self.code else None,
            "nodes": nodes,
            "ranks": self.ranks(),
        }


def plan(
    job: JobSpec,
    cluster: ClusterSpec,
    facts: Mapping[str, NodeFacts] | None = None,
    *,
    run_id: str,
    master_port: int,
    launcher_env: Mapping[str, str],
    run_name: str | None = None,
    attempt: int = 0,
    code: CodePlan | None = None,
    nodes: list[NodeSpec] | None = None,
    local_python: str = sys.executable,
    routes: Mapping[str, Route] | None = None,
) -> LaunchPlan:
    """Decide every node's ranks, torchrun argv, worker environment and directory. Pure.

    One plan per attempt, the record of what ran. ``facts`` come from the preflight (None:
    cluster.yaml's GPU counts); ``nodes`` is an elastic restart's node set; ``launcher_env``
    is the launching shell's environment; ``routes`` give each node's interface to the head
    (``GLOO_SOCKET_IFNAME`` and the master address). Node dirs are ``NODE_DIR`` here.
    """
    run_name = run_id if run_name is None else run_name
    nodes = nodes if nodes is not None else nodes_for_job(cluster, job)
    counts = list(worker_counts(job, nodes, facts).values())
    if routes is None:
        routes = {n: f.route for n, f in (facts or {}).items() if f.route is not None}
    if len(nodes) < 2:  # one node: loopback is fine, whatever the routes say
        routes = {}
    master_addr, master_source = master_address(nodes[0], routes)
    plans, first_rank = [], 0
    for node_rank, (node, nproc) in enumerate(zip(nodes, counts, strict=True)):
        route = routes.get(node.name)
        env, sources = _worker_env(
            job, node, launcher_env, run_name=run_name, attempt=attempt, route=route
        )
        python = node.interpreter(local_python)
        torchrun = {
            "--nnodes": len(nodes),
            "--node-rank": node_rank,
            "--nproc-per-node": nproc,
            "--master-addr": master_addr,
            "--master-port": master_port,
            "--max-restarts": 0,  # restarts are the launcher's (see run.py), not torchrun's
            "--rdzv-id": run_id,  # the workers' TORCHELASTIC_RUN_ID
            "--redirects": 3,  # each rank's stdout and stderr in its own files there
            "--log-dir": f"{NODE_DIR}/torchrun",
        }
        argv = [
            python,
            "-m",
            "torch.distributed.run",
            *(str(x) for kv in torchrun.items() for x in kv),
            *_entry_argv(job, code),
        ]
        plans.append(
            NodePlan(
                name=node.name,
                host=node.host,
                node_rank=node_rank,
                nproc=nproc,
                ranks=list(range(first_rank, first_rank + nproc)),
                python=python,
                node_dir=NODE_DIR,
                cwd=code.cwd() if code else NODE_DIR,
                argv=argv,
                env=env,
                env_sources=sources,
                is_local=node.is_local,
                route=route.to_json() if route else None,
            )
        )
        first_rank += nproc
    return LaunchPlan(
        job=job.name,
        run_id=run_id,
        world_size=first_rank,
        master_addr=master_addr,
        master_addr_source=master_source,
        master_port=master_port,
        backend=job.backend,
        device=job.resources.device,
        nodes=plans,
        max_restarts=job.launch.max_restarts,
        code=code,
        attempt=attempt,
        run_name=run_name,
    )


def master_address(head: NodeSpec, routes: Mapping[str, Route]) -> tuple[str, str]:
    """The head's address for torchrun's rendezvous, and where it comes from: cluster.yaml's
    ``address`` or IP host as given, else as the other nodes reach it (``routes``)."""
    if head.address:
        return head.address, "cluster.yaml (the head's address)"
    if _is_ip(head.host) or not routes:
        return head.host, "cluster.yaml (the head's host)"
    master_ip = next(iter(routes.values())).master_ip
    return master_ip, f"{head.host} as the other nodes resolve it"


def render(launch_plan: LaunchPlan, *, port_note: str = "") -> str:
    """The plan for people: a node/rank table, then each node's command and environment."""
    lp = launch_plan
    head = (
        f"Plan for job '{lp.job}'{f' (restart {lp.attempt})' if lp.attempt else ''}: "
        f"{len(lp.nodes)} node(s), world size {lp.world_size}, "
        f"backend {lp.backend}, master {lp.master_addr}:{lp.master_port}{port_note}"
    )
    if not lp.master_addr_source.startswith("cluster.yaml"):
        head += f" ({lp.master_addr_source})"
    if lp.max_restarts:
        head += (
            f"\nOn a failure the launcher restarts every node's torchrun up to {lp.max_restarts} "
            f"time(s), each restart planned anew with a fresh torchrun, on a fresh port unless "
            f"launch.master_port fixes it (LAUNCHER_RESTART_COUNT counts them)"
        )
    table = tabulate(
        [[n.node_rank, n.name, n.host, n.nproc, _span(n.ranks), n.python] for n in lp.nodes],
        headers=["node_rank", "node", "host", "nproc", "ranks", "python"],
    )
    parts = [head, *([describe(lp.code)] if lp.code else []), "", table]
    for node in lp.nodes:
        env_rows = sorted(
            [[k, v, node.env_sources.get(k, "")] for k, v in mask_env(node.env).items()]
            + [[k, "(the node's own)", "node"] for k in NODE_PASSTHROUGH if k not in node.env]
        )
        where = (
            node.cwd
            or f"the copy of {lp.code.workdir if lp.code else 'the workdir'} Ray makes on the node"
        )
        parts += [
            "",
            f"[{node.name}] command (in {where}; {NODE_DIR}: a private folder made on the node "
            f"for this run, removed at its end):",
            "  " + shlex.join(node.argv),
            f"[{node.name}] worker environment:",
            tabulate(env_rows, headers=["name", "value", "from"], tablefmt="plain"),
        ]
    return "\n".join(parts)


def worker_counts(
    job: JobSpec, nodes: list[NodeSpec], facts: Mapping[str, NodeFacts] | None = None
) -> dict[str, int]:
    """Workers (torchrun's nproc) per node: the preflight's GPU counts, else cluster.yaml's.
    PreflightError for too few GPUs; SpecError for ``gpus: auto`` with ``--skip-parity``."""
    return {node.name: _nproc(job, node, (facts or {}).get(node.name)) for node in nodes}


def gpus_per_node(
    job: JobSpec, nodes: list[NodeSpec], facts: Mapping[str, NodeFacts] | None = None
) -> dict[str, int]:
    """GPUs each node's agent reserves in Ray: one per worker on cuda, none on cpu."""
    if job.resources.device == "cpu":
        return {node.name: 0 for node in nodes}
    return worker_counts(job, nodes, facts)


# -- internals ------------------------------------------------------------------------------


def _nproc(job: JobSpec, node: NodeSpec, facts: NodeFacts | None) -> int:
    if job.resources.device == "cpu":
        return 1 if job.resources.nproc_per_node == "auto" else job.resources.nproc_per_node
    if facts is not None:
        gpus, origin = facts.gpus, "the preflight found"
    elif node.gpus != "auto":
        gpus, origin = node.gpus, "cluster.yaml declares"
    else:
        raise SpecError(
            f"node {node.name!r} has gpus: auto, which only the preflight can resolve; run "
            f"without --skip-parity or declare the node's GPU count in cluster.yaml",
            source="cluster.yaml",
            field=f"nodes.{node.name}.gpus",
        )
    want = gpus if job.resources.nproc_per_node == "auto" else job.resources.nproc_per_node
    if want < 1 or want > gpus:
        raise PreflightError(
            f"node {node.name!r} ({node.host}): the job needs {max(want, 1)} GPU worker(s) "
            f"but {origin} {gpus} GPU(s); lower resources.nproc_per_node or use other nodes"
        )
    return want


def _entry_argv(job: JobSpec, code: CodePlan | None) -> list[str]:
    if job.script_entry is None:
        return ["-m", "launcher.train", "--job", f"{NODE_DIR}/job.yaml"]
    assert code is not None, "a script entrypoint needs its CodePlan (code.plan_code)"
    return [code.script, *job.script_entry.args]


def _worker_env(
    job: JobSpec,
    node: NodeSpec,
    launcher_env: Mapping[str, str],
    *,
    run_name: str,
    attempt: int,
    route: Route | None,
) -> tuple[dict[str, str], dict[str, str]]:
    env: dict[str, str] = {}
    sources: dict[str, str] = {}

    def put(items: Mapping[str, str], source: str) -> None:
        env.update(items)
        sources.update(dict.fromkeys(items, source))

    if job.backend == "nccl":
        trace = f"{NODE_DIR}/{STACKS_SUBDIR}/nccl_trace_rank_"
        put({**FLIGHT_RECORDER, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": trace}, "launcher (hangs)")
    layers = spec_layers(job, node)
    default = ("job nccl.env", NCCLSpec().env)
    if default in layers:  # a default the job file leaves as it is yields to the shell
        put(default[1], "job nccl.env (default)")
    shell = forwarded(launcher_env, job.launch.env_forward, everything=node.is_local)
    put(shell, "shell" if node.is_local else "shell (launch.env_forward)")
    for source, items in layers:
        if (source, items) != default:
            put(items, source)
    if route is not None and "GLOO_SOCKET_IFNAME" not in env:
        put({"GLOO_SOCKET_IFNAME": route.interface}, route.source)
    put(
        {
            "LAUNCHER_RUN_ID": run_name,
            "LAUNCHER_NODE": node.name,
            "LAUNCHER_RESTART_COUNT": str(attempt),
            metrics.ENV_VAR: f"{NODE_DIR}/{metrics.SUBDIR}/{metrics.file_name('{rank}')}",
            "LAUNCHER_STACKS_DIR": f"{NODE_DIR}/{STACKS_SUBDIR}",
            "PYTHONUNBUFFERED": "1",
        },
        "launcher",
    )
    if job.records_profile:
        put({"LAUNCHER_PROFILE_DIR": f"{NODE_DIR}/{PROFILE_SUBDIR}"}, "launcher (train.profile)")
    return env, sources


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _span(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
