"""Run commands on nodes: one interface for this machine and for SSH, plus a parallel fan-out.

The one remote-command layer: preflight probes nodes with it and the Ray bootstrap starts and
stops Ray with it.

``runner_for(node, ssh)`` gives a ``LocalRunner`` (subprocess, no SSH) for nodes that are this
machine and an ``SSHRunner`` (fabric, key auth only, verified host keys) for the others.
Both expose ``run(command, stdin=, timeout=, env=) -> CommandResult``: a command that runs and
exits non-zero is a result, not an exception; failing to reach the node, to authenticate or
to verify its host key, or a command outliving its timeout raises ``NodeError`` whose
``kind`` and one-line ``message`` say what happened and what to do.

``fan_out(nodes, fn, max_parallel)`` calls ``fn(node)`` on every node in threads and collects
each node's result *or* exception (like fabric's ``GroupResult``): it never stops at the
first failure. Interrupted (Ctrl-C in the calling thread), it returns at once: nodes not yet
started are skipped, the runners its threads made are closed and the interrupt is raised again
without waiting for the threads, which are daemons and so never hold up the interpreter's exit.
Closing a runner ends the wait for its command, which is not the same as stopping it: a local
command's process group is killed, but a remote command runs on after its SSH connection is
closed, until it ends by itself (a write to its closed output may end it), or its remote
``timeout`` stops it REMOTE_TIMEOUT_MARGIN_S after the timeout it was run with. A caller that
must not leave it running stops it on the node (the Ray bootstrap: ``ray_cluster._stop_ray``).
``parallel_map`` is the same for any list of items.

Secrets (Ray's auth token) go through ``stdin``, never the command line or ``env`` (which an
SSH runner inlines into the remote command line, visible in ``ps``).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import getpass
import logging
import math
import os
import re
import select
import shlex
import signal
import socket
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import fabric
import paramiko

from launcher.spec.cluster import NodeSpec, SSHSpec

log = logging.getLogger(__name__)

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENCRYPTED = "key {key} is encrypted; load it into ssh-agent and leave ssh.key unset"
REMOTE_TIMEOUT_MARGIN_S = 2  # a remote command outliving its timeout by this stops itself
EXIT_DRAIN_S = 5.0  # output read after a remote command exited without its channel's EOF

T = TypeVar("T")

# NodeError kinds. The table shows the kind; the message says what to do.
UNREACHABLE = "unreachable"
AUTH_FAILED = "authentication failed"
UNKNOWN_HOST_KEY = "unknown host key"
HOST_KEY_MISMATCH = "HOST KEY MISMATCH"
HOST_KEY_REVOKED = "HOST KEY REVOKED"
TIMEOUT = "timed out"
SSH_ERROR = "ssh error"
INTERPRETER_MISSING = "interpreter missing"
PROBE_CRASHED = "probe crashed"
BAD_JSON = "bad JSON"
INTERNAL = "internal error"


class NodeError(Exception):
    """A node could not do what was asked; ``kind`` is one of the constants above."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class CommandResult:
    stdout: str
    stderr: str
    exit_code: int

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def stderr_tail(self, lines: int = 3, chars: int = 400) -> str:
        """The last lines of stderr, for messages."""
        tail = " | ".join(line.strip() for line in self.stderr.strip().splitlines()[-lines:])
        return tail[-chars:]


