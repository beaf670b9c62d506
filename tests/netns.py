"""Simulated multi-node clusters on one machine: network namespaces with a real sshd each.

The root namespace is the "login node" where the launcher runs. Node ``i`` gets its own network
namespace with an ``eth0`` at ``198.18.X.(10+i)`` on a bridge (``198.18.X.1`` in the root
namespace; X picked per cluster); its own mount, UTS and PID namespaces (hostname = node name,
private tmpfs ``/tmp``, ``/dev/shm`` and ``/root/.ray``); and a real ``sshd``, root login by key
only. With ``login_node=True`` the other nodes sit on an inner bridge reachable only through
node 0 (ProxyJump, tunnels).

Keys, configs and ``known_hosts`` live under ``/var/tmp/launcher-netns-<pid>-<n>/``. Every name
is unique per cluster, so sessions run side by side; ``close()`` removes everything, and the
next cluster reaps those a killed process left.

    with NetnsCluster(3) as c:
        c.cluster_yaml(tmp_path / "cluster.yaml")
        c.exec("node1", "ip link set eth0 down")      # fault injection
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml

NS_PREFIX = "lnch-"
STATE_ROOT = Path("/var/tmp")
DIR_PREFIX = "launcher-netns-"
LOCK_FILE = STATE_ROOT / "launcher-netns.lock"
SSHD = "/usr/sbin/sshd"
READY_TIMEOUT_S = 20.0  # for every node's sshd to answer
# root by key only, no PAM, no DNS; room for a fan-out's many connections; errors only
SSHD_OPTIONS = (
    "PermitRootLogin prohibit-password\nPubkeyAuthentication yes\nPasswordAuthentication no\n"
    "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nUseDNS no\nPidFile none\n"
    "MaxStartups 200\nMaxSessions 100\nLogLevel ERROR\n"
)
REQUIRED_TOOLS = ("ip", "unshare", "nsenter", "ssh-keygen", SSHD)

_counter = itertools.count()
_alive: set[NetnsCluster] = set()


def missing_requirements() -> str | None:
    """Why simulated clusters cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root)"
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing tools: {', '.join(missing)} (apt-get install iproute2 util-linux openssh-server)"
    return None


class NetnsError(RuntimeError):
    """Setting up or tearing down a simulated cluster failed."""


