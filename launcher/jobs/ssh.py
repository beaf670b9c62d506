"""What the job commands need of the SSH layer: the tunnel's connection and copying a folder.

The runners of ``launcher.remote`` (``LocalRunner`` / ``SSHRunner``: key auth only, verified
host keys, the cluster's SSH settings) are imported here and nowhere else in ``launcher.jobs``.
"""

from __future__ import annotations

import base64
import io
import shlex
import shutil
import tarfile
from pathlib import Path
from typing import Any

from launcher.errors import PreflightError
from launcher.jobs.claim import MARKER
from launcher.remote import NodeError, SSHRunner, runner_for
from launcher.spec.cluster import NodeSpec, SSHSpec

__all__ = ["NodeError", "SSHRunner", "copy_dir", "paramiko_connection"]

FETCH_TIMEOUT_S = 600.0


def paramiko_connection(runner: SSHRunner) -> Any:
    """The runner's open fabric connection (for port forwarding on the same login)."""
    return runner._connection()


def copy_dir(node: NodeSpec, ssh: SSHSpec, source: str, dest: Path) -> None:
    """Copy the folder ``source`` on ``node`` into ``dest`` (made; existing files replaced).

    On this machine a plain copy; over SSH, a tar stream of the folder, base64 on the
    runner's text stdout (run directories are logs, metrics and summaries: megabytes).
    """
    if node.is_local:
        if not Path(source).is_dir():
            raise PreflightError(f"the run directory {source} does not exist on this machine")
        # Without a submission's marker (a job not started yet): the copy is no marked folder.
        shutil.copytree(source, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MARKER))
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
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(result.stdout)), mode="r:") as tar:
        tar.extractall(dest, filter="data")