class Runner(ABC):
    """Runs shell commands on one node."""

    def __init__(self, node: NodeSpec):
        self.node = node
        self._closed = False
        scope = getattr(_worker, "scope", None)
        if scope is not None:  # made in a fan-out's thread: closed if the fan-out is interrupted
            scope.add(self)

    @abstractmethod
    def run(
        self,
        command: str,
        *,
        stdin: str | None = None,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
    ) -> CommandResult:
        """Run ``command`` with ``sh`` (over SSH too, whatever the user's login shell);
        ``stdin`` is written then closed (EOF), None gives an empty stdin. Raises NodeError
        when the node cannot be reached or ``timeout`` passes."""

    @abstractmethod
    def describe(self) -> str:
        """``node1 (root@10.0.0.2:22)``: for messages."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection, if any, and give up on a command running now (from any
        thread): that ``run`` and every later one raise NodeError. Whether the command itself
        stops depends on the runner: LocalRunner kills it, SSHRunner does not (see its close)."""

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalRunner(Runner):
    """This machine: a subprocess in its own process group (killed whole on timeout or close)."""

    def __init__(self, node: NodeSpec):
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen[str]] = set()
        super().__init__(node)

    def run(
        self,
        command: str,
        *,
        stdin: str | None = None,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
    ) -> CommandResult:
        with self._lock:
            if self._closed:
                raise NodeError(INTERNAL, f"the runner for {self.describe()} is closed")
            proc = subprocess.Popen(
                ["/bin/sh", "-c", command],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={**os.environ, **(env or {})},
                encoding="utf-8",  # as SSHRunner decodes: bytes that are not UTF-8 become U+FFFD
                errors="replace",
                start_new_session=True,
            )
            self._procs.add(proc)
        try:
            out, err = proc.communicate(stdin or "", timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise NodeError(
                TIMEOUT, f"{_short(command)!r} did not finish within {timeout:g} s"
            ) from None
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            with self._lock:
                self._procs.discard(proc)
        if self._closed:
            raise NodeError(INTERNAL, f"{_short(command)!r} was stopped: the runner was closed")
        return CommandResult(out, err, proc.returncode)

    def describe(self) -> str:
        return f"{self.node.name} (this machine)"

    def close(self) -> None:
        with self._lock:
            self._closed = True
            running = list(self._procs)
        for proc in running:  # the thread in run() reaps it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)


class SSHRunner(Runner):
    """A remote node over SSH (fabric/paramiko): key auth only, host keys verified.

    One connection per runner, opened on first use and reused; a runner is meant for one
    thread (fan-out gives each node its own).
    """

    def __init__(self, node: NodeSpec, ssh: SSHSpec):
        self.ssh = ssh
        self.user = node.user or ssh.user or _local_user()
        self.known_hosts = ssh.known_hosts.expanduser()
        self._conn: fabric.Connection | None = None
        self._connecting: fabric.Connection | None = None  # closed by close() from another thread
        self._lock = threading.Lock()  # one connect at a time
        self._state = threading.Lock()  # guards _conn, _connecting, _closed; never held long
        self._revoked: set[tuple[str, bytes]] = set()  # @revoked keys of known_hosts
        super().__init__(node)

    def load_key(self) -> paramiko.PKey | None:
        """``ssh.key`` read, or None without one; NodeError (authentication failed) naming the
        file when it is missing, unreadable, encrypted, not a private key, or a key of a type
        paramiko does not support (DSA, since paramiko 4.0) or that otherwise cannot be loaded.

        Read here, not by paramiko from ``key_filename``: paramiko tries the file as every key
        type in turn and re-raises the last type's parse error ("Invalid key"), which hides a
        key the node refused and an unreadable file alike."""
        if not self.ssh.key:
            return None
        path, shown = self.ssh.key.expanduser(), self.ssh.key
        try:
            return paramiko.PKey.from_path(str(path))
        except FileNotFoundError:
            raise NodeError(
                AUTH_FAILED, f"key file {shown} not found; fix ssh.key in the cluster file"
            ) from None
        except OSError as err:
            raise NodeError(
                AUTH_FAILED,
                f"cannot read key file {shown}: {err.strerror or err}; "
                f"fix its permissions or ssh.key in the cluster file",
            ) from None
        except (TypeError, paramiko.PasswordRequiredException):  # cryptography: no password given
            raise NodeError(AUTH_FAILED, _ENCRYPTED.format(key=shown)) from None
        except (
            paramiko.pkey.UnknownKeyType
        ) as err:  # e.g. DSA: paramiko 4.0 removed DSSKey (3.x loads it)
            kind = getattr(err.key_type, "__name__", None) or str(err.key_type)
            kind = _short(kind.removesuffix("PrivateKey"), 40)
            raise NodeError(
                AUTH_FAILED,
                f"key file {shown} holds a {kind} key, a type the launcher's SSH "
                f"(paramiko) cannot use: it takes ed25519, RSA and ECDSA keys only. "
                f"Make one (ssh-keygen -t ed25519), add its public key to the "
                f"nodes' authorized_keys and set ssh.key to it",
            ) from None
        except (paramiko.SSHException, ValueError) as err:
            raise NodeError(
                AUTH_FAILED,
                f"key file {shown} is not a private key that can be read "
                f"({type(err).__name__}: {_short(str(err), 120)}); fix ssh.key",
            ) from None
        except Exception as err:  # noqa: BLE001 - cryptography's UnsupportedAlgorithm, ...: never a traceback
            raise NodeError(
                AUTH_FAILED,
                f"key file {shown} cannot be used ({type(err).__name__}: "
                f"{_short(str(err), 120)}); use an ed25519, RSA or ECDSA key "
                f"and set ssh.key to it",
            ) from None

    def connect_kwargs(self, pkey: paramiko.PKey | None = None) -> dict[str, Any]:
        """Everything handed to paramiko's ``SSHClient.connect``, each option explained;
        ``pkey`` is ``load_key()``."""
        key = self.ssh.key
        timeout = self.ssh.connect_timeout_s
        return {
            # The configured key only, so a wrong key fails plainly instead of silently
            # succeeding with some other identity; without one: ssh-agent, then ~/.ssh/id_*.
            **({"pkey": pkey} if pkey is not None else {}),
            "look_for_keys": key is None,
            "allow_agent": key is None,
            # Key auth only: no password is ever sent and nothing prompts for one.
            "password": None,
            "passphrase": None,
            # Every phase of connecting is bounded by connect_timeout_s: the TCP connect
            # (fabric's connect_timeout), the server's banner, and authentication.
            "banner_timeout": timeout,
            "auth_timeout": timeout,
            "channel_timeout": timeout,
            "compress": False,
        }

    def _client(self) -> paramiko.SSHClient:
        """A client that knows ``ssh.known_hosts`` and refuses (or records, on opt-in) new keys.

        The file is read as OpenSSH writes it (``load_known_hosts``); one that cannot be read
        is a NodeError naming it."""
        client = paramiko.SSHClient()
        known, revoked = load_known_hosts(self.known_hosts)
        for entry in known:
            for name in entry.hostnames:
                client.get_host_keys().add(name, entry.key.get_name(), entry.key)
        if self.ssh.accept_unknown_host_keys:
            client.set_missing_host_key_policy(_RecordUnknownHostKey(self.known_hosts, revoked))
        else:
            client.set_missing_host_key_policy(_RefuseUnknownHostKey(revoked))
        self._revoked = revoked
        return client

    def _connection(self) -> fabric.Connection:
        with self._lock:
            if self._closed:
                raise NodeError(INTERNAL, f"the runner for {self.describe()} is closed")
            if self._conn is not None and self._conn.is_connected:
                return self._conn
            config = fabric.Config(
                overrides={
                    # cluster.yaml is the one source of hosts, users, ports and keys.
                    "load_ssh_configs": False,
                }
            )
            conn = fabric.Connection(
                self.node.host,
                user=self.user,
                port=self.node.port,
                config=config,
                connect_timeout=self.ssh.connect_timeout_s,
                connect_kwargs=self.connect_kwargs(self.load_key()),
            )
            conn.client = self._client()
            with self._state:
                self._connecting = conn
            started = time.monotonic()
            try:
                conn.open()
                _refuse_revoked(conn.transport.get_remote_server_key(), self._revoked)
            except (paramiko.SSHException, OSError, EOFError) as err:
                # fabric's close() does nothing here (it sets conn.transport only once open()
                # succeeds): the client holds the transport's thread and socket.
                conn.close()
                conn.client.close()
                if self._closed:
                    raise NodeError(
                        INTERNAL, f"the runner for {self.describe()} was closed while connecting"
                    ) from err
                raise classify_ssh_error(err, self) from err
            finally:
                with self._state:
                    self._connecting = None
            with self._state:
                if not self._closed:
                    self._conn = conn
            if self._conn is not conn:  # closed while connecting
                conn.close()
                raise NodeError(
                    INTERNAL, f"the runner for {self.describe()} was closed while connecting"
                )
            log.debug("connected to %s in %.2f s", self.describe(), time.monotonic() - started)
            return conn

    def run(
        self,
        command: str,
        *,
        stdin: str | None = None,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
    ) -> CommandResult:
        # One paramiko session channel on fabric's connection. Not ``Connection.run``: invoke
        # feeds a non-terminal stdin one character per 10 ms, and a probe is 20 kB.
        conn = self._connection()
        script = command
        if env:
            bad = [k for k in env if not _ENV_NAME.fullmatch(k)]
            if bad:
                raise ValueError(f"not environment variable names: {bad}")
            exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
            script = f"export {exports} && {command}"
        # sshd runs what it is sent with the user's login shell (``$SHELL -c``), which may be
        # csh, tcsh or fish; the command is POSIX sh, so it goes to sh as one quoted word.
        try:
            return self._exec(
                conn.transport,
                _remote_command(script, timeout),
                stdin or "",
                timeout,
                shown=command,
            )
        except (paramiko.SSHException, OSError, EOFError) as err:
            closed = self._closed
            self.close()
            if closed:
                raise NodeError(
                    INTERNAL, f"{_short(command)!r} was stopped: the runner was closed"
                ) from err
            raise NodeError(SSH_ERROR, f"the connection to {self.describe()} broke: {err}") from err

    def _exec(
        self,
        transport: paramiko.Transport,
        command: str,
        stdin: str,
        timeout: float | None,
        *,
        shown: str,
    ) -> CommandResult:
        chan = transport.open_session(timeout=self.ssh.connect_timeout_s)
        try:
            chan.exec_command(command)
            feeder = threading.Thread(
                target=_feed, args=(chan, stdin.encode()), daemon=True, name="ssh-stdin"
            )
            feeder.start()
            out, err = bytearray(), bytearray()
            deadline = None if timeout is None else time.monotonic() + timeout
            exited_at = None
            while True:
                # sshd may report the exit status before the last of the output; the end of the
                # output is the channel's EOF (read before draining: no data can follow it). A
                # daemon the command started may keep the output open: then the exit status
                # and EXIT_DRAIN_S without EOF end the read.
                eof = chan.eof_received
                while chan.recv_ready():
                    out += chan.recv(65536)
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                if chan.exit_status_ready():
                    exited_at = exited_at or time.monotonic()
                    if eof or time.monotonic() - exited_at > EXIT_DRAIN_S:
                        break
                if deadline is not None and time.monotonic() > deadline:
                    raise NodeError(
                        TIMEOUT, f"{_short(shown)!r} did not finish within {timeout:g} s"
                    )
                if not transport.is_active():
                    raise EOFError("the SSH transport closed")
                select.select([chan], [], [], 0.05)
            return CommandResult(
                out.decode(errors="replace"), err.decode(errors="replace"), chan.recv_exit_status()
            )
        finally:
            chan.close()

    def describe(self) -> str:
        return f"{self.node.name} ({self.user}@{self.node.host}:{self.node.port})"

    def close(self) -> None:
        """Close the connection; a command running on it (in another thread) ends with
        NodeError, and a connect under way is closed and ends with NodeError too.

        The command on the node is not stopped: sshd does not signal a command without a
        terminal when its channel closes. It runs on until it ends by itself (a write to its
        closed output may end it) or, run with a timeout, until its remote ``timeout`` stops it
        (``_remote_command``)."""
        with self._state:
            self._closed = True
            conn, self._conn = self._conn, None
            connecting = self._connecting
        if conn is not None:
            conn.close()
        if connecting is not None:
            with contextlib.suppress(Exception):
                connecting.client.close()


def runner_for(node: NodeSpec, ssh_spec: SSHSpec) -> Runner:
    """A LocalRunner for this machine (``NodeSpec.is_local``), else an SSHRunner."""
    return LocalRunner(node) if node.is_local else SSHRunner(node, ssh_spec)


class GroupResult(dict[str, Any], Generic[T]):
    """Node name → ``fn``'s result or the exception it raised, in node order."""

    @property
    def succeeded(self) -> dict[str, T]:
        return {k: v for k, v in self.items() if not isinstance(v, BaseException)}

    @property
    def failed(self) -> dict[str, BaseException]:
        return {k: v for k, v in self.items() if isinstance(v, BaseException)}


def fan_out(
    nodes: Sequence[NodeSpec], fn: Callable[[NodeSpec], T], max_parallel: int = 32
) -> GroupResult[T]:
    """``fn(node)`` for every node, at most ``max_parallel`` at once; every result or exception
    kept. Interrupted, it stops the nodes' work and re-raises at once (see ``parallel_map``)."""
    outcomes = parallel_map(fn, nodes, max_parallel)
    return GroupResult((node.name, outcome) for node, outcome in zip(nodes, outcomes, strict=True))


class _Scope:
    """The runners made in one ``parallel_map``'s threads, to close when it is interrupted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runners: list[Runner] = []
        self.cancelled = False

    def add(self, runner: Runner) -> None:
        with self._lock:
            self._runners.append(runner)
            cancelled = self.cancelled
        if cancelled:
            runner.close()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            runners = list(self._runners)
        for runner in runners:
            with contextlib.suppress(Exception):
                runner.close()


_worker = threading.local()  # .scope: the _Scope of the parallel_map running in this thread


def parallel_map(
    fn: Callable[[Any], T], items: Sequence[Any], max_parallel: int = 32, *, grace_s: float = 0.0
) -> list[T | BaseException]:
    """``fn(item)`` for every item in daemon threads, at most ``max_parallel`` at once: each
    result or the exception it raised, in item order.

    When the calling thread is interrupted (KeyboardInterrupt, SystemExit, any exception while
    waiting), items not yet started are skipped, every runner made in these threads is closed
    (a local command is killed; a remote one is only given up on and keeps running on its
    node: see ``Runner.close``), the threads get at most ``grace_s`` to finish (to record what
    they did), and the exception is raised again. The threads are daemons: one still busy
    holds up neither this call nor the interpreter's exit.
    """
    items = list(items)
    outcomes: list[Any] = [None] * len(items)
    if not items:
        return outcomes
    scope = _Scope()
    lock = threading.Lock()
    queue = iter(range(len(items)))

    def work() -> None:
        _worker.scope = scope
        while True:
            with lock:
                index = None if scope.cancelled else next(queue, None)
            if index is None:
                return
            try:
                outcomes[index] = fn(items[index])
            except BaseException as err:  # noqa: BLE001 - every item's outcome is kept
                outcomes[index] = err

    threads = [
        threading.Thread(target=work, name=f"fan-out-{i}", daemon=True)
        for i in range(max(1, min(max_parallel, len(items))))
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    except BaseException:
        scope.cancel()
        deadline = time.monotonic() + grace_s
        for thread in threads:
            if thread.ident is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        raise
    return outcomes


# -- error classification ------------------------------------------------------------------------


class UnknownHostKeyError(paramiko.SSHException):
    """The node's host key is not in known_hosts (and accepting new keys is off)."""

    def __init__(self, hostname: str, key: paramiko.PKey):
        super().__init__(f"Server {hostname!r} not found in known_hosts")
        self.hostname = hostname
        self.key = key


class RevokedHostKeyError(paramiko.SSHException):
    """The node's host key is marked ``@revoked`` in known_hosts."""

    def __init__(self, key: paramiko.PKey):
        super().__init__(f"the host key {key.get_fingerprint().hex()} is revoked")
        self.key = key


def load_known_hosts(
    path: Path,
) -> tuple[list[paramiko.hostkeys.HostKeyEntry], set[tuple[str, bytes]]]:
    """``path``'s host keys and its ``@revoked`` keys (as ``(type, blob)``), read as OpenSSH does.

    paramiko's own loader raises on lines OpenSSH writes or tolerates. Here a
    ``@cert-authority`` line is skipped (host certificates are not supported: list the
    node's own key), ``@revoked`` keys are refused wherever they turn up, and a line that
    cannot be parsed is skipped with a warning naming it. A missing file holds no keys; one
    that cannot be read is a NodeError naming it.
    """
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
            if marker not in ("@revoked", "@cert-authority"):
                log.warning("%s:%d: unknown marker %s; line skipped", path, lineno, marker)
                continue
            if marker == "@cert-authority":
                log.debug(
                    "%s:%d: @cert-authority skipped (host certificates are not supported)",
                    path,
                    lineno,
                )
                continue
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(line, lineno)
        except (
            paramiko.hostkeys.InvalidHostKey,
            paramiko.SSHException,
            ValueError,
            IndexError,
        ) as err:
            log.warning("%s:%d: not a host key line (%s); skipped", path, lineno, err)
            continue
        if entry is None:  # a key type paramiko does not know, or too few fields
            continue
        if marker == "@revoked":
            revoked.add((entry.key.get_name(), entry.key.asbytes()))
        else:
            entries.append(entry)
    return entries, revoked


def _refuse_revoked(key: paramiko.PKey | None, revoked: set[tuple[str, bytes]]) -> None:
    if key is not None and (key.get_name(), key.asbytes()) in revoked:
        raise RevokedHostKeyError(key)


class _RefuseUnknownHostKey(paramiko.RejectPolicy):
    """paramiko's RejectPolicy, raising an error that carries the key for a useful message."""

    def __init__(self, revoked: set[tuple[str, bytes]] | None = None):
        self.revoked = revoked or set()

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        _refuse_revoked(key, self.revoked)
        raise UnknownHostKeyError(hostname, key)


class _RecordUnknownHostKey(paramiko.MissingHostKeyPolicy):
    """Accept a new host key and append it to known_hosts (``ssh.accept_unknown_host_keys``).

    Unlike paramiko's AutoAddPolicy + save, which rewrites the whole file from one client's
    view, this appends one line under a lock, so a parallel fan-out loses no key.
    """

    _lock = threading.Lock()

    def __init__(self, path: Path, revoked: set[tuple[str, bytes]] | None = None):
        self.path = path
        self.revoked = revoked or set()

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        _refuse_revoked(key, self.revoked)  # never accepted, not even on opt-in
        client.get_host_keys().add(hostname, key.get_name(), key)
        line = paramiko.hostkeys.HostKeyEntry([hostname], key).to_line()
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "a") as fh:
                fh.write(line)
        log.warning(
            "accepted new host key for %s (%s %s) into %s",
            hostname,
            key.get_name(),
            key.fingerprint,
            self.path,
        )