class NetnsCluster:
    """``n_nodes`` simulated nodes, each a network namespace running sshd (see the module doc)."""

    def __init__(self, n_nodes: int, *, bare_login: bool = False, login_node: bool = False):
        if not 1 <= n_nodes <= 200:
            raise ValueError(f"n_nodes must be 1..200, not {n_nodes}")
        # bare_login: an empty ~/.bashrc in the nodes, so that a login costs no shell start-up
        # (for benchmarks that measure the launcher's own cost)
        self.bare_login = bare_login
        self.login_node = login_node
        self.inner_subnet: ipaddress.IPv4Network | None = None
        self.owner_pid = os.getpid()
        count = next(_counter)
        self.uid = f"{self.owner_pid}-{count}"
        self.node_names = [f"node{i}" for i in range(n_nodes)]
        self.dir = STATE_ROOT / f"{DIR_PREFIX}{self.uid}"
        # Interface names are limited to 15 characters: pid and counter in hex keep them short.
        short = f"{self.owner_pid:x}x{count:x}"
        self.bridge = f"lnb{short}"
        self.inner_bridge = f"lni{short}"
        self._veth_prefix = f"lv{short}"
        self.subnet: ipaddress.IPv4Network | None = None
        self._sshd: dict[str, subprocess.Popen[bytes]] = {}
        self._created_ns: list[str] = []
        self._bridges: list[str] = []  # those created, deleted by close()

    # -- names and addresses ------------------------------------------------------------------

    def namespace(self, node: str) -> str:
        """The ``ip netns`` name of a node."""
        return f"{NS_PREFIX}{self.uid}-{node}"

    def host(self, node: str | int) -> str:
        """A node's address (with ``login_node``: node 0's outer one, the others' inner one)."""
        index = self._index(node)
        if self.login_node and index > 0:
            return str(self._inner_addr(10 + index))
        return str(self._addr(10 + index))

    @property
    def gateway(self) -> str:
        """The root namespace's (the login node's) address on the bridge."""
        return str(self._addr(1))

    def unused_host(self) -> str:
        """An address in the subnet with no node behind it (an unreachable host)."""
        return str(self._addr(250))

    @property
    def ssh_key(self) -> Path:
        """The private key every node accepts for root."""
        return self.dir / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        """A known_hosts file holding every node's host key."""
        return self.dir / "known_hosts"

    def authorized_keys(self, node: str) -> Path:
        """The node's authorized_keys for root (``ssh_key``'s public key); rewrite it to refuse."""
        return self.dir / f"{node}.authorized_keys"

    def extra_key(self, name: str = "wrong") -> Path:
        """A freshly generated private key that no node accepts."""
        path = self.dir / f"{name}_ed25519"
        if not path.exists():
            keygen(path)
        return path

    # -- the cluster file ---------------------------------------------------------------------

    def cluster_dict(
        self, *, nodes: dict[str, dict[str, Any]] | None = None, **sections: Any
    ) -> dict[str, Any]:
        """A cluster spec for these nodes as a dict.

        ``nodes`` maps node names to overrides merged into that node's entry; a name that is
        not a node of this cluster adds a node (give it a ``host``). Other keyword arguments
        are top-level sections (``ssh``, ``ray``, ``parity``) deep-merged into the defaults.
        """
        entries = {name: {"name": name, "host": self.host(name)} for name in self.node_names}
        for name, extra in (nodes or {}).items():
            entries.setdefault(name, {"name": name}).update(extra)
        python = str(self.node_python())
        data: dict[str, Any] = {
            "nodes": [{"port": 22, "python": python, **entry} for entry in entries.values()],
            "ssh": {
                "user": "root",
                "key": str(self.ssh_key),
                "known_hosts": str(self.known_hosts),
                "connect_timeout_s": 5,
            },
        }
        return _deep_merge(data, sections)

    def node_python(self, interpreter: str = sys.executable, copy: str = "node") -> Path:
        """``interpreter`` with ``launcher_copy(copy)`` first on its path: what the nodes "have
        installed". Made once per cluster.

        Nodes see their own /tmp, so a checkout (or an editable install) under /tmp is invisible
        to them, as code on a login node is to a real cluster.
        """
        wrapper = self.dir / f"{copy}-python-{Path(interpreter).parent.parent.name}"
        if not wrapper.exists():
            root = self.launcher_copy(copy)
            wrapper.write_text(
                f'#!/bin/sh\nPYTHONPATH={root}${{PYTHONPATH:+:$PYTHONPATH}} exec {interpreter} "$@"\n'
            )
            wrapper.chmod(0o755)
        return wrapper

    def launcher_copy(self, copy: str = "node") -> Path:
        """A folder under the cluster's holding a copy of the launcher package, made once: its
        code stays as it was while other work edits the checkout."""
        root = self.dir / f"{copy}-site"
        if not root.exists():
            shutil.copytree(
                Path(__file__).resolve().parents[1] / "launcher",
                root / "launcher",
                ignore=shutil.ignore_patterns("__pycache__"),
            )
        return root

    def cluster_yaml(self, path: str | os.PathLike[str], **overrides: Any) -> Path:
        """Write :meth:`cluster_dict` (same arguments) as YAML to ``path``; returns the path."""
        out = Path(path)
        out.write_text(yaml.safe_dump(self.cluster_dict(**overrides), sort_keys=False))
        return out

    # -- running things inside nodes ----------------------------------------------------------

    def exec(
        self, node: str, cmd: str, *, timeout: float = 60.0, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """Run ``sh -c cmd`` on a node: in its network, mount and UTS namespaces (as sshd sees them)."""
        pid = self.sshd_pids(node)[-1]
        argv = ["nsenter", "-t", str(pid), "-n", "-m", "-u", "-p", "sh", "-c", cmd]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=check)

    def sshd_pids(self, node: str) -> list[int]:
        """The node's ``unshare`` and, once it has forked, its sshd (PID 1 inside the node)."""
        pid = self._sshd[node].pid
        children = Path(f"/proc/{pid}/task/{pid}/children")
        with contextlib.suppress(OSError):
            return [pid, *(int(c) for c in children.read_text().split())]
        return [pid]

    def pids(self, node: str) -> list[int]:
        """Every process running in a node's network namespace."""
        return _ns_pids(self.namespace(node))

    def left_running(self) -> dict[str, list[str]]:
        """Node → the command lines of its processes but sshd (nodes running only sshd left out)."""
        out = {}
        for node in self.node_names:
            cmds = []
            for pid in self.pids(node):
                with contextlib.suppress(OSError):
                    cmds.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" "))
            if left := [c.decode() for c in cmds if b"sshd" not in c]:
                out[node] = left
        return out

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> NetnsCluster:
        reason = missing_requirements()
        if reason:
            raise NetnsError(reason)
        _exit_cleanly_on_sigterm()
        _alive.add(self)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process in the namespaces, delete namespaces, veths, bridge and folder."""
        # Every node's processes are killed and waited for until they are gone from /proc, not
        # only from the namespace: a process killed leaves it before it has exited and been
        # reaped. Each node's sshd (PID 1 of its PID namespace) dies first, while its `unshare`
        # parent lives to reap it, and that `unshare` is this process's child, reaped here.
        seen = {p: _start_time(p) for ns in self._created_ns for p in _ns_pids(ns)}
        seen.update({proc.pid: _start_time(proc.pid) for proc in self._sshd.values()})
        own = {proc.pid for proc in self._sshd.values()}
        for ns in self._created_ns:
            _kill_ns(ns, spare=own)
        for proc in self._sshd.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        left = {ns: pids for ns in self._created_ns if (pids := _kill_ns(ns))}
        if alive := _wait_gone(seen, wait_s=20.0):
            left["(exiting)"] = alive
        for ns in self._created_ns:
            _run(["ip", "netns", "del", ns], check=False)
        for bridge in self._bridges:
            _run(["ip", "link", "del", bridge], check=False)
        shutil.rmtree(self.dir, ignore_errors=True)
        self._sshd.clear()
        self._created_ns.clear()
        self._bridges.clear()
        _alive.discard(self)
        if left:  # a namespace deleted by name lives on, nameless, while a process is in it
            raise RuntimeError(f"processes outlived SIGKILL in the simulated nodes: {left}")

    def _setup(self) -> None:
        reap_stale()
        self.dir.mkdir(mode=0o700, parents=True)
        keygen(self.ssh_key)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        with _machine_lock():
            self.subnet = _free_subnet(self.owner_pid)
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            self._bridges.append(self.bridge)
            _run(["ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])
            if self.login_node:
                # No address in the root namespace: only node 0 routes into this subnet.
                self.inner_subnet = _free_subnet(self.owner_pid + 7919, avoid={self.subnet})
                _run(["ip", "link", "add", self.inner_bridge, "type", "bridge"])
                self._bridges.append(self.inner_bridge)
                _run(["ip", "link", "set", self.inner_bridge, "up"])
        known = []
        for i, node in enumerate(self.node_names):
            self._add_node(i, node)
            pub = Path(f"{self.dir / node}_host_ed25519.pub").read_text().split()
            known.append(f"{self.host(node)} {pub[0]} {pub[1]}\n")
        self.known_hosts.write_text("".join(known))
        deadline = time.monotonic() + READY_TIMEOUT_S
        for node in self.node_names:
            self._wait_ready(node, deadline)

    def _add_node(self, i: int, node: str) -> None:
        ns = self.namespace(node)
        host_veth, node_veth = f"{self._veth_prefix}h{i}", f"{self._veth_prefix}n{i}"
        _run(["ip", "netns", "add", ns])
        self._created_ns.append(ns)
        links = []
        if not self.login_node or i == 0:
            links.append((self.bridge, "eth0", self.host(node), host_veth, node_veth))
        if self.login_node:
            name, addr = ("eth1" if i == 0 else "eth0"), str(self._inner_addr(10 + i))
            links.append((self.inner_bridge, name, addr, host_veth + "i", node_veth + "i"))
        for bridge, name, addr, outside, inside in links:
            _run(["ip", "link", "add", outside, "type", "veth", "peer", "name", inside])
            # deleting the namespace deletes the pair
            _run(["ip", "link", "set", inside, "netns", ns])
            _run(["ip", "link", "set", outside, "master", bridge, "up"])
            _run(["ip", "-n", ns, "link", "set", inside, "name", name])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", name])
            _run(["ip", "-n", ns, "link", "set", name, "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

        host_key = self.dir / f"{node}_host_ed25519"
        keygen(host_key)
        self.authorized_keys(node).write_text(Path(f"{self.ssh_key}.pub").read_text())
        config = self.dir / f"{node}.sshd_config"
        config.write_text(
            f"Port 22\nListenAddress {self.host(node)}\nHostKey {host_key}\n"
            f"AuthorizedKeysFile {self.authorized_keys(node)}\n{SSHD_OPTIONS}"
        )
        bashrc = Path.home() / ".bashrc"
        hide_rc = ""
        if self.bare_login and bashrc.is_file():
            (self.dir / "empty-bashrc").touch()
            hide_rc = f" && mount --bind {self.dir / 'empty-bashrc'} {bashrc}"
        script = (
            f"hostname {node} && mount -t tmpfs tmpfs /tmp && mount -t tmpfs tmpfs /dev/shm"
            f" && mkdir -p /root/.ray && mount -t tmpfs tmpfs /root/.ray{hide_rc}"
            f" && exec {SSHD} -f {config} -D -e"
        )
        # --pid: a node sees its own processes only (Ray's checks look at every raylet)
        unshare = ["unshare", "--mount", "--uts", "--pid", "--fork", "--mount-proc"]
        argv = ["ip", "netns", "exec", ns, *unshare, "--propagation", "private", "sh", "-c", script]
        with open(self.dir / f"{node}.sshd.log", "wb") as log:
            self._sshd[node] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _wait_ready(self, node: str, deadline: float) -> None:
        """Wait until the node's sshd sends its banner."""
        proc = self._sshd[node]
        while True:
            if proc.poll() is not None:
                log = (self.dir / f"{node}.sshd.log").read_text(errors="replace")
                raise NetnsError(f"sshd on {node} exited with {proc.returncode}: {log[-2000:]}")
            if self._banner(node):
                return
            if time.monotonic() > deadline:
                raise NetnsError(
                    f"sshd on {node} did not accept connections within {READY_TIMEOUT_S} s"
                )
            time.sleep(0.05)

    def _banner(self, node: str) -> bool:
        """Whether the node's sshd sends its banner (asked from node 0 behind a login node)."""
        if not self.login_node or self._index(node) == 0:
            return ssh_answers(self.host(node))
        probe = (
            f"from netns import ssh_answers; raise SystemExit(not ssh_answers({self.host(node)!r}))"
        )
        argv = ["ip", "netns", "exec", self.namespace("node0"), sys.executable, "-c", probe]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent)}
        return subprocess.run(argv, capture_output=True, timeout=30, env=env).returncode == 0

    def _inner_addr(self, last: int) -> ipaddress.IPv4Address:
        assert self.inner_subnet is not None, "not a login_node cluster, or not started"
        return self.inner_subnet.network_address + last

    def _index(self, node: str | int) -> int:
        return node if isinstance(node, int) else self.node_names.index(node)

    def _addr(self, last: int) -> ipaddress.IPv4Address:
        assert self.subnet is not None, "the cluster is not started"
        return self.subnet.network_address + last


