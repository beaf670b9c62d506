"""How a job fits a cluster: the nodes it runs on, the checks that need no node, the GPUs and
the environment the specs give each node."""

from __future__ import annotations

from collections.abc import Mapping

from launcher.errors import SpecError
from launcher.spec.cluster import ClusterSpec, NodeSpec
from launcher.spec.job import JobSpec, refusal_at


def nodes_for_job(
    cluster: ClusterSpec, job: JobSpec | None, *, job_source: str = "job"
) -> list[NodeSpec]:
    """The nodes a job runs on: the first ``resources.nodes`` (all for ``all`` or without a job).

    Raises SpecError when the job asks for more nodes than the cluster has.
    """
    if job is None or job.resources.nodes == "all":
        return list(cluster.nodes)
    if job.resources.nodes > len(cluster.nodes):
        names = ", ".join(n.name for n in cluster.nodes)
        raise SpecError(
            f"resources.nodes asks for {job.resources.nodes} nodes but the cluster has "
            f"{len(cluster.nodes)} ({names}); lower resources.nodes or add nodes to cluster.yaml",
            source=job_source,
            field="resources.nodes",
        )
    return list(cluster.nodes[: job.resources.nodes])


def check_fits(job: JobSpec, cluster: ClusterSpec, *, job_source: str = "job") -> None:
    """Checks between a job and a cluster that need no node: asking for more nodes than exist,
    a cuda job on a node that declares no GPUs, what the trainer refuses at the world size the
    cluster gives (bf16 weights that FSDP would shard over its ranks)."""
    nodes = nodes_for_job(cluster, job, job_source=job_source)
    if job.resources.min_nodes is not None and job.resources.min_nodes > len(nodes):
        raise SpecError(
            f"resources.min_nodes {job.resources.min_nodes} is more than the {len(nodes)} node(s) the "
            f"job runs on; lower resources.min_nodes or add nodes",
            source=job_source,
            field="resources.min_nodes",
        )
    for node in nodes:
        if job.resources.device == "cuda" and node.gpus == 0:
            raise SpecError(
                f"device cuda needs GPUs but cluster node {node.name!r} declares gpus: 0; "
                f"use resources.device cpu or fix the node's gpus",
                source=job_source,
                field="resources.device",
            )
    if job.uses_builtin:
        # At least this many ranks (nproc_per_node auto: the GPUs a node declares, else 1).
        world = sum(declared_workers(job, node) or 1 for node in nodes)
        refusal = refusal_at(job, world)
        if refusal is not None:  # the job's own checks passed: one that needs the world size
            raise SpecError(
                f"on {world} ranks: {refusal}", source=job_source, field="precision.weights"
            )


def declared_workers(job: JobSpec, node: NodeSpec) -> int | None:
    """Workers per node known without probing it, or None where only the preflight can tell."""
    per_node = job.resources.nproc_per_node
    if isinstance(per_node, int):
        return per_node
    if job.resources.device == "cpu":
        return 1
    return node.gpus if isinstance(node.gpus, int) else None


def gpus_needed(node: NodeSpec, job: JobSpec | None) -> int:
    """GPUs the preflight requires of a node: what cluster.yaml declares, and what a cuda job runs there."""
    declared = node.gpus if isinstance(node.gpus, int) else 0
    if job is None or job.resources.device != "cuda":
        return declared
    per_node = job.resources.nproc_per_node
    return max(declared, per_node if isinstance(per_node, int) else 1)


def spec_env(node: NodeSpec, job: JobSpec | None) -> dict[str, str]:
    """The worker environment the specs set (the later layer wins)."""
    return {k: v for _, items in spec_layers(job, node) for k, v in items.items()}


def spec_layers(job: JobSpec | None, node: NodeSpec) -> list[tuple[str, Mapping[str, str]]]:
    """(source, variables) in precedence order, lowest first: nccl.env, launch.env, the node's env."""
    layers: list[tuple[str, Mapping[str, str]]] = []
    if job is not None:
        layers += [("job nccl.env", job.nccl.env), ("job launch.env", job.launch.env)]
    return [*layers, (f"cluster nodes.{node.name}.env", node.env)]