def classify_ssh_error(err: BaseException, runner: SSHRunner) -> NodeError:
    """Turn what paramiko/fabric raised while connecting into a short, actionable NodeError."""
    node, ssh = runner.node, runner.ssh
    where = f"{runner.user}@{node.host}:{node.port}"
    timeout = ssh.connect_timeout_s
    known = runner.known_hosts
    if isinstance(err, paramiko.BadHostKeyException):
        return NodeError(
            HOST_KEY_MISMATCH,
            f"{node.host} presented a {err.key.get_name()} key ({err.key.fingerprint}) that differs from "
            f"the one in {known}: possibly a man-in-the-middle attack, or the node was reinstalled. "
            f"It is never accepted automatically; if the change is expected, remove the old entry "
            f"(ssh-keygen -R {_known_hosts_name(node)} -f {known}) and add the new key",
        )
    if isinstance(err, RevokedHostKeyError):
        return NodeError(
            HOST_KEY_REVOKED,
            f"{node.host} presented a {err.key.get_name()} key ({err.key.fingerprint}) that {known} marks "
            f"@revoked; it is never accepted. Find out why it was revoked before giving the node a new key",
        )
    if isinstance(err, UnknownHostKeyError):
        missing = "" if known.is_file() else f" ({known} does not exist)"
        return NodeError(
            UNKNOWN_HOST_KEY,
            f"{node.host}'s {err.key.get_name()} key ({err.key.fingerprint}) is not in {known}{missing} and "
            f"is refused. Verify it, then add it: ssh-keyscan -p {node.port} {node.host} >> {known}; "
            f"or opt in with ssh.accept_unknown_host_keys: true",
        )
    if isinstance(err, paramiko.PasswordRequiredException):
        return NodeError(AUTH_FAILED, _ENCRYPTED.format(key=ssh.key))
    if isinstance(err, paramiko.AuthenticationException) or (
        isinstance(err, paramiko.SSHException) and "No authentication methods" in str(err)
    ):
        offered = f"key {ssh.key}" if ssh.key else "ssh-agent and ~/.ssh default keys"
        return NodeError(
            AUTH_FAILED,
            f"{where} did not accept {offered}; check ssh.key and the user (ssh.user / nodes[].user), "
            f"or add the public key to the node's authorized_keys",
        )
    if isinstance(err, FileNotFoundError) and ssh.key and str(ssh.key.expanduser()) in str(err):
        return NodeError(
            AUTH_FAILED, f"key file {ssh.key} not found; fix ssh.key in the cluster file"
        )
    if isinstance(err, socket.gaierror):
        return NodeError(
            UNREACHABLE,
            f"cannot resolve host name {node.host!r} ({err.strerror}); check nodes[].host",
        )
    if isinstance(err, TimeoutError):
        return NodeError(
            UNREACHABLE,
            f"no answer from {node.host}:{node.port} within {timeout:g} s (ssh.connect_timeout_s): "
            f"host down, wrong address or a firewall",
        )
    if isinstance(err, paramiko.ssh_exception.NoValidConnectionsError):
        codes = {e.errno for e in err.errors.values() if isinstance(e, OSError)}
        err = OSError(next(iter(codes)) if len(codes) == 1 else None, str(err))
    if isinstance(err, OSError) and err.errno == errno.ECONNREFUSED:
        return NodeError(
            UNREACHABLE,
            f"{node.host} refused the connection on port {node.port}: is sshd running, is the port right?",
        )
    if isinstance(err, OSError) and err.errno in (
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ETIMEDOUT,
    ):
        return NodeError(
            UNREACHABLE,
            f"no route to {node.host}:{node.port} ({os.strerror(err.errno)}): host down or wrong address",
        )
    if isinstance(err, OSError) and not isinstance(err, FileNotFoundError):
        return NodeError(
            UNREACHABLE, f"cannot connect to {node.host}:{node.port}: {err.strerror or err}"
        )
    if isinstance(err, paramiko.SSHException) and "banner" in str(err).lower():
        return NodeError(
            UNREACHABLE, f"{node.host}:{node.port} did not speak SSH within {timeout:g} s: {err}"
        )
    return NodeError(SSH_ERROR, f"connecting to {where} failed: {type(err).__name__}: {err}")


