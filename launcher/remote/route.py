"""Which SSH hops reach a node: the cluster file, then the user's SSH config, then OpenSSH's
defaults (docs/clusters.md, "SSH as users configure it")."""

from __future__ import annotations

import getpass
from dataclasses import dataclass
from pathlib import Path

from launcher.remote.base import SSH_ERROR, NodeError
from launcher.spec import sshconfig
from launcher.spec.cluster import NodeSpec, SSHSpec

MAX_HOPS = 8


@dataclass(frozen=True)
class Hop:
    """One SSH connection of a route: where it goes, as whom, checked against which files."""

    name: str  # as the cluster file or ProxyJump names it
    host: str  # HostName: what is connected to and looked up in known_hosts
    port: int
    user: str
    key_files: tuple[Path, ...]  # the config's IdentityFile; empty: ssh.key, else agent/defaults
    known_hosts: tuple[Path, ...]

    def describe(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"


@dataclass(frozen=True)
class Route:
    """The jump hosts in connection order, then the node; or a ProxyCommand to reach it."""

    jumps: tuple[Hop, ...]
    node: Hop
    proxy_command: str | None

    @property
    def indirect(self) -> bool:
        """True when the node is reached through another host (ports must be tunnelled)."""
        return bool(self.jumps) or self.proxy_command is not None


def route_to(node: NodeSpec, ssh: SSHSpec) -> Route:
    """The route to ``node`` (a remote one) under ``ssh``; NodeError for a ProxyJump loop."""
    found = sshconfig.lookup(node.host, ssh.config)
    port = node.port if "port" in node.model_fields_set else found.port
    final = _hop(node.host, found, ssh, port, node.user or ssh.user or found.user)
    jumps = _jumps(found.proxy_jump, ssh, seen=(node.host,))
    return Route(jumps, final, None if jumps else found.proxy_command)


def _jumps(specs: tuple[str, ...], ssh: SSHSpec, seen: tuple[str, ...]) -> tuple[Hop, ...]:
    hops: list[Hop] = []
    for spec in specs:
        user, name, port = sshconfig.parse_jump(spec)
        if name in seen or len(seen) > MAX_HOPS:
            raise NodeError(
                SSH_ERROR,
                f"ProxyJump loops or is longer than {MAX_HOPS} hops ({' -> '.join((*seen, name))}); "
                f"fix ProxyJump in {ssh.config}",
            )
        found = sshconfig.lookup(name, ssh.config)
        hops += _jumps(found.proxy_jump, ssh, (*seen, name))
        hops.append(_hop(name, found, ssh, port or found.port, user or found.user or ssh.user))
    return tuple(hops)


def _hop(
    name: str, found: sshconfig.HostConfig, ssh: SSHSpec, port: int | None, user: str | None
) -> Hop:
    """A hop to ``name`` as the SSH config ``found`` it; OpenSSH's defaults where ``port`` or
    ``user`` are None; the cluster file's known_hosts where it sets one."""
    known = found.known_hosts
    if "known_hosts" in ssh.model_fields_set or not known:
        known = (ssh.known_hosts.expanduser(),)
    return Hop(
        name, found.hostname, port or 22, user or getpass.getuser(), found.identity_files, known
    )