# -- machine-wide helpers -------------------------------------------------------------------------


def ssh_answers(host: str, timeout: float = 1.0) -> bool:
    """Whether an sshd answers at ``host`` from here (its banner comes back)."""
    try:
        with socket.create_connection((host, 22), timeout=timeout) as sock:
            return sock.recv(4).startswith(b"SSH-")
    except OSError:
        return False


def reap_stale() -> None:
    """Remove clusters whose owning process is gone (a test session killed by SIGKILL)."""
    for ns in _netns_names():
        if ns.startswith(NS_PREFIX) and _gone(ns[len(NS_PREFIX) :].split("-")[0]):
            _kill_ns(ns)
            _run(["ip", "netns", "del", ns], check=False)
    for link in json.loads(_run(["ip", "-j", "link", "show", "type", "bridge"]).stdout or "[]"):
        name = link.get("ifname", "")
        if name.startswith(("lnb", "lni")) and "x" in name and _gone(name[3:].split("x")[0], 16):
            _run(["ip", "link", "del", name], check=False)
    for path in STATE_ROOT.glob(f"{DIR_PREFIX}*"):
        if _gone(path.name[len(DIR_PREFIX) :].split("-")[0]):
            shutil.rmtree(path, ignore_errors=True)


def _gone(owner: str, base: int = 10) -> bool:
    """Whether ``owner`` is a pid (in ``base``) of no process."""
    try:
        return not os.path.exists(f"/proc/{int(owner, base)}")
    except ValueError:
        return False


