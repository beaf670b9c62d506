"""A remote node over SSH (fabric/paramiko): key auth only, host keys verified."""

from __future__ import annotations

import contextlib
import logging
import select
import shlex
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fabric
import paramiko

from launcher.remote.base import (
    AUTH_FAILED,
    INTERNAL,
    SSH_ERROR,
    TIMEOUT,
    UNREACHABLE,
    CommandResult,
    NodeError,
    Runner,
    short,
)
from launcher.remote.classify import ENCRYPTED, classify_ssh_error
from launcher.remote.hostkeys import HostKeyPolicy, load_known_hosts, refuse_revoked
from launcher.remote.quoting import ENV_NAME, remote_command
from launcher.remote.route import route_to
from launcher.spec.cluster import NodeSpec, SSHSpec

log = logging.getLogger(__name__)

EXIT_DRAIN_S = 5.0  # output read after a remote command exited without its channel's EOF


class SSHRunner(Runner):
    """A remote node over SSH: one connection, opened on first use, for one thread."""

    def __init__(self, node: NodeSpec, ssh: SSHSpec):
        self.ssh = ssh
        self.route = route_to(node, ssh)
        self._jumps: list[paramiko.SSHClient] = []  # the jump hosts' connections, in order
        self._conn: fabric.Connection | None = None
        self._connecting: fabric.Connection | None = None  # closed by close() from another thread
        self._lock = threading.Lock()  # one connect at a time
        self._state = threading.Lock()  # guards _conn, _connecting, _closed; never held long
        self._revoked: set[tuple[str, bytes]] = set()  # @revoked keys of known_hosts
        super().__init__(node)

    def load_key(self) -> paramiko.PKey | None:
        """``ssh.key`` read, or None without one; NodeError naming the file and what is wrong
        with it (paramiko's own reading says "Invalid key" for every problem alike)."""
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
            raise NodeError(AUTH_FAILED, ENCRYPTED.format(key=shown)) from None
        # e.g. DSA: paramiko 4.0 removed DSSKey (3.x loads it)
        except paramiko.pkey.UnknownKeyType as err:
            kind = getattr(err.key_type, "__name__", None) or str(err.key_type)
            kind = short(kind.removesuffix("PrivateKey"), 40)
            raise NodeError(
                AUTH_FAILED,
                f"key file {shown} holds a {kind} key, a type the launcher's SSH "
                f"(paramiko) cannot use: it takes ed25519, RSA and ECDSA keys only. "
                f"Make one (ssh-keygen -t ed25519), add its public key to the "
                f"nodes' authorized_keys and set ssh.key to it",
            ) from None
        # paramiko's SSHException, cryptography's UnsupportedAlgorithm, ...: never a traceback
        except Exception as err:  # noqa: BLE001
            raise NodeError(
                AUTH_FAILED,
                f"key file {shown} is not a private key that can be used ({type(err).__name__}: "
                f"{short(str(err), 120)}); use an ed25519, RSA or ECDSA key and set ssh.key to it",
            ) from None

    def connect_kwargs(
        self, pkey: paramiko.PKey | None = None, key_files: tuple[Path, ...] = ()
    ) -> dict[str, Any]:
        """Everything handed to paramiko's ``SSHClient.connect``, each option explained;
        ``pkey`` is ``load_key()``, ``key_files`` the SSH config's IdentityFile for the hop."""
        timeout = self.ssh.connect_timeout_s
        return {
            # ssh.key alone; else the SSH config's IdentityFile and the agent; else as ssh does.
            **({"pkey": pkey} if pkey is not None else {}),
            **(
                {"key_filename": [str(p) for p in key_files if p.is_file()]}
                if pkey is None and key_files
                else {}
            ),
            "look_for_keys": pkey is None and not key_files,
            "allow_agent": pkey is None,
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

    def _client(self, files: tuple[Path, ...]) -> paramiko.SSHClient:
        """A client that knows a hop's known_hosts ``files`` and refuses (or records into the
        first, on opt-in) new keys."""
        client = paramiko.SSHClient()
        revoked: set[tuple[str, bytes]] = set()
        for path in files:
            known, bad = load_known_hosts(path)
            revoked |= bad
            for entry in known:
                for name in entry.hostnames:
                    client.get_host_keys().add(name, entry.key.get_name(), entry.key)
        record_to = files[0] if self.ssh.accept_unknown_host_keys else None
        client.set_missing_host_key_policy(HostKeyPolicy(revoked, record_to))
        self._revoked = revoked
        return client

    def _hop_sock(self) -> Any:
        """What the node's connection runs over: a channel through the last jump host (each
        jump connected through the one before it, its host key checked against its own
        known_hosts), a ProxyCommand's pipe, or None (a direct TCP connection)."""
        route, sock = self.route, None
        if route.proxy_command:
            try:
                return paramiko.ProxyCommand(route.proxy_command)
            except paramiko.SSHException as err:
                raise NodeError(
                    SSH_ERROR, f"ProxyCommand for {self.node.host} failed to start: {err}"
                ) from err
        pkey = self.load_key()
        targets = [*route.jumps, route.node]
        for hop, after in zip(route.jumps, targets[1:], strict=True):
            client = self._client(hop.known_hosts)
            with self._state:
                if self._closed:
                    client.close()
                    raise self.closed_error()
                self._jumps.append(client)
            try:
                client.connect(
                    hop.host,
                    hop.port,
                    hop.user,
                    sock=sock,
                    timeout=self.ssh.connect_timeout_s,
                    **self.connect_kwargs(None if hop.key_files else pkey, hop.key_files),
                )
                transport = client.get_transport()
                assert transport is not None
                refuse_revoked(transport.get_remote_server_key(), self._revoked)
                sock = transport.open_channel(
                    "direct-tcpip",
                    (after.host, after.port),
                    ("127.0.0.1", 0),
                    timeout=self.ssh.connect_timeout_s,
                )
            except (paramiko.SSHException, OSError, EOFError) as err:
                self._close_jumps()
                if self._closed:
                    raise self.closed_error("was closed while connecting") from err
                if isinstance(err, paramiko.ChannelException):
                    raise NodeError(
                        UNREACHABLE,
                        f"jump host {hop.name} ({hop.describe()}) cannot connect to "
                        f"{after.host}:{after.port}: {err.text or err}; check the node's "
                        f"HostName and Port, and that sshd allows TCP forwarding there",
                    ) from err
                found = classify_ssh_error(err, self, hop)
                raise NodeError(found.kind, f"jump host {hop.name}: {found.message}") from err
        return sock

    def _connection(self) -> fabric.Connection:
        with self._lock:
            if self._closed:
                raise self.closed_error()
            if self._conn is not None and self._conn.is_connected:
                return self._conn
            hop = self.route.node
            started = time.monotonic()
            self._close_jumps()
            sock = self._hop_sock()
            key_files = () if self.ssh.key else hop.key_files
            conn = fabric.Connection(
                hop.host,
                user=hop.user,
                port=hop.port,
                # The route (launcher.remote.route) has read the SSH config already.
                config=fabric.Config(overrides={"load_ssh_configs": False}),
                connect_timeout=self.ssh.connect_timeout_s,
                connect_kwargs={
                    **self.connect_kwargs(self.load_key(), key_files),
                    **({"sock": sock} if sock is not None else {}),
                },
            )
            conn.client = self._client(hop.known_hosts)
            with self._state:
                self._connecting = conn
            try:
                conn.open()
                refuse_revoked(conn.transport.get_remote_server_key(), self._revoked)
            except (paramiko.SSHException, OSError, EOFError) as err:
                # fabric's close() does nothing here (it sets conn.transport only once open()
                # succeeds): the client holds the transport's thread and socket.
                conn.close()
                conn.client.close()
                self._close_jumps()
                if self._closed:
                    raise self.closed_error("was closed while connecting") from err
                raise classify_ssh_error(err, self) from err
            finally:
                with self._state:
                    self._connecting = None
            with self._state:
                if not self._closed:
                    self._conn = conn
            if self._conn is not conn:  # closed while connecting
                conn.close()
                raise self.closed_error("was closed while connecting")
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
            bad = [k for k in env if not ENV_NAME.fullmatch(k)]
            if bad:
                raise ValueError(f"not environment variable names: {bad}")
            exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
            script = f"export {exports} && {command}"
        # sshd runs what it is sent with the user's login shell (``$SHELL -c``), which may be
        # csh, tcsh or fish; the command is POSIX sh, so it goes to sh as one quoted word.
        try:
            return self._exec(
                conn.transport, remote_command(script, timeout), stdin or "", timeout, shown=command
            )
        except (paramiko.SSHException, OSError, EOFError) as err:
            closed = self._closed
            self.close()
            if closed:
                raise NodeError(
                    INTERNAL, f"{short(command)!r} was stopped: the runner was closed"
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
                # The output ends at the channel's EOF, or EXIT_DRAIN_S after the exit status
                # (a daemon the command started may hold the output open).
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
                        TIMEOUT, f"{short(shown)!r} did not finish within {timeout:g} s"
                    )
                if not transport.is_active():
                    raise EOFError("the SSH transport closed")
                select.select([chan], [], [], 0.05)
            return CommandResult(
                out.decode(errors="replace"), err.decode(errors="replace"), chan.recv_exit_status()
            )
        finally:
            chan.close()

    @contextlib.contextmanager
    def forward(self, remote_host: str, remote_port: int) -> Iterator[int]:
        """A port on this machine's 127.0.0.1 forwarded over this connection (through the jump
        hosts) to ``remote_host:remote_port`` as the node sees it; yields the local port. A
        connection the node cannot make is closed at once: its client sees the end, not a wait."""
        transport = self._connection().client.get_transport()
        if transport is None or not transport.is_active():
            raise NodeError(SSH_ERROR, f"the SSH connection to {self.describe()} is closed")
        listener = socket.create_server(("127.0.0.1", 0))
        stop = threading.Event()
        server = threading.Thread(
            target=_serve_tunnel,
            args=(listener, transport, (remote_host, remote_port), stop),
            name=f"ssh-tunnel-{self.node.name}",
            daemon=True,
        )
        server.start()
        try:
            yield listener.getsockname()[1]
        finally:
            stop.set()
            server.join(timeout=5)

    def describe(self) -> str:
        via = f" via {', '.join(h.name for h in self.route.jumps)}" if self.route.jumps else ""
        return f"{self.node.name} ({self.route.node.describe()}{via})"

    def close(self) -> None:
        """Close the connection: a command or connect under way ends with NodeError. The command
        on the node runs on (sshd does not signal it) until its remote ``timeout``, if any."""
        with self._state:
            self._closed = True
            conn, self._conn = self._conn, None
            connecting = self._connecting
        if conn is not None:
            conn.close()
        if connecting is not None:
            with contextlib.suppress(Exception):
                connecting.client.close()
        self._close_jumps()

    def _close_jumps(self) -> None:
        with self._state:
            jumps, self._jumps = self._jumps, []
        for client in reversed(jumps):
            with contextlib.suppress(Exception):
                client.close()


def _serve_tunnel(
    listener: socket.socket,
    transport: paramiko.Transport,
    remote: tuple[str, int],
    stop: threading.Event,
) -> None:
    """Accept on ``listener`` until ``stop``; each connection gets a channel to ``remote`` and a
    thread copying both ways. One the node refuses is closed at once."""
    pumps: list[threading.Thread] = []
    listener.settimeout(0.1)
    try:
        while not stop.is_set():
            try:
                sock, origin = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            sock.setblocking(True)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                chan = transport.open_channel("direct-tcpip", remote, origin, timeout=10)
            except (paramiko.SSHException, OSError, EOFError) as err:
                log.debug("tunnel to %s:%d: %s", *remote, err)
                sock.close()
                continue
            pump = threading.Thread(target=_copy_both_ways, args=(sock, chan, stop), daemon=True)
            pump.start()
            pumps = [p for p in pumps if p.is_alive()] + [pump]
    finally:
        listener.close()
        for pump in pumps:
            pump.join(timeout=2)


def _copy_both_ways(sock: socket.socket, chan: paramiko.Channel, stop: threading.Event) -> None:
    """Copy between a local connection and its channel until either side ends or ``stop``."""
    try:
        while not stop.is_set():
            ready, _, _ = select.select([sock, chan], [], [], 0.1)
            for src, dst in ((sock, chan), (chan, sock)):
                if src in ready:
                    if not (data := src.recv(65536)):
                        return
                    dst.sendall(data)
    except (OSError, EOFError, paramiko.SSHException):
        pass
    finally:
        chan.close()
        sock.close()


def _feed(chan: paramiko.Channel, data: bytes) -> None:
    """Write stdin then EOF; a command that exits without reading it is not an error."""
    with contextlib.suppress(OSError, EOFError, paramiko.SSHException):
        if data:
            chan.sendall(data)
        chan.shutdown_write()
