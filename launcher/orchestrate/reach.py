"""The rendezvous check: before any worker starts, each node opens a TCP connection to the
head's rendezvous port from its workers' interface (``GLOO_SOCKET_IFNAME``) while the head's
agent listens there, so that a firewall or a wrong route fails in seconds.
"""

from __future__ import annotations

import contextlib
import socket
import threading

from launcher.preflight.network import is_loopback
from launcher.preflight.probe import interfaces

REACH_TIMEOUT_S = 5.0  # per connection; the whole check stays well under 15 s


class Listener:
    """A TCP listener on ``port`` (all IPv4 addresses) that accepts and closes connections."""

    def __init__(self, port: int):
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind(("", port))
            self._sock.listen(128)
        except OSError:
            self._sock.close()
            raise
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            with conn:  # wait for the peer's close, so TIME_WAIT stays on its side
                conn.settimeout(REACH_TIMEOUT_S)
                with contextlib.suppress(OSError):
                    conn.recv(1)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=REACH_TIMEOUT_S)


def reach(master_addr: str, port: int, ifname: str | None, timeout_s: float) -> str | None:
    """None when a TCP connection to ``master_addr:port`` opens from each interface named in
    ``ifname`` (gloo's comma-separated list; None: wherever the kernel routes it), else what
    failed, in words."""
    names = [n.strip() for n in (ifname or "").split(",") if n.strip()]
    if not names:
        return _connect(master_addr, port, None, timeout_s)
    found = interfaces()
    for name in names:
        if name not in found:
            return (
                f"GLOO_SOCKET_IFNAME={ifname} names no interface here "
                f"(has {', '.join(sorted(found))})"
            )
        if not found[name]:
            return f"interface {name} (GLOO_SOCKET_IFNAME) has no IPv4 address here"
        if is_loopback(found[name][0]) and not is_loopback(master_addr):
            return (
                f"GLOO_SOCKET_IFNAME={ifname}: {name} ({found[name][0]}) is loopback, from "
                f"which the head at {master_addr} cannot be reached"
            )
        failed = _connect(master_addr, port, (name, found[name][0]), timeout_s)
        if failed:
            return failed
    return None


def _connect(
    master_addr: str, port: int, source: tuple[str, str] | None, timeout_s: float
) -> str | None:
    where = f" from {source[0]} ({source[1]})" if source else ""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            if source:
                sock.bind((source[1], 0))
            sock.connect((master_addr, port))
    except TimeoutError:
        return f"no answer from {master_addr}:{port}{where} within {timeout_s:g} s"
    except OSError as err:
        return f"cannot connect to {master_addr}:{port}{where}: {err.strerror or err}"
    return None