def _free_subnet(
    seed: int, avoid: set[ipaddress.IPv4Network | None] | None = None
) -> ipaddress.IPv4Network:
    """A /24 of 198.18.0.0/15 that no interface on the machine uses and not in ``avoid``
    (call under the lock)."""
    used: set[ipaddress.IPv4Network | None] = set(avoid or ())
    for link in json.loads(_run(["ip", "-j", "addr", "show"]).stdout or "[]"):
        for addr in link.get("addr_info", []):
            if addr.get("family") == "inet":
                used.add(ipaddress.ip_network(f"{addr['local']}/24", strict=False))
    space = list(ipaddress.ip_network("198.18.0.0/15").subnets(new_prefix=24))
    start = seed % len(space)
    for k in range(len(space)):
        net = space[(start + k) % len(space)]
        if net not in used:
            return net
    raise NetnsError("no free /24 left in 198.18.0.0/15")


@contextlib.contextmanager
def _machine_lock():
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    with open(LOCK_FILE, "a") as fh:  # closing it releases the lock
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def keygen(path: Path, kind: str = "ed25519", passphrase: str = "") -> Path:
    """A new ``kind`` key pair at ``path`` (and ``path``.pub)."""
    _run(["ssh-keygen", "-q", "-t", kind, "-N", passphrase, "-C", path.name, "-f", str(path)])
    return path


