"""Small helpers that several stages need, each written once. Standard library only: the
trainer (torch + stdlib) and the node agent import it too."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import math
import os
import re
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path


def first_line(err: BaseException) -> str:
    """The first non-empty line of an error's message, for one-paragraph messages and logs;
    its type's name for an exception without a message (``TimeoutError()``)."""
    for line in str(err).splitlines():
        if line.strip():
            return line.strip()
    return type(err).__name__


def write_private(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path``, readable by its owner only (0600), whole or not at all: for
    files that hold environment values, which may be secrets, and for the launcher's state (a
    wider existing file is replaced, not reused)."""
    _replace(Path(path), text, private=True)


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all, with the umask's mode. For files that are
    read back (``summary.json``, ``scaling.json``)."""
    _replace(Path(path), text, private=False)


def _replace(path: Path, text: str, *, private: bool) -> None:
    """Into a new file beside ``path``, then renamed over it: a kill or a full disk mid-write
    leaves the previous file, never a truncated one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            if private:
                os.fchmod(fh.fileno(), 0o600)  # O_CREAT's mode applies only to a new file
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


MASK = "****"
# A name holding one of these is secret. Wide on purpose: a masked value that was not secret
# costs a look at the spec; a shown one that was costs a rotated credential.
SECRET_MARKERS = ("TOKEN", "SECRET", "PASS", "CREDENTIAL", "AUTH", "PRIVATE", "KEY")
_URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)[^/\s]*(@)")


def is_secret(name: str) -> bool:
    """Whether a variable's name looks secret: it holds one of ``SECRET_MARKERS``, or ``PWD`` as
    one of its _-separated words (DB_PWD; not the shell's PWD or OLDPWD)."""
    upper = name.upper()
    return any(m in upper for m in SECRET_MARKERS) or (upper != "PWD" and "PWD" in upper.split("_"))


def mask_urls(text: str) -> str:
    """The password of every URL in ``text`` replaced: ``scheme://user:****@host``."""
    return _URL_PASSWORD.sub(rf"\g<1>{MASK}\g<2>", text)


def mask_env(env: Mapping[str, str]) -> dict[str, str]:
    """An environment fit to show or write: secret-looking names' values replaced by ****, and
    the password of any URL in the other values."""
    return {k: (MASK if is_secret(k) else mask_urls(v)) for k, v in env.items()}


def utc_stamp() -> str:
    """Now in UTC as run and study directories are named: ``20261201-084500``."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (q in 0..100), linearly interpolated between order statistics;
    None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def free_port() -> int:
    """A TCP port free on every interface of this machine now (another process may take it
    before it is used, a race torchrun's own ``--master-port`` choice accepts too)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def accepts(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``host:port`` accepts a TCP connection now (waiting at most 1 s)."""
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def setup_logging(debug: bool) -> None:
    """The launcher's log output on stderr: messages only, or levels, names and debug records
    with ``--debug``; the chatty libraries at warnings unless debugging."""
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s" if debug else "%(message)s",
    )
    if not debug:
        for noisy in ("ray", "paramiko", "fabric", "invoke", "torch"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def divert_logger(name: str, path: Path) -> Callable[[], None]:
    """Logger ``name``'s records (INFO and up) into the file ``path`` instead of the console,
    unless debugging; returns what puts the logger back as it was."""
    logger = logging.getLogger(name)
    if logging.getLogger().isEnabledFor(logging.DEBUG):
        return lambda: None
    saved = (logger.handlers[:], logger.level, logger.propagate)
    handler = logging.FileHandler(path, encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)

    def restore() -> None:
        handler.close()
        logger.handlers, logger.propagate = saved[0], saved[2]
        logger.setLevel(saved[1])

    return restore


def make_private_dir(prefix: str, parent: str | None = None) -> Path:
    """A new folder only this user can enter (0700, ``mkdtemp``: a name no one can guess or
    take first), in ``parent`` (default: the temp folder)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


def private_dir(path: str | os.PathLike[str]) -> tuple[Path, str | None]:
    """``path`` made (0700, with its parents) where missing; with the reason it is not private
    where it was there already and is not (``unsafe_reason``), else None."""
    folder = Path(path)
    try:
        folder.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        return folder, unsafe_reason(folder)
    return folder, None


def unsafe_reason(path: str | os.PathLike[str]) -> str | None:
    """Why another user could change ``path`` (never followed if a symbolic link): it is a link,
    another user owns it, or others may write it. None when only this user can (or it is gone)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if st.st_uid != os.getuid():
        return f"it belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return f"other users may write it (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def unsafe_path(root: str | os.PathLike[str]) -> tuple[Path, str] | None:
    """The first path at or under ``root`` that another user could change (``unsafe_reason``),
    with the reason; None where there is none (or ``root`` is missing)."""
    for folder, dirs, files in os.walk(root):
        for path in (folder, *(os.path.join(folder, name) for name in (*dirs, *files))):
            if reason := unsafe_reason(path):
                return Path(path), reason
    return None


def process_started() -> float | None:
    """This process's start as Unix time (from ``/proc``: to 10 ms), or None off Linux."""
    try:
        stat = Path("/proc/self/stat").read_text(encoding="ascii")
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime
        uptime = float(Path("/proc/uptime").read_text(encoding="ascii").split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
