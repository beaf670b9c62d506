"""What paramiko or fabric raised while connecting, as a short NodeError that says what to do."""

from __future__ import annotations

import errno
import os
import socket
from typing import TYPE_CHECKING

import paramiko

from launcher.remote.base import (
    AUTH_FAILED,
    HOST_KEY_MISMATCH,
    HOST_KEY_REVOKED,
    SSH_ERROR,
    UNKNOWN_HOST_KEY,
    UNREACHABLE,
    NodeError,
)
from launcher.remote.hostkeys import RevokedHostKeyError, UnknownHostKeyError, known_hosts_name

if TYPE_CHECKING:
    from launcher.remote.route import Hop
    from launcher.remote.ssh import SSHRunner

ENCRYPTED = "key {key} is encrypted; load it into ssh-agent and leave ssh.key unset"
NO_ROUTE = (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT)


def classify_ssh_error(err: BaseException, runner: SSHRunner, hop: Hop | None = None) -> NodeError:
    """Turn what paramiko/fabric raised while connecting to ``hop`` (default: the runner's
    node) into a short, actionable NodeError."""
    ssh = runner.ssh
    hop = hop or runner.route.node
    host, port = hop.host, hop.port
    where = hop.describe()
    timeout = ssh.connect_timeout_s
    known = hop.known_hosts[0]
    if isinstance(err, paramiko.BadHostKeyException):
        return NodeError(
            HOST_KEY_MISMATCH,
            f"{host} presented a {err.key.get_name()} key ({err.key.fingerprint}) that differs from "
            f"the one in {known}: possibly a man-in-the-middle attack, or the node was reinstalled. "
            f"It is never accepted automatically; if the change is expected, remove the old entry "
            f"(ssh-keygen -R {known_hosts_name(host, port)} -f {known}) and add the new key",
        )
    if isinstance(err, RevokedHostKeyError):
        return NodeError(
            HOST_KEY_REVOKED,
            f"{host} presented a {err.key.get_name()} key ({err.key.fingerprint}) that {known} marks "
            f"@revoked; it is never accepted. Find out why it was revoked before giving the node a new key",
        )
    if isinstance(err, UnknownHostKeyError):
        missing = "" if known.is_file() else f" ({known} does not exist)"
        return NodeError(
            UNKNOWN_HOST_KEY,
            f"{host}'s {err.key.get_name()} key ({err.key.fingerprint}) is not in {known}{missing} and "
            f"is refused. Verify it, then add it: ssh-keyscan -p {port} {host} >> {known}; "
            f"or opt in with ssh.accept_unknown_host_keys: true",
        )
    if isinstance(err, paramiko.PasswordRequiredException):
        return NodeError(AUTH_FAILED, ENCRYPTED.format(key=ssh.key))
    if isinstance(err, paramiko.AuthenticationException) or (
        isinstance(err, paramiko.SSHException) and "No authentication methods" in str(err)
    ):
        offered = f"key {ssh.key}" if ssh.key else "ssh-agent and ~/.ssh default keys"
        return NodeError(
            AUTH_FAILED,
            f"{where} did not accept {offered}; check ssh.key and the user (ssh.user / nodes[].user), "
            f"or add the public key to the node's authorized_keys",
        )
    if isinstance(err, socket.gaierror):
        return NodeError(
            UNREACHABLE, f"cannot resolve host name {host!r} ({err.strerror}); check nodes[].host"
        )
    if isinstance(err, TimeoutError):
        return NodeError(
            UNREACHABLE,
            f"no answer from {host}:{port} within {timeout:g} s (ssh.connect_timeout_s): "
            f"host down, wrong address or a firewall",
        )
    if isinstance(err, paramiko.ssh_exception.NoValidConnectionsError):
        codes = {e.errno for e in err.errors.values() if isinstance(e, OSError)}
        err = OSError(next(iter(codes)) if len(codes) == 1 else None, str(err))
    if isinstance(err, OSError) and err.errno == errno.ECONNREFUSED:
        return NodeError(
            UNREACHABLE,
            f"{host} refused the connection on port {port}: is sshd running, is the port right?",
        )
    if isinstance(err, OSError) and err.errno in NO_ROUTE:
        return NodeError(
            UNREACHABLE,
            f"no route to {host}:{port} ({os.strerror(err.errno)}): host down or wrong address",
        )
    if isinstance(err, OSError) and not isinstance(err, FileNotFoundError):
        return NodeError(UNREACHABLE, f"cannot connect to {host}:{port}: {err.strerror or err}")
    if isinstance(err, paramiko.SSHException) and "banner" in str(err).lower():
        return NodeError(
            UNREACHABLE, f"{host}:{port} did not speak SSH within {timeout:g} s: {err}"
        )
    return NodeError(SSH_ERROR, f"connecting to {where} failed: {type(err).__name__}: {err}")
