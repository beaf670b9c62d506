"""The launcher's private state folder, its locks, and the records of clusters kept up for
detached jobs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from launcher.errors import PreflightError, UnsafePath
from launcher.spec import ClusterSpec
from launcher.util import first_line, private_dir, write_private

STATE_ENV = "LAUNCHER_STATE_DIR"


class UnreadableRecord(PreflightError):
    """A state file of the launcher that cannot be read (exit 3): ``launch down --yes`` forgets it."""

    def __init__(self, path: Path, err: BaseException):
        super().__init__(
            f"the launcher's record {path} cannot be read ({first_line(err)}); `launch down --yes` "
            f"stops what it recorded and forgets it"
        )


def state_dir() -> Path:
    """The launcher's private state folder (created 0700). UnsafePath (exit 2) where it exists
    and another user owns it or may write it."""
    default = Path(os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"))
    path, reason = private_dir(Path(os.environ.get(STATE_ENV) or default / "launcher"))
    if reason:
        raise UnsafePath(
            "the launcher's state folder",
            path,
            reason,
            f"Remove it (or `chmod 700` it, as its owner), or point ${STATE_ENV} at a folder of yours",
        )
    return path


# -- bootstrapped clusters kept up for their jobs -------------------------------------------------


def cluster_record(cluster: ClusterSpec) -> Path:
    head = cluster.nodes[0]
    folder = state_dir() / "clusters"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder / f"{head.host}-{cluster.ray.port}.json"


def cluster_lock(cluster: ClusterSpec) -> contextlib.AbstractContextManager[None]:
    """One process at a time reads, bootstraps and saves (or stops and forgets) this cluster's
    record (``clusters/<head host>-<gcs port>.lock``)."""
    return locked(cluster_record(cluster).with_suffix(".lock"))


def jobs_lock(cluster: ClusterSpec) -> contextlib.AbstractContextManager[None]:
    """The jobs lock of the launcher's Ray for ``cluster`` (none for an attached Ray): held by a
    submission until Ray has the job and by ``launch down`` until Ray is stopped. Apart from the
    head's lock, which is taken inside it: ``status`` does not wait for an upload."""
    if cluster.ray.address is not None:
        return contextlib.nullcontext()
    if cluster.all_local:
        return locked(local_folder() / ".jobs.lock")
    return locked(cluster_record(cluster).with_suffix(".jobs.lock"))


# in a cluster's record, beside its spec: node name -> address
ADDRESSES_KEY = "ray_start_addresses"


def saved_cluster(cluster: ClusterSpec) -> ClusterSpec | None:
    """The spec a bootstrapped cluster with this head was started with, if the launcher keeps one."""
    record = _read_record(cluster)
    if record is None:
        return None
    record.pop(ADDRESSES_KEY, None)
    try:
        return ClusterSpec.model_validate(record)
    except ValueError as err:  # a record of another version
        raise UnreadableRecord(cluster_record(cluster), err) from err


def saved_addresses(cluster: ClusterSpec) -> dict[str, str]:
    """The address each node's ``ray start`` was given (``--node-ip-address``; the head's is the
    ``--address`` the others joined), by node name, as the record of this cluster keeps them.
    Empty without a record or for an unreadable one."""
    try:
        record = _read_record(cluster)
    except (UnreadableRecord, OSError):  # OSError: no state folder to look in
        return {}
    return dict((record or {}).get(ADDRESSES_KEY) or {})


def save_cluster(cluster: ClusterSpec, addresses: Mapping[str, str] | None = None) -> None:
    """Record a bootstrapped cluster: its spec, and ``addresses`` (``saved_addresses``) if given."""
    record = cluster.model_dump(mode="json")
    if addresses:
        record[ADDRESSES_KEY] = dict(addresses)
    write_private(cluster_record(cluster), json.dumps(record, indent=2) + "\n")


def forget_cluster(cluster: ClusterSpec) -> None:
    cluster_record(cluster).unlink(missing_ok=True)


def _read_record(cluster: ClusterSpec) -> dict[str, Any] | None:
    """The cluster's record as written; None without one; UnreadableRecord for one that is not
    a JSON object."""
    path = cluster_record(cluster)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:  # ValueError: bad JSON
        raise UnreadableRecord(path, err) from err
    if not isinstance(record, dict):
        raise UnreadableRecord(path, ValueError("not a JSON object"))
    return record


def local_folder() -> Path:
    folder = state_dir() / "local"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """One process (or thread) at a time holds ``path`` (flock): starts or stops a head, two
    submits at once share one."""
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
