"""Copying a job's run directory from its head: a copy here, or a tar stream over SSH."""

from __future__ import annotations

import base64
import io
import logging
import shlex
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

from launcher.errors import PreflightError
from launcher.jobs.claim import MARKER
from launcher.remote import NodeError, runner_for
from launcher.spec.cluster import NodeSpec, SSHSpec

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 600.0


def copy_dir(node: NodeSpec, ssh: SSHSpec, source: str, dest: Path) -> None:
    """Copy the folder ``source`` on ``node`` into ``dest`` (a copy here, a base64 tar stream
    over SSH); a symlink out of the folder is skipped with a warning."""
    if node.is_local:
        if not Path(source).is_dir():
            raise PreflightError(f"the run directory {source} does not exist on this machine")
        # Without a submission's marker (a job not started yet): the copy is no marked folder.
        shutil.copytree(source, dest, dirs_exist_ok=True, ignore=_left_out(Path(source)))
        return
    with runner_for(node, ssh) as runner:
        try:
            result = runner.run(
                f"cd {shlex.quote(source)} && tar -cf - . | base64", timeout=FETCH_TIMEOUT_S
            )
        except NodeError as err:
            raise PreflightError(f"cannot fetch {source} from {node.name}: {err}") from err
    if not result.ok:
        raise PreflightError(
            f"cannot read {source} on {node.name} ({node.host}): "
            f"{result.stderr_tail() or 'tar failed'}"
        )
    dest.mkdir(parents=True, exist_ok=True)
    extract(base64.b64decode(result.stdout), dest, f"{node.name}:{source}")


def extract(data: bytes, dest: Path, source: str) -> None:
    """Unpack a tar of a run directory into ``dest``; what tar's ``data`` filter refuses (a
    link out of the folder, an absolute path, a device) is skipped with a warning."""

    def keep(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
        try:
            return tarfile.data_filter(member, path)
        except tarfile.FilterError as err:
            log.warning("skipped %s of %s: %s", member.name, source, err)
            return None

    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        tar.extractall(dest, filter=keep)


def _left_out(root: Path) -> Callable[[str, list[str]], set[str]]:
    """``copytree``'s ignore: the submission's marker, and symlinks that lead out of ``root``
    (skipped with a warning: copying would follow them)."""
    top = root.resolve()

    def ignore(folder: str, names: list[str]) -> set[str]:
        out = {MARKER} & set(names)
        for name in names:
            path = Path(folder) / name
            if path.is_symlink() and not path.resolve().is_relative_to(top):
                log.warning("skipped %s: a symlink out of %s", path, root)
                out.add(name)
        return out

    return ignore
