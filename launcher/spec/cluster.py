"""The cluster spec: which nodes, how to reach them, which Ray, which parity rules."""

from __future__ import annotations

import re
import socket
import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from launcher.spec.base import NAME_PATTERN, EnvDict, Port, Strict

Policy = Literal["exact", "minor", "major", "warn", "ignore"]

LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1"}


def _runnable_anywhere(v: str) -> str:
    """The interpreter is run over SSH, srun, Ray and the node agent without a shell: an absolute
    path, or a name looked up on the node's PATH. '~' and relative paths would mean something
    else in each (the shell quoting keeps '~' literal; the agent's cwd is Ray's)."""
    if v.startswith("/") or "/" not in v and not v.startswith("~"):
        return v
    raise ValueError(
        f"python {v!r}: give an absolute path on the node (e.g. /home/me/venv/bin/python) "
        f"or a command on its PATH (python3); '~' and relative paths are not expanded"
    )


NodePython = Annotated[str, AfterValidator(_runnable_anywhere)]


class NodeSpec(Strict):
    name: str = Field(
        pattern=NAME_PATTERN,
        description="pinned. Node name, unique; names log folders and table columns.",
    )
    host: str = Field(
        min_length=1,
        description="pinned. Address or hostname that the other nodes and the launcher reach it on; localhost means this machine (no SSH).",
    )
    port: int = Field(
        22, ge=1, le=65535, description="SSH port; default: the SSH config's Port, else 22."
    )
    user: str | None = Field(None, description="SSH user for this node; default ssh.user.")
    python: NodePython | None = Field(
        None,
        description="Python interpreter on the node with torch and the launcher installed; default: this interpreter for local nodes, python3 on remote ones.",
    )
    gpus: Literal["auto"] | int = Field(
        "auto", description="GPUs on the node; auto asks the node (preflight)."
    )
    env: EnvDict = Field(
        default_factory=dict,
        description="Environment for this node's workers (e.g. NCCL_SOCKET_IFNAME).",
    )
    slurm_job: str | None = Field(
        None,
        description="Set by the launcher: the Slurm job whose allocation holds this node; its commands go through srun.",
    )
    address: str | None = Field(
        None,
        description="Address the other nodes reach it on; default: the HostName the SSH config gives host, else host.",
    )

    @field_validator("gpus")
    @classmethod
    def _gpus_nonneg(cls, v: Literal["auto"] | int) -> Literal["auto"] | int:
        if isinstance(v, int) and v < 0:
            raise ValueError(f"gpus must be 'auto' or a count >= 0, not {v}")
        return v

    @field_validator("host", "address")
    @classmethod
    def _plain_host(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9.:_-]+", v):
            raise ValueError(f"{v!r} is not a hostname or IP address")
        return v

    @property
    def is_local(self) -> bool:
        """localhost or one of this machine's own names: the node needs no SSH."""
        return self.host in LOCAL_HOSTS or self.host in {socket.gethostname(), socket.getfqdn()}

    @property
    def net_address(self) -> str:
        """Where other nodes (and Ray, and torchrun's rendezvous) reach this node."""
        return self.address or self.host

    def interpreter(self, local_python: str = sys.executable) -> str:
        """The Python that runs the launcher's code on this node (probe, Ray, torchrun)."""
        return self.python or (local_python if self.is_local else "python3")


class SSHSpec(Strict):
    user: str | None = Field(
        None, description="pinned. SSH user; default: the SSH config's User, else the current user."
    )
    key: Path | None = Field(
        None,
        description="pinned. Private key file; default: the SSH config's IdentityFile and ssh-agent, else ~/.ssh defaults.",
    )
    known_hosts: Path = Field(
        Path("~/.ssh/known_hosts"),
        description="pinned. Host keys to verify nodes against; default: the SSH config's UserKnownHostsFile, else ~/.ssh/known_hosts.",
    )
    config: Path | None = Field(
        Path("~/.ssh/config"),
        description="OpenSSH client config read for host aliases, HostName, User, Port, IdentityFile, UserKnownHostsFile, ProxyJump and ProxyCommand; null: none.",
    )
    accept_unknown_host_keys: bool = Field(
        False,
        description="Accept (and record) host keys not in known_hosts. Off by default: an unknown key is refused.",
    )
    connect_timeout_s: float = Field(
        10.0, gt=0, le=300, description="pinned. Give up connecting to a node after this long."
    )
    max_parallel: int = Field(
        32, ge=1, le=1024, description="Most SSH connections open at once during fan-out."
    )