# -- helpers -----------------------------------------------------------------------------------


def _feed(chan: paramiko.Channel, data: bytes) -> None:
    """Write stdin then EOF; a command that exits without reading it is not an error."""
    with contextlib.suppress(OSError, EOFError, paramiko.SSHException):
        if data:
            chan.sendall(data)
        chan.shutdown_write()


def _remote_command(script: str, timeout: float | None) -> str:
    """What an SSH runner sends: ``script`` for sh. With a ``timeout``, under coreutils'
    ``timeout`` where the node has one that takes ``-k`` (else as it is): closing the channel
    when the launcher gives up does not stop a remote command, so it stops itself
    REMOTE_TIMEOUT_MARGIN_S later (SIGTERM to its process group, SIGKILL 5 s after)."""
    if timeout is None:
        return _for_login_shell(script)
    limit = math.ceil(timeout) + REMOTE_TIMEOUT_MARGIN_S
    wrapper = (
        f"if timeout -k 1 5 true >/dev/null 2>&1; then exec timeout -k 5 {limit} sh -c {shlex.quote(script)}; "
        f"else exec sh -c {shlex.quote(script)}; fi"
    )
    return _for_login_shell(wrapper)


# What a login shell other than sh does not keep as it is inside a single-quoted word: csh and
# tcsh end the command at a newline ("Unmatched '") and expand history at "!" ("Event not
# found"), also under -c; fish unescapes \\ and \'.
_LOGIN_SHELL_UNSAFE = re.compile(r"[\n\r!\\]")


