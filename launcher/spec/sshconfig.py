"""An OpenSSH client config (``~/.ssh/config``) read for one host, as ``ssh -G`` would.

paramiko parses Host and Match blocks, first-value-wins and tokens; this adds ``Include``
and splits ``ProxyJump`` into hops. A file that cannot be read or parsed is a SpecError.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.errors import SpecError

if TYPE_CHECKING:  # imported where a config is read: a run on this machine never needs it
    import paramiko

MAX_INCLUDE_DEPTH = 16
_INCLUDE = re.compile(r"^\s*include\s*[= ]\s*(.+?)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class HostConfig:
    """What the config says about one host; None or empty where it says nothing."""

    hostname: str
    port: int | None
    user: str | None
    identity_files: tuple[Path, ...]
    known_hosts: tuple[Path, ...]
    proxy_jump: tuple[str, ...]
    proxy_command: str | None


def lookup(host: str, config: Path | None) -> HostConfig:
    """The settings ``config`` gives ``host`` (an alias or a name); none without a file."""
    if config is None:
        return HostConfig(host, None, None, (), (), (), None)
    parsed = _parse(config.expanduser())
    found = parsed.lookup(host)
    port = found.get("port")
    if port and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise SpecError(f"Port {port!r} for host {host!r} is not a port", source=str(config))
    jump = found.get("proxyjump", "").strip()
    command = found.get("proxycommand", "").strip()
    return HostConfig(
        hostname=found.get("hostname", host),
        port=int(port) if port else None,
        user=found.get("user"),
        identity_files=tuple(Path(p).expanduser() for p in found.get("identityfile", [])),
        known_hosts=tuple(
            Path(p).expanduser() for p in found.get("userknownhostsfile", "").split()
        ),
        proxy_jump=()
        if jump.lower() in ("", "none")
        else tuple(h.strip() for h in jump.split(",") if h.strip()),
        proxy_command=None if command.lower() in ("", "none") else command,
    )


def parse_jump(spec: str) -> tuple[str | None, str, int | None]:
    """``[user@]host[:port]`` (or ``ssh://[user@]host[:port]``) as (user, host, port)."""
    spec = spec.removeprefix("ssh://")
    user, _, rest = spec.rpartition("@")
    host, port = rest, None
    if rest.startswith("["):  # [v6addr]:port
        host, _, tail = rest[1:].partition("]")
        port = tail.removeprefix(":") or None
    elif rest.count(":") == 1:
        host, port = rest.split(":")
    if port is not None and not port.isdigit():
        raise SpecError(f"ProxyJump hop {spec!r}: the port must be a number")
    return user or None, host, int(port) if port else None


_cache: dict[tuple[Path, int, int], paramiko.SSHConfig] = {}


def _parse(path: Path) -> paramiko.SSHConfig:
    import paramiko

    if not path.exists():
        return paramiko.SSHConfig()
    try:
        stat = path.stat()
        key = (path, stat.st_mtime_ns, stat.st_size)
        if key not in _cache:
            _cache[key] = paramiko.SSHConfig.from_text(_with_includes(path, 0))
        return _cache[key]
    except OSError as err:
        raise SpecError(
            f"cannot read the SSH config ({err.strerror or err}); fix it or set ssh.config",
            source=str(path),
        ) from None
    except paramiko.ConfigParseError as err:
        raise SpecError(f"not an SSH config: {err}", source=str(path)) from None


def _with_includes(path: Path, depth: int) -> str:
    """The file's text with each ``Include`` replaced by the files it names (relative paths
    are under ~/.ssh, as for a user's config; globs in sorted order)."""
    if depth > MAX_INCLUDE_DEPTH:
        raise SpecError(f"Include nested deeper than {MAX_INCLUDE_DEPTH}", source=str(path))
    lines = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        match = _INCLUDE.match(line)
        if match is None:
            lines.append(line)
            continue
        for pattern in match.group(1).split():
            pattern = os.path.expanduser(pattern)
            if not os.path.isabs(pattern):
                pattern = str(Path("~/.ssh").expanduser() / pattern)
            for name in sorted(glob.glob(pattern)):
                lines.append(_with_includes(Path(name), depth + 1))
    return "\n".join(lines) + "\n"
