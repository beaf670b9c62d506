"""``launch logs RUN_DIR|ID --rank R | --node N``: one rank's or one node's output from a run
directory's ``logs/<node>/rank<R>.log`` files, each line of a node's ranks marked with its rank."""

from __future__ import annotations

from pathlib import Path

from launcher.errors import UsageError


def rank_logs(run_dir: Path, *, rank: int | None = None, node: str | None = None) -> str:
    """Rank ``rank``'s log as written; or every rank of ``node`` (or of the run), each line
    prefixed ``[node/rankR]``."""
    root = Path(run_dir) / "logs"
    files = sorted(root.glob("*/rank*.log"), key=lambda p: (p.parent.name, _rank(p)))
    if not files:
        raise UsageError(
            f"{run_dir} has no rank logs (logs/<node>/rank<R>.log); give a run directory"
        )
    if rank is not None:
        found = [p for p in files if _rank(p) == rank]
        if not found:
            raise UsageError(
                f"rank {rank} has no log in {run_dir}; its ranks are "
                f"{', '.join(str(_rank(p)) for p in files)}"
            )
        return found[0].read_text(errors="replace")
    if node is not None:
        nodes = sorted({p.parent.name for p in files})
        if node not in nodes:
            raise UsageError(
                f"node {node!r} has no logs in {run_dir}; its nodes are {', '.join(nodes)}"
            )
        files = [p for p in files if p.parent.name == node]
    out = []
    for path in files:
        tag = f"[{path.parent.name}/rank{_rank(path)}] "
        out += [tag + line for line in path.read_text(errors="replace").splitlines()]
    return "\n".join(out) + ("\n" if out else "")


def _rank(path: Path) -> int:
    digits = path.stem.removeprefix("rank")
    return int(digits) if digits.isdigit() else -1