def _netns_names() -> list[str]:
    out = _run(["ip", "-j", "netns", "list"], check=False).stdout.strip()
    return [entry["name"] for entry in json.loads(out or "[]")]


def _ns_pids(ns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_ns(ns: str, wait_s: float = 20.0, spare: Collection[int] = ()) -> list[int]:
    """SIGKILL every process in a namespace but ``spare`` until none is left (forks included);
    the pids still there after ``wait_s`` (many large processes exiting on a loaded machine take
    seconds)."""
    deadline = time.monotonic() + wait_s
    while pids := [p for p in _ns_pids(ns) if p not in spare]:
        if time.monotonic() > deadline:
            return pids
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    return []


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command: [state, ppid, ...]; [] for no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat): a pid used again differs."""
    fields = _stat(pid)
    return fields[19] if fields else None


def _exists(pid: int, start: str | None) -> bool:
    """The process is there: running, exiting, or a zombie that another process must reap (this
    process's own zombies are reaped by their ``Popen``)."""
    fields = _stat(pid)
    if not fields or start is None or fields[19] != start:
        return False
    return not (fields[0] == "Z" and int(fields[1]) == os.getpid())


def _wait_gone(pids: dict[int, str | None], wait_s: float) -> list[int]:
    """Wait until each process (pid → start time) has exited and been reaped; those that have
    not after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = [p for p, start in pids.items() if _exists(p, start)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _exit_cleanly_on_sigterm() -> None:
    """Turn a plain SIGTERM (``timeout``, CI cancelling) into SystemExit so teardown runs."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, raise_system_exit)


def raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@atexit.register
def _close_all() -> None:
    for cluster in list(_alive):
        if cluster.owner_pid == os.getpid():
            cluster.close()
