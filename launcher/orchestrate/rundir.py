"""A run's directory: every path in it, and every write of a file that holds environment values.

One run per folder: ``--run-dir`` must be new or empty (``claim``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any

import yaml

from launcher import metrics, telemetry
from launcher.errors import UsageError
from launcher.orchestrate.plan import STACKS_SUBDIR, LaunchPlan
from launcher.util import mask_env, utc_stamp, write_private

log = logging.getLogger(__name__)

DEFAULT_BASE = Path("runs")
# A Slurm batch job's files in its run directory (launcher.jobs.batch), and the variable its
# script sets so that the launch inside takes the folder with them in it.
BATCH_SCRIPT = "launch.sbatch"
BATCH_OUTPUT = "launch.out"
BATCH_ENV = "LAUNCHER_BATCH_JOB"


class RunDir:
    def __init__(self, root: Path | str):
        self.root = Path(root)
        # Unique to this launch (every attempt of it): names the nodes' /tmp/launcher/<run_id>.
        self.run_id = f"{self.name or 'run'}-{secrets.token_hex(3)}"

    @classmethod
    def new(cls, job_name: str, base: Path = DEFAULT_BASE) -> RunDir:
        """``runs/<job>-<UTC yyyymmdd-HHMMSS>`` (``-2``, ``-3``, ... where taken), made atomically;
        UsageError (exit 2) where ``base`` cannot be written."""
        stem = f"{job_name}-{utc_stamp()}"
        path, n = base / stem, 1
        while True:
            try:
                path.mkdir(parents=True)
                return cls(path)
            except FileExistsError:
                n += 1
                path = base / f"{stem}-{n}"
            except OSError as err:
                raise UsageError(
                    f"cannot make a run directory in {base}: {err.strerror or err}; run from "
                    f"a folder you can write, or pass --run-dir"
                ) from err

    @classmethod
    def claim(cls, path: Path | str) -> RunDir:
        """``--run-dir PATH``: a new or empty folder, this launch's alone (its ``logs/`` made
        exclusively); one that holds anything, or cannot be made, is UsageError (exit 2) before
        anything starts. Folders made here are removed again (where still empty) on a failure."""
        path = Path(path)
        cls.refuse_used(path, batch=bool(os.environ.get(BATCH_ENV)))
        made = [p for p in (path, *path.parents) if not p.exists()]
        try:
            path.mkdir(parents=True, exist_ok=True)
            (path / "logs").mkdir()
        except BaseException as err:
            for gone in made:  # innermost first
                with contextlib.suppress(OSError):
                    gone.rmdir()
            # another launch made it between the look and the mkdir
            if isinstance(err, FileExistsError):
                raise _taken(path) from err
            if isinstance(err, OSError):
                raise UsageError(
                    f"cannot make the run directory {path}: {err.strerror or err}; pass "
                    f"--run-dir a folder you can write"
                ) from err
            raise
        return cls(path)

    @staticmethod
    def refuse_used(path: Path, *, batch: bool = False) -> None:
        """UsageError (exit 2) where ``path`` is a file or a folder that holds anything (but a
        batch job's script and output, for the launch inside that job: ``batch``)."""
        try:
            if path.exists() and not path.is_dir():
                raise UsageError(
                    f"--run-dir {path} is a file, not a folder; pass --run-dir a new folder "
                    f"(it is made) or an empty one"
                )
            own = {BATCH_SCRIPT, BATCH_OUTPUT} if batch else set()
            used = path.is_dir() and any(p.name not in own for p in path.iterdir())
        except OSError as err:
            raise UsageError(
                f"cannot read the run directory {path}: {err.strerror or err}; pass --run-dir "
                f"a folder you can write"
            ) from err
        if used:
            raise _taken(path)

    @property
    def name(self) -> str:
        """The run's name, the folder's (``LAUNCHER_RUN_ID``); ``run_id`` is unique to a launch."""
        return Path(os.path.abspath(self.root)).name

    def __str__(self) -> str:
        return str(self.root)

    # -- paths ------------------------------------------------------------------------------

    @property
    def preflight(self) -> Path:
        return self.root / "preflight"

    def plan_file(self, attempt: int) -> Path:
        return self.root / ("plan.json" if attempt == 0 else f"plan.attempt{attempt}.json")

    def rank_log(self, node: str, rank: int | None) -> Path:
        """A rank's log, or (``rank`` None) the node's torchrun lines."""
        name = f"rank{rank}.log" if rank is not None else "torchrun.log"
        return self.root / "logs" / node / name

    def stderr_log(self, node: str, rank: int) -> Path:
        """A rank's stderr alone (its lines are in ``rank_log`` too)."""
        return self.root / "logs" / node / f"rank{rank}.stderr"

    def metrics_file(self, rank: int) -> Path:
        return self.root / metrics.SUBDIR / metrics.file_name(rank)

    def telemetry_file(self, node: str) -> Path:
        return self.root / telemetry.SUBDIR / f"{node}.jsonl"

    def write_stacks(self, files: dict[str, bytes]) -> None:
        """``stacks/``: the workers' stack dumps (``rank<R>.txt``) and collective traces."""
        folder = self.root / STACKS_SUBDIR
        folder.mkdir(exist_ok=True)
        for name, data in files.items():
            (folder / Path(name).name).write_bytes(data)

    def node_files(self, subdir: str, node: str) -> Path:
        """Where files fetched from a node's ``<node dir>/<subdir>`` land (e.g. profile/<node>)."""
        return self.root / subdir / node

    # -- writes -----------------------------------------------------------------------------

    def prepare(self, job: Any, cluster: Any) -> None:
        """Make the folders and record the specs (masked, 0600). UsageError (exit 2) where the
        folder cannot be made or written (a file in the way, no permission, a full disk)."""
        try:
            for sub in ("logs", metrics.SUBDIR, "preflight"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
            write_private(self.root / "job.yaml", spec_yaml(job))
            write_private(self.root / "cluster.yaml", spec_yaml(cluster))
        except OSError as err:
            raise UsageError(
                f"cannot write the run directory {self.root}: {err.strerror or err} "
                f"({err.filename or self.root}); pass --run-dir a folder you can write"
            ) from err

    def write_plan(self, launch_plan: LaunchPlan) -> None:
        text = json.dumps(launch_plan.to_json(), indent=2) + "\n"
        write_private(self.plan_file(launch_plan.attempt), text)


def _taken(path: Path) -> UsageError:
    try:
        entries = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    except OSError:
        entries = []
    shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
    return UsageError(
        f"--run-dir {path} is not empty ({shown or 'another launch took it'}): a run directory holds "
        f"one run, and this launch's logs, metrics and summary would be mixed into what is there. Pick "
        f"a new folder for --run-dir (or leave it out: runs/<job>-<time> is made), or remove {path} "
        f"first if you no longer need it; nothing was started"
    )


def spec_yaml(model: Any) -> str:
    """A spec as YAML for run records, every ``env`` mapping's secret-looking values masked."""
    return yaml.safe_dump(masked_spec(model), sort_keys=False)


def masked_spec(model: Any) -> dict[str, Any]:
    """A spec as plain data, every ``env`` mapping's secret-looking values masked."""
    return _mask_envs(model.model_dump(mode="json"))


def _mask_envs(data: Any) -> Any:
    if isinstance(data, dict):
        return {
            k: (mask_env(v) if k == "env" and isinstance(v, dict) else _mask_envs(v))
            for k, v in data.items()
        }
    if isinstance(data, list):
        return [_mask_envs(v) for v in data]
    return data
