"""Run commands on nodes: one Runner interface for this machine, SSH and Slurm, and a fan-out.

``runner_for(node, ssh)`` picks the runner (``launcher.remote.ssh``, which brings fabric and
paramiko, is imported only where SSH is used). Secrets go through ``stdin``, never the
command line.
"""

from __future__ import annotations

from launcher.remote.base import (
    AUTH_FAILED,
    BAD_JSON,
    HOST_KEY_MISMATCH,
    INTERNAL,
    INTERPRETER_MISSING,
    PROBE_CRASHED,
    TIMEOUT,
    UNKNOWN_HOST_KEY,
    UNREACHABLE,
    CommandResult,
    NodeError,
    Runner,
)
from launcher.remote.fanout import Background, fan_out, parallel_map
from launcher.remote.local import LocalRunner
from launcher.remote.quoting import remote_command
from launcher.remote.route import route_to
from launcher.remote.srun import SrunRunner, expand_nodelist
from launcher.spec.cluster import NodeSpec, SSHSpec

__all__ = [
    "AUTH_FAILED",
    "BAD_JSON",
    "HOST_KEY_MISMATCH",
    "INTERNAL",
    "INTERPRETER_MISSING",
    "PROBE_CRASHED",
    "TIMEOUT",
    "UNKNOWN_HOST_KEY",
    "UNREACHABLE",
    "Background",
    "CommandResult",
    "LocalRunner",
    "NodeError",
    "Runner",
    "SrunRunner",
    "expand_nodelist",
    "fan_out",
    "parallel_map",
    "remote_command",
    "runner_for",
    "tunnel_needed",
]


def runner_for(node: NodeSpec, ssh_spec: SSHSpec) -> Runner:
    """An SrunRunner for a node of a Slurm allocation, a LocalRunner for this machine
    (``NodeSpec.is_local``), else an SSHRunner."""
    if node.slurm_job is not None:
        return SrunRunner(node)
    if node.is_local:
        return LocalRunner(node)
    from launcher.remote.ssh import SSHRunner

    return SSHRunner(node, ssh_spec)


def tunnel_needed(node: NodeSpec, ssh_spec: SSHSpec) -> bool:
    """True when this machine reaches ``node`` only through a jump host or ProxyCommand: its
    ports (Ray Client, the Jobs API) must then be forwarded over SSH."""
    return not node.is_local and route_to(node, ssh_spec).indirect
