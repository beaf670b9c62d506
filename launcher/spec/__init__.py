"""Job and cluster specs: pydantic models and the YAML loader."""

from launcher.spec.cluster import ClusterSpec, NodeSpec
from launcher.spec.job import JobSpec
from launcher.spec.loader import apply_overrides, check_fits, load_cluster, load_job, nodes_for_job

__all__ = [
    "ClusterSpec",
    "JobSpec",
    "NodeSpec",
    "apply_overrides",
    "check_fits",
    "load_cluster",
    "load_job",
    "nodes_for_job",
]
