"""The user's code on every node: where a script entrypoint runs and how its folder gets there
(in place, a shared path, or a snapshot that Ray ships).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from launcher.errors import SpecError
from launcher.preflight.probe import CODE_SUFFIXES, files_hash, walk_tree
from launcher.spec import JobSpec, NodeSpec

SYNC_LIMIT_BYTES = 100 * 2**20  # what Ray ships through its object store to every node
STAGE_PREFIX = "launcher-code-"


@dataclass(frozen=True)
class CodePlan:
    """The user's workdir as the launch sees it (``plan.json``'s ``code``)."""

    workdir: str
    script: str  # as torchrun gets it: relative to the copy when the workdir travels, else absolute
    mode: str  # local | ray | shared
    files: int
    size_bytes: int
    code_hash: str  # sha256 of the code files (CODE_SUFFIXES) after excludes
    exclude: tuple[str, ...]

    @property
    def travels(self) -> bool:
        return self.mode == "ray"

    def cwd(self) -> str | None:
        """The workers' current directory on a node; None: the copy Ray unpacked there."""
        return None if self.travels else self.workdir

    def how(self) -> str:
        return {
            "local": "used in place (every node is this machine)",
            "ray": "copied to every node by Ray (runtime_env working_dir); the script runs in that copy",
            "shared": "the same path on every node (sync: false); the preflight hashes it on each",
        }[self.mode]

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "exclude": list(self.exclude)}


def plan_code(job: JobSpec, nodes: list[NodeSpec]) -> CodePlan | None:
    """How a script job's workdir reaches ``nodes``; None for the built-in trainer. SpecError
    for a script outside a travelling workdir or a workdir over ``SYNC_LIMIT_BYTES``."""
    entry = job.script_entry
    if entry is None:
        return None
    # The loader resolves workdir (default: the job file's folder); a spec built in code without
    # one runs in its script's folder.
    workdir = Path(entry.workdir) if entry.workdir is not None else Path(entry.script).parent
    mode = _mode(entry.sync, nodes)
    script = Path(entry.script)
    inside = script.is_relative_to(workdir)
    if mode == "ray" and not inside:
        raise SpecError(
            f"entrypoint.script {script} lies outside entrypoint.workdir {workdir}, which travels to "
            f"the nodes; move the script into the workdir, set workdir to a folder that holds it, or "
            f"use sync: false on a shared filesystem",
            source="job",
            field="entrypoint.script",
        )
    files = walk_tree(workdir, list(entry.exclude))
    size = sum(n for _, n in files)
    if mode == "ray" and size > SYNC_LIMIT_BYTES:
        raise SpecError(
            f"entrypoint.workdir {workdir} holds {_mib(size)} after excludes, over the "
            f"{_mib(SYNC_LIMIT_BYTES)} that can travel to the nodes; largest: "
            f"{', '.join(f'{name} ({_mib(n)})' for name, n in _largest(files))}. Add them to "
            f"entrypoint.exclude (data and checkpoints belong on storage the nodes share), or use "
            f"sync: false on a shared filesystem",
            source="job",
            field="entrypoint.workdir",
        )
    code = [rel for rel, _ in files if rel.endswith(CODE_SUFFIXES)]
    return CodePlan(
        workdir=str(workdir),
        script=str(script.relative_to(workdir)) if mode == "ray" else str(script),
        mode=mode,
        files=len(files),
        size_bytes=size,
        code_hash=files_hash(workdir, code),
        exclude=tuple(entry.exclude),
    )


def _mode(sync: object, nodes: list[NodeSpec]) -> str:
    if sync is False:
        return "shared"
    if sync is True or not all(n.is_local for n in nodes):
        return "ray"
    return "local"


def stage(code: CodePlan) -> Path:
    """A snapshot of the workdir (less excludes) in a new temporary folder, for Ray to ship.

    The caller removes it once Ray has uploaded it (``ray.init`` does so before it returns).
    """
    root = Path(tempfile.mkdtemp(prefix=STAGE_PREFIX))
    source = Path(code.workdir)
    try:
        for rel, _ in walk_tree(source, list(code.exclude)):
            target = root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / rel, target)
        os.chmod(root, 0o755)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root


def describe(code: CodePlan) -> str:
    """One line for ``launch plan``."""
    return (
        f"User code: {code.workdir} ({code.files} files, {_mib(code.size_bytes)} after excludes, "
        f"code hash {code.code_hash[:12]}): {code.how()}"
    )


def _largest(files: list[tuple[str, int]], n: int = 3) -> list[tuple[str, int]]:
    """The top-level entries of the walked tree that weigh most."""
    totals: dict[str, int] = {}
    for rel, size in files:
        head, sep, _ = rel.partition("/")
        key = head + "/" if sep else head
        totals[key] = totals.get(key, 0) + size
    return sorted(totals.items(), key=lambda kv: -kv[1])[:n]


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
