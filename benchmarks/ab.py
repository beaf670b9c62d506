"""The same training command on another revision and on this tree, interleaved, in one run.

    python benchmarks/ab.py --base REV [--rounds 2] [--out ab.json] [--work DIR] -- COMMAND [ARGS ...]

e.g. ``python benchmarks/ab.py --base main~1 -- python -m launcher.train --job jobs/bert_ddp.yaml``
or ``... -- launch jobs/bert_ddp.yaml --set train.steps=120``.
How it measures: docs/performance.md, under its name.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
DONE = re.compile(r"done: .*?\| ([\d.]+)([kMG]?) tok/s/rank.*?\| mfu ([\d.]+|n/a)%?")
SCALE = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9}


def export(rev: str, into: Path) -> Path:
    """REV's tracked files under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev], check=True, capture_output=True
    ).stdout
    tar = into / "tree.tar"
    tar.write_bytes(archive)
    tree = into / "tree"
    with tarfile.open(tar) as t:  # the "data" filter (Python 3.10.12+, 3.11.4+) where there is one
        t.extractall(tree, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    tar.unlink()
    return tree


def tree_env(tree: Path) -> dict[str, str]:
    rest = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(tree) + (os.pathsep + rest if rest else "")}


def imported_from(tree: Path) -> str:
    """Where ``launcher`` comes from in this tree's environment."""
    out = subprocess.run(
        [sys.executable, "-c", "import launcher; print(launcher.__file__)"],
        cwd=tree,
        env=tree_env(tree),
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def parse_done(output: str) -> dict:
    found = DONE.findall(output)
    if not found:
        return {"tokens_per_s": None, "mfu": None}
    value, suffix, mfu = found[-1]
    return {
        "tokens_per_s": float(value) * SCALE[suffix],
        "mfu": None if mfu == "n/a" else float(mfu) / 100,
    }


def run_once(name: str, tree: Path, command: list[str], log: Path) -> dict:
    proc = subprocess.run(
        command,
        cwd=tree,
        env=tree_env(tree),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log.write_text(proc.stdout)
    return {
        "tree": name,
        "launcher": imported_from(tree),
        "returncode": proc.returncode,
        "log": str(log),
        **parse_done(proc.stdout),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base",
        required=True,
        help="the revision to compare against (e.g. main~1), or a folder that holds its tree",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", help="write the runs as JSON here")
    parser.add_argument(
        "--work", help="where the exported tree and the logs go (default: a new temporary folder)"
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="-- then the command to run in each tree"
    )
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="launcher-ab-"))
    work.mkdir(parents=True, exist_ok=True)
    base = Path(args.base).resolve() if Path(args.base).is_dir() else export(args.base, work)
    trees = {"base": base, "this tree": ROOT}
    runs = []
    for i in range(args.rounds):
        for name, tree in trees.items():
            run = run_once(name, tree, command, work / f"{i}-{name.replace(' ', '-')}.log")
            runs.append({"round": i + 1, **run})
            print(
                f"round {i + 1} {name}: {run['tokens_per_s']} tokens/s, exit {run['returncode']}",
                flush=True,
            )
    rows, ratios = [], []
    for i in range(1, args.rounds + 1):
        base, new = (next(r for r in runs if r["round"] == i and r["tree"] == t) for t in trees)
        ratio = (
            new["tokens_per_s"] / base["tokens_per_s"]
            if base["tokens_per_s"] and new["tokens_per_s"]
            else None
        )
        if ratio is not None:
            ratios.append(ratio)
        rows.append([i, base["tokens_per_s"], base["mfu"], new["tokens_per_s"], new["mfu"], ratio])
    headers = [
        "round",
        f"{args.base} tokens/s",
        "MFU",
        "this tree tokens/s",
        "MFU",
        "this tree / base",
    ]
    print(tabulate(rows, headers=headers, floatfmt=".4g"))
    median = statistics.median(ratios) if ratios else None
    print(f"median ratio: {median}; the exported tree and the logs: {work}")
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"base": args.base, "command": command, "runs": runs, "median_ratio": median},
                indent=1,
            )
        )
    return 0 if all(r["returncode"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