class RaySpec(Strict):
    address: str | None = Field(
        None,
        description="pinned. null: the launcher decides (embedded when every node is local, else bootstrap over SSH); auto, host:port or ray://host:port: attach to a running cluster and never stop it.",
    )
    port: Port = Field(6379, description="GCS port when the launcher starts Ray on the head node.")
    client_port: Port = Field(
        10001,
        description="Ray Client port on the head node; the launcher drives a bootstrapped cluster through it.",
    )
    dashboard: bool = Field(
        False,
        description="Start Ray's dashboard (on the head, bound to localhost). Detached jobs (launch submit) always start it: it serves the Jobs API.",
    )
    dashboard_port: Port = Field(
        8265,
        description="The dashboard and Jobs API port on the head (bound to its 127.0.0.1); detached-job commands reach it through an SSH tunnel to the head.",
    )
    jobs_address: str | None = Field(
        None,
        description="Jobs API address of an attached cluster, e.g. http://ray-head.example:8265; null: the head's dashboard port on 127.0.0.1, through an SSH tunnel when the head is remote.",
    )
    join_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="How long to wait for every node to join a bootstrapped cluster.",
    )

    @field_validator("address")
    @classmethod
    def _address_form(cls, v: str | None) -> str | None:
        if v is None or v == "auto":
            return v
        if not re.fullmatch(r"(ray://)?[A-Za-z0-9._-]+:\d{1,5}", v):
            raise ValueError(f"address {v!r} must be null, auto, host:port or ray://host:port")
        return v

    @field_validator("jobs_address")
    @classmethod
    def _jobs_address_form(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"https?://[A-Za-z0-9._-]+(:\d{1,5})?/?", v):
            raise ValueError(f"jobs_address {v!r} must be http://host:port or https://host:port")
        return v


class SlurmSpec(Strict):
    partition: str | None = Field(
        None, description="Partition to allocate from; default: Slurm's default partition."
    )
    account: str | None = Field(None, description="Account to charge (sbatch --account).")
    time: str | None = Field(
        None, description="Time limit of the allocation, as Slurm writes it (e.g. 2:00:00)."
    )
    gpus_per_node: int | None = Field(
        None,
        ge=0,
        description="GPUs to ask for on each node (--gpus-per-node); default: none asked.",
    )
    constraint: str | None = Field(None, description="Node features required (--constraint).")
    qos: str | None = Field(None, description="Quality of service (--qos).")
    sbatch_options: list[str] = Field(
        default_factory=list,
        description="More options for salloc and sbatch, each as on their command line (e.g. --exclusive).",
    )
    wait_s: float = Field(
        600.0, gt=0, description="Give up when the allocation has not started after this long."
    )
    python: NodePython | None = Field(
        None,
        description="Python on the nodes with torch and the launcher; default: this interpreter (a shared filesystem).",
    )


class ParitySpec(Strict):
    packages: list[str] = Field(
        default_factory=list,
        description="pinned. Extra Python packages whose versions must agree across nodes; a job's kernel packages (flash-attn-4, triton, torchao) are added where it uses them.",
    )
    policies: dict[str, Policy] = Field(
        default_factory=dict,
        description="Per-field policy overriding the defaults: exact, minor, major, warn or ignore (e.g. {python: minor, driver: warn}).",
    )


class ClusterSpec(Strict):
    nodes: list[NodeSpec] = Field(
        default_factory=list,
        description="pinned. The nodes; the first is the head (node_rank 0, master address). Or slurm: instead.",
    )
    slurm: SlurmSpec | None = Field(
        None,
        description="The nodes of a Slurm allocation instead of nodes: the current one (SLURM_JOB_ID), else one the launcher asks for.",
    )
    ssh: SSHSpec = Field(default_factory=SSHSpec, description="pinned. How to reach remote nodes.")
    ray: RaySpec = Field(
        default_factory=RaySpec, description="pinned. Which Ray cluster runs the node agents."
    )
    parity: ParitySpec = Field(
        default_factory=ParitySpec, description="pinned. What must agree across nodes."
    )

    @model_validator(mode="after")
    def _checks(self) -> ClusterSpec:
        if self.slurm is not None and self.nodes:
            raise ValueError(
                "slurm: and nodes: are given together; a cluster is either a list of nodes "
                "(reached over SSH) or a Slurm allocation: keep one"
            )
        if self.slurm is None and not self.nodes:
            raise ValueError("the cluster needs nodes: (at least one) or slurm:")
        for attr in ("name", "host"):
            values = [getattr(node, attr) for node in self.nodes]
            for i, value in enumerate(values):
                if attr == "host" and self.nodes[i].is_local and len(values) > 1:
                    raise ValueError(
                        f"nodes[{i}] host {value!r} is this machine; a multi-node cluster needs "
                        f"addresses the other nodes can reach (use this machine's IP)"
                    )
                if (first := values.index(value)) < i:
                    raise ValueError(
                        f"nodes[{i}] repeats {attr} {value!r} of nodes[{first}]; each node needs its own {attr}"
                    )
        if self.ray.jobs_address is not None and self.ray.address is None:
            raise ValueError(
                "ray.jobs_address is for a cluster the launcher attaches to: set ray.address too "
                "(auto, host:port or ray://host:port), or drop jobs_address and let the launcher "
                "start Ray (it reaches its own Jobs API itself)"
            )
        return self

    @property
    def all_local(self) -> bool:
        return all(n.is_local for n in self.nodes)

    @staticmethod
    def this_machine() -> ClusterSpec:
        """The default cluster when no cluster.yaml exists: this machine alone."""
        return ClusterSpec(nodes=[NodeSpec(name="local", host="localhost")])
