"""Job and cluster specs: pydantic models and the YAML loader."""

from launcher.spec.cluster import ClusterSpec, NodeSpec
from launcher.spec.fit import check_fits, nodes_for_job
from launcher.spec.job import JobSpec
from launcher.spec.loader import load_cluster, load_job

__all__ = [
    "ClusterSpec",
    "JobSpec",
    "NodeSpec",
    "check_fits",
    "load_cluster",
    "load_job",
    "nodes_for_job",
]
