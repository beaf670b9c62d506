"""Job and cluster files in, validated specs out; every failure is a SpecError."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from launcher.errors import SpecError
from launcher.spec import sshconfig
from launcher.spec.cluster import ClusterSpec
from launcher.spec.job import JobSpec
from launcher.spec.messages import validate
from launcher.spec.paths import refuse_nul_paths, resolve_job_paths, with_pretrained_shape
from launcher.spec.report import check_packages
from launcher.spec.yamlfile import apply_overrides, read_yaml

DEFAULT_CLUSTER_FILE = Path("cluster.yaml")


def load_job(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> JobSpec:
    """Read a job file, apply ``--set KEY=VALUE`` overrides and validate."""
    source = Path(path)
    data = read_yaml(source)
    if set(data) & {"nodes", "slurm"} and not set(data) & set(JobSpec.model_fields):
        raise SpecError(
            f"this is a cluster file (it lists 'nodes' or 'slurm'), not a job file: give a job file and "
            f"this one as --cluster, e.g. launch jobs/quickstart.yaml --cluster {source}",
            source=str(source),
        )
    data = apply_overrides(data, overrides)
    job = validate(JobSpec, data, source=str(source), overrides=overrides)
    refuse_nul_paths(job, source)  # before any path is resolved (init_from's is, next)
    if job.model.init_from is not None:
        job = with_pretrained_shape(job, source, overrides)
    job = resolve_job_paths(job, source)
    check_packages(job.report, str(source))
    return job


def load_cluster(path: str | os.PathLike[str] | None = None) -> ClusterSpec:
    """Read a cluster file; with no path, ./cluster.yaml where it exists, else this machine."""
    if path is None:
        if not DEFAULT_CLUSTER_FILE.is_file():
            return ClusterSpec.this_machine()
        path = DEFAULT_CLUSTER_FILE
    source = Path(path)
    data = read_yaml(source)
    if not set(data) & {"nodes", "slurm"} and set(data) & (
        set(JobSpec.model_fields) - set(ClusterSpec.model_fields)
    ):
        raise SpecError(
            f"this is a job file, not a cluster file (it has neither 'nodes' nor 'slurm'): give "
            f"it as the job, e.g. launch {source}, and a cluster file as --cluster",
            source=str(source),
        )
    return with_ssh_addresses(validate(ClusterSpec, data, source=str(source)))


def with_ssh_addresses(cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` with each remote node's ``address`` set to the HostName its SSH config
    gives its host (an alias), where the cluster file sets none."""
    nodes = []
    for node in cluster.nodes:
        if node.address is None and not node.is_local:
            hostname = sshconfig.lookup(node.host, cluster.ssh.config).hostname
            if hostname != node.host:
                node = node.model_copy(update={"address": hostname})
        nodes.append(node)
    return cluster.model_copy(update={"nodes": nodes})
