"""known_hosts as OpenSSH reads it, and the policies that refuse or record unknown host keys."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import paramiko

from launcher.remote.base import SSH_ERROR, NodeError

log = logging.getLogger(__name__)
NOT_A_KEY_LINE = (paramiko.hostkeys.InvalidHostKey, paramiko.SSHException, ValueError, IndexError)


class UnknownHostKeyError(paramiko.SSHException):
    """The node's host key is not in known_hosts (and accepting new keys is off)."""

    def __init__(self, hostname: str, key: paramiko.PKey):
        super().__init__(f"Server {hostname!r} not found in known_hosts")
        self.key = key


class RevokedHostKeyError(paramiko.SSHException):
    """The node's host key is marked ``@revoked`` in known_hosts."""

    def __init__(self, key: paramiko.PKey):
        super().__init__(f"the host key {key.get_fingerprint().hex()} is revoked")
        self.key = key


def load_known_hosts(
    path: Path,
) -> tuple[list[paramiko.hostkeys.HostKeyEntry], set[tuple[str, bytes]]]:
    """``path``'s host keys and its ``@revoked`` keys (as ``(type, blob)``), read as OpenSSH does
    (paramiko's loader raises on lines OpenSSH accepts): ``@cert-authority`` and unparsable
    lines skipped with a warning; an unreadable file is a NodeError."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], set()
    except OSError as err:
        raise NodeError(
            SSH_ERROR,
            f"cannot read the known_hosts file {path} (ssh.known_hosts): {err.strerror or err}",
        ) from err
    entries: list[paramiko.hostkeys.HostKeyEntry] = []
    revoked: set[tuple[str, bytes]] = set()
    for lineno, raw in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        marker = None
        if line.startswith("@"):
            marker, _, line = line.partition(" ")
            line = line.strip()
            if marker != "@revoked":  # @cert-authority too: host certificates are not supported
                level = logging.DEBUG if marker == "@cert-authority" else logging.WARNING
                log.log(level, "%s:%d: %s is not supported; line skipped", path, lineno, marker)
                continue
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(line, lineno)
        except NOT_A_KEY_LINE as err:
            log.warning("%s:%d: not a host key line (%s); skipped", path, lineno, err)
            continue
        if entry is None:  # a key type paramiko does not know, or too few fields
            continue
        if marker == "@revoked":
            revoked.add((entry.key.get_name(), entry.key.asbytes()))
        else:
            entries.append(entry)
    return entries, revoked


def refuse_revoked(key: paramiko.PKey | None, revoked: set[tuple[str, bytes]]) -> None:
    if key is not None and (key.get_name(), key.asbytes()) in revoked:
        raise RevokedHostKeyError(key)


class HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """A host key not in known_hosts: refused with an error that carries the key or, given
    ``record_to`` (``ssh.accept_unknown_host_keys``), accepted and appended there, one line under
    a lock, so a parallel fan-out loses no key. A ``@revoked`` key is refused either way."""

    _lock = threading.Lock()

    def __init__(self, revoked: set[tuple[str, bytes]], record_to: Path | None = None):
        self.revoked = revoked
        self.record_to = record_to

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        refuse_revoked(key, self.revoked)
        if self.record_to is None:
            raise UnknownHostKeyError(hostname, key)
        client.get_host_keys().add(hostname, key.get_name(), key)
        line = paramiko.hostkeys.HostKeyEntry([hostname], key).to_line()
        with self._lock:
            self.record_to.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.record_to, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "a") as fh:
                fh.write(line)
        found = f"{key.get_name()} {key.fingerprint}"
        log.warning("accepted new host key for %s (%s) into %s", hostname, found, self.record_to)


def known_hosts_name(host: str, port: int) -> str:
    """How known_hosts (and ``ssh-keygen -R``) name ``host`` on ``port``."""
    return host if port == 22 else f"'[{host}]:{port}'"
