"""The nodes of a Slurm allocation as a cluster: the current one, or one asked for (as
``salloc --no-shell`` does) and released at the end (docs/clusters.md, "Slurm")."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from launcher.errors import PreflightError, SpecError
from launcher.remote import expand_nodelist
from launcher.spec import ClusterSpec, NodeSpec
from launcher.spec.cluster import SlurmSpec
from launcher.spec.job import JobSpec

log = logging.getLogger(__name__)

COMMANDS = ("srun", "salloc", "sbatch", "squeue", "scancel", "sinfo", "scontrol")
POLL_S = 2.0
_GRANTED = re.compile(r"(?:Granted|Pending) job allocation (\d+)")


@contextlib.contextmanager
def allocation(job: JobSpec, cluster: ClusterSpec) -> Iterator[ClusterSpec]:
    """``cluster`` (a ``slurm:`` one) with ``nodes`` filled from the allocation it runs in."""
    spec = cluster.slurm
    assert spec is not None
    require_commands()
    want = job.resources.nodes
    current = os.environ.get("SLURM_JOB_ID")
    if current:
        names = expand_nodelist(os.environ.get("SLURM_JOB_NODELIST", ""))
        if want != "all" and want > len(names):
            raise SpecError(
                f"resources.nodes asks for {want} nodes but this Slurm allocation (job {current}) "
                f"has {len(names)} ({', '.join(names)}); ask Slurm for {want} nodes "
                f"(salloc -N{want}) or lower resources.nodes",
                source="job",
                field="resources.nodes",
            )
        yield _with_nodes(cluster, current, names)
        return
    if want == "all":
        raise SpecError(
            "resources.nodes is 'all', but outside a Slurm allocation the launcher must know how "
            "many nodes to ask for: set resources.nodes to a number",
            source="job",
            field="resources.nodes",
        )
    check_partition(spec)
    job_id = None
    try:
        job_id, names = _allocate(job, spec, want)
        yield _with_nodes(cluster, job_id, names)
    finally:
        if job_id is not None:
            release(job_id)


def require_commands() -> None:
    """SpecError (exit 2) when this machine has no Slurm client commands."""
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        raise SpecError(
            f"the cluster file says slurm:, but this machine has no {', '.join(missing)} on its "
            f"PATH; run the launcher on a Slurm login node (or install slurm-client), or use "
            f"nodes: for machines reached over SSH",
            source="cluster",
            field="slurm",
        )


def check_partition(spec: SlurmSpec) -> None:
    """SpecError (exit 2) naming the known partitions when ``spec.partition`` is not one."""
    if spec.partition is None:
        return
    known = _slurm("sinfo", "-h", "-o", "%R").split()
    if spec.partition not in known:
        raise SpecError(
            f"partition {spec.partition!r} is not one Slurm knows (it has: "
            f"{', '.join(sorted(set(known))) or 'none'}); fix slurm.partition",
            source="cluster",
            field="slurm.partition",
        )


def request_options(job: JobSpec, spec: SlurmSpec, nodes: int) -> list[str]:
    """What salloc and sbatch are asked for: the job's nodes, one task per node, the spec's
    options."""
    out = [f"--nodes={nodes}", "--ntasks-per-node=1", f"--job-name=launch-{job.name}"]
    for flag, value in (
        ("--partition", spec.partition),
        ("--account", spec.account),
        ("--time", spec.time),
        ("--constraint", spec.constraint),
        ("--qos", spec.qos),
        ("--gpus-per-node", spec.gpus_per_node),
    ):
        if value is not None:
            out.append(f"{flag}={value}")
    return out + list(spec.sbatch_options)


def release(job_id: str) -> None:
    """Cancel the allocation (its steps and whatever runs in them end with it)."""
    done = subprocess.run(["scancel", job_id], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        log.warning("scancel %s failed: %s", job_id, done.stderr.strip())
    else:
        log.info("Released Slurm allocation %s", job_id)


def _allocate(job: JobSpec, spec: SlurmSpec, nodes: int) -> tuple[str, list[str]]:
    argv = ["salloc", "--no-shell", *request_options(job, spec, nodes)]
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    found: dict[str, str] = {}
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.strip())
            if m := _GRANTED.search(line):
                found.setdefault("id", m.group(1))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + spec.wait_s
    said = None
    try:
        while proc.poll() is None:
            if "id" in found:
                state = _slurm("squeue", "-h", "-j", found["id"], "-o", "%T %r").strip()
                if state and state != said and state.startswith("PENDING"):
                    print(
                        f"Slurm job {found['id']} waits for its allocation: "
                        f"{state.split(' ', 1)[-1]}",
                        file=sys.stderr,
                        flush=True,
                    )
                    said = state
            if time.monotonic() > deadline:
                raise PreflightError(
                    f"Slurm did not start the allocation (job {found.get('id', '?')}, "
                    f"{nodes} node(s)) within slurm.wait_s = {spec.wait_s:g} s; it was "
                    f"cancelled. Ask for fewer nodes, another partition, or raise slurm.wait_s"
                )
            time.sleep(POLL_S)
        reader.join(timeout=5)
        if proc.returncode != 0 or "id" not in found:
            raise PreflightError(
                f"salloc refused the allocation (exit {proc.returncode}): "
                f"{' | '.join(lines[-3:]) or 'no output'}"
            )
        job_id = found.pop("id")
    except BaseException:
        if proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        if "id" in found:
            release(found["id"])
        raise
    names = expand_nodelist(_slurm("squeue", "-h", "-j", job_id, "-o", "%N").strip())
    log.info("Slurm allocation %s: %s", job_id, ", ".join(names))
    return job_id, names


def _with_nodes(cluster: ClusterSpec, job_id: str, names: list[str]) -> ClusterSpec:
    spec = cluster.slurm
    assert spec is not None
    addresses = _node_addresses(names)
    nodes = [
        NodeSpec(
            name=name,
            host=addresses[name],
            python=spec.python or sys.executable,
            gpus=spec.gpus_per_node if spec.gpus_per_node is not None else "auto",
            slurm_job=job_id,
        )
        for name in names
    ]
    return cluster.model_copy(update={"nodes": nodes})


def _node_addresses(names: list[str]) -> dict[str, str]:
    """Each node's NodeAddr as an IP address (torchrun's rendezvous and Ray bind to it)."""
    out = {}
    for line in _slurm("scontrol", "show", "node", "-o", ",".join(names)).splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "NodeName" in fields:
            addr = fields.get("NodeAddr") or fields["NodeName"]
            with contextlib.suppress(OSError):
                addr = socket.gethostbyname(addr)
            out[fields["NodeName"]] = addr
    missing = [n for n in names if n not in out]
    if missing:
        raise PreflightError(f"scontrol does not know the nodes {', '.join(missing)}")
    return out


def _slurm(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise PreflightError(
            f"`{' '.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()[-300:]}"
        )
    return done.stdout
