"""``launch export RUN_DIR [--step N] --out DIR``: a run's checkpoint as a Hugging Face folder
that ``from_pretrained`` loads.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

from launcher.errors import SpecError, UsageError
from launcher.spec.job import JobSpec

log = logging.getLogger(__name__)


def export_run(run_dir: Path, *, out: Path, step: int | None = None) -> list[Path]:
    """Write the run's checkpoint at ``step`` (default: the latest complete one) to ``out``."""
    from launcher.spec.hf import FolderError
    from launcher.train.checkpoint import latest_checkpoint

    job = _run_job(run_dir)
    root = job.train.checkpoint.dir
    if root is None:
        raise SpecError(
            "this run saved no checkpoint (train.checkpoint.dir was not set); run the "
            "job with train.checkpoint.dir to export it",
            source=str(run_dir / "job.yaml"),
        )
    path = _checkpoint(root, step) if step is not None else latest_checkpoint(root)
    if path is None:
        raise UsageError(f"no complete checkpoint under {root}; {_available(root)}")
    state = read_model_state(path)
    tokenizer = job.data.tokenizer if job.data.source == "text" else None
    from launcher.train.hf import save_pretrained

    try:
        written = save_pretrained(state, job.model, out, tokenizer=tokenizer)
    except FolderError as err:
        raise UsageError(str(err)) from None
    except ValueError as err:  # the checkpoint does not hold the model its job.yaml describes
        raise SpecError(str(err), source=str(path)) from None
    log.info(
        "exported %s (step %s) to %s: %s",
        run_dir,
        path.name.removeprefix("step_").lstrip("0"),
        out,
        ", ".join(p.name for p in written),
    )
    return written


def read_model_state(path: Path) -> dict:
    """The model's tensors of a DCP checkpoint folder, full (unsharded), on the CPU."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {
        key.removeprefix("model."): torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    if not state:
        raise SpecError("the checkpoint holds no model tensors", source=str(path))
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": state}, checkpoint_id=str(path), no_dist=True)
    return state


def _run_job(run_dir: Path) -> JobSpec:
    from launcher.spec.messages import validate
    from launcher.spec.yamlfile import read_yaml

    job_file = run_dir / "job.yaml"
    if not job_file.is_file():
        raise UsageError(
            f"{run_dir} is not a run directory (no job.yaml); give the folder a "
            f"`launch JOB.yaml` run wrote (runs/<job>-<time>/ by default)"
        )
    job = validate(JobSpec, read_yaml(job_file), source=str(job_file))
    if not job.uses_builtin:
        raise UsageError(
            f"{run_dir} ran a user script ({job.entrypoint.script}); only the built-in "
            f"trainer's checkpoints can be exported"
        )
    return job


def _checkpoint(root: Path, step: int) -> Path:
    from launcher.train.checkpoint import MARKER, step_dir

    path = step_dir(root, step)
    if not (path / MARKER).is_file():
        raise UsageError(f"--step {step}: no complete checkpoint at {path}; {_available(root)}")
    return path


def _available(root: Path) -> str:
    from launcher.train.checkpoint import complete_checkpoints

    steps = [int(p.name[5:]) for p in complete_checkpoints(root)]
    return f"complete checkpoints: steps {', '.join(map(str, steps))}" if steps else "it holds none"