# A node without `base64` (or whose `base64 -d` fails) must not run nothing and exit 0.
BASE64_FAILED = "launcher: base64 -d failed on this node"


def _for_login_shell(script: str) -> str:
    """``sh -c`` running ``script``, as one line that any login shell (sh, bash, csh, tcsh,
    fish) passes to sh unchanged: quoted as it is where that is safe, else base64-encoded and
    decoded by sh itself (stdin is left to the script). Where the node cannot decode it (no
    ``base64``), sh prints BASE64_FAILED on stderr and exits 127 instead of running nothing."""
    if not script.rstrip("\n"):  # newlines only: nothing to run (and sh's $(...) drops them)
        script = ""
    if _LOGIN_SHELL_UNSAFE.search(script) is None:
        return f"sh -c {shlex.quote(script)}"
    encoded = base64.b64encode(script.encode()).decode()
    # Inside the single quotes: no ', newline, ! or backslash, so csh, tcsh and fish keep it as it is.
    return (
        f'sh -c \'s=$(echo {encoded} | base64 -d) && [ -n "$s" ] || '
        f'{{ echo "{BASE64_FAILED}" >&2; exit 127; }}; eval "$s"\''
    )


def _known_hosts_name(node: NodeSpec) -> str:
    return node.host if node.port == 22 else f"'[{node.host}]:{node.port}'"


def _local_user() -> str:
    return getpass.getuser()


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=5)


def _short(command: str, limit: int = 60) -> str:
    return command if len(command) <= limit else command[: limit - 1] + "…"
