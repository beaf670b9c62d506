"""A real Slurm on simulated nodes: slurmctld here, one slurmd inside each network-namespace node.

Everything is private to one cluster: its own munged (key and socket), slurm.conf, state and
spool folders and ports; clients find it through ``SLURM_CONF`` (``env``). Inside each node
slurmd sees the node's own /tmp and ~/.ray (it runs in the node's namespaces) and a tmpfs of
cgroup v1 hierarchies (this kernel's; ``ip netns exec`` leaves /sys/fs/cgroup empty).

Usage::

    with NetnsCluster(2) as nodes, SlurmCluster(nodes) as slurm:
        subprocess.run(["srun", "-N2", "hostname"], env=slurm.env)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
from pathlib import Path

from fixtures.launching import wait_for
from netns import NetnsCluster

from launcher.util import free_port

CHECKOUT = Path(__file__).resolve().parents[1]
REQUIRED = ("munged", "mungekey", "slurmctld", "slurmd", "srun", "sinfo", "scontrol")
CGROUPS = ("cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "pids")


def missing_slurm() -> str | None:
    """Why a Slurm cannot run here, or None."""
    missing = [t for t in REQUIRED if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install slurmctld slurmd slurm-client munge)"
    if Path("/tmp") in CHECKOUT.parents:
        return (
            f"the checkout {CHECKOUT} is under /tmp, which the simulated nodes do not share; Slurm "
            "runs the installed launcher on each node (clone it elsewhere)"
        )
    return None


class SlurmCluster:
    """slurmctld on the bridge's address, slurmd ``nN`` on each node of ``nodes``."""

    def __init__(self, nodes: NetnsCluster, *, partition: str = "main"):
        self.nodes = nodes
        self.partition = partition
        self.dir = nodes.dir / "slurm"
        self.conf = self.dir / "slurm.conf"
        self.names = [f"n{i}" for i in range(len(nodes.node_names))]
        self._procs: list[subprocess.Popen[bytes]] = []

    @property
    def env(self) -> dict[str, str]:
        """This process's environment with SLURM_CONF pointing at this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def __enter__(self) -> SlurmCluster:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """A Slurm command, run in the cluster's folder: a batch job's default output file
        (``slurm-<id>.out`` in the folder it was submitted from) lands there, not in the checkout."""
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env=self.env, cwd=self.dir
        )

    def queue(self) -> list[str]:
        """The job ids in the queue."""
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def close(self) -> None:
        for proc in reversed(self._procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self._procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _start(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "munge"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        munge = d / "munge"
        os.chmod(munge, 0o700)
        key, sock = munge / "munge.key", munge / "socket"
        subprocess.run(["mungekey", "-c", "-k", str(key)], check=True, capture_output=True)
        argv = ["munged", "-F", "--force", f"--key-file={key}", f"--socket={sock}"]
        argv += [f"--{n}-file={munge / n}" for n in ("pid", "log", "seed")]
        self._spawn(argv, d / "munged.out")
        wait_for(sock.exists, timeout=20, what="munged's socket", poll=0.3)
        ctld_port, d_port = free_port(), free_port()
        gateway = self.nodes.gateway
        lines = [
            f"ClusterName=l{self.nodes.uid.replace('-', 'x')}",
            f"SlurmctldHost={socket.gethostname()}({gateway})",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={d_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={sock}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}/%n",
            f"SlurmctldPidFile={d / 'ctld.pid'}",
            f"SlurmdPidFile={d / 'spool'}/d-%n.pid",
            f"SlurmctldLogFile={d / 'ctld.log'}",
            f"SlurmdLogFile={d / 'spool'}/d-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            "SchedulerType=sched/backfill",
            "MailProg=/bin/true",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "KillWait=5",
        ]
        cpus = os.cpu_count() or 1
        lines += [
            f"NodeName={name} NodeAddr={self.nodes.host(node)} CPUs={cpus} State=UNKNOWN"
            for name, node in zip(self.names, self.nodes.node_names, strict=True)
        ]
        lines.append(
            f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
        )
        self.conf.write_text("\n".join(lines) + "\n")
        (d / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        env = self.env
        self._spawn(["slurmctld", "-D", "-f", str(self.conf)], d / "ctld.out", env=env)
        hierarchies = [(c, c) for c in CGROUPS] + [("systemd", "none,name=systemd")]
        mounts = " && ".join(
            ["mount -t tmpfs none /sys/fs/cgroup"]
            + [
                f"mkdir -p /sys/fs/cgroup/{c} && mount -t cgroup -o {o} cgroup /sys/fs/cgroup/{c}"
                for c, o in hierarchies
            ]
        )
        for name, node in zip(self.names, self.nodes.node_names, strict=True):
            pid = self.nodes.sshd_pids(node)[-1]
            slurmd = f"{mounts} && exec slurmd -D -f {self.conf} -N {name}"
            argv = ["nsenter", "-t", str(pid), "-n", "-m", "-u", "-p", "sh", "-c", slurmd]
            self._spawn(argv, d / f"slurmd-{name}.out", env=env)

        def idle() -> bool:
            states = self.run("sinfo", "-h", "-N", "-o", "%t").stdout.split()
            return len(states) == len(self.names) and all(s == "idle" for s in states)

        try:
            wait_for(idle, timeout=60, what="every slurmd idle", poll=0.3)
        except AssertionError as e:
            raise RuntimeError(f"{e}\n{self._logs()}") from None

    def _logs(self) -> str:
        out = []
        for path in sorted(self.dir.glob("*.out")) + sorted(self.dir.glob("*.log")):
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-1500:]}")
        return "\n".join(out)

    def _spawn(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        with open(log, "wb") as out:
            self._procs.append(
                subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            )
