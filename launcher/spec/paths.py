"""A loaded job's paths made absolute from its file's folder and checked: data, tokenizer,
checkpoints, the script, and a model folder whose config.json gives the model's shape."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from launcher.errors import SpecError
from launcher.spec.job import SIZE_PRESETS, JobSpec, ScriptEntrypoint
from launcher.spec.messages import validate
from launcher.spec.report import resolve_store
from launcher.tokenfile import check_token_file


def with_pretrained_shape(job: JobSpec, source: Path, overrides: Sequence[str]) -> JobSpec:
    """model.init_from: arch and dims come from the folder's config.json, its tensors are checked
    against them (names and shapes), and any arch, size or dim the job gives must agree."""
    from launcher.spec.hf import FolderError, check_folder

    assert job.model.init_from is not None
    folder = _local_folder(job.model.init_from, "model.init_from", "model weights", source)
    try:
        arch, dims = check_folder(folder)
    except FolderError as err:
        raise SpecError(str(err), source=str(source), field=err.field) from None
    model, given = job.model, job.model.model_fields_set
    conflicts = [
        f"model.{k} {getattr(model, k)} (config.json: {v})"
        for k, v in dims.items()
        if k in given and getattr(model, k) != v
    ]
    if "arch" in given and model.arch != arch:
        conflicts.insert(0, f"model.arch {model.arch} (the folder holds a {arch})")
    if not model.bias:
        conflicts.append("model.bias false (the folder's weights have biases)")
    # A size preset decides only the dims the job does not give explicitly.
    if "size" in given:
        preset = dict(
            zip(("n_layers", "d_model", "n_heads"), SIZE_PRESETS[model.size], strict=True)
        )
        if any(k not in given and v != dims[k] for k, v in preset.items()):
            shape = "x".join(str(dims[k]) for k in preset)
            conflicts.append(
                f"model.size {model.size} (config.json: {shape} layers x d_model x heads)"
            )
    if conflicts:
        raise SpecError(
            f"model.init_from {str(folder)!r} gives the model's shape, and the job disagrees: "
            f"{'; '.join(conflicts)}. Remove these keys (the folder's config.json decides) or "
            f"point init_from at the model you meant",
            source=str(source),
            field="model",
        )
    data = job.model_dump(mode="json", exclude_unset=True)
    layers = (dims["n_layers"], dims["d_model"], dims["n_heads"])
    size = next((name for name, preset in SIZE_PRESETS.items() if preset == layers), None)
    data["model"] = {
        **data.get("model", {}),
        "arch": arch,
        **dims,
        "init_from": str(folder),
        **({"size": size} if size and "size" not in given else {}),
    }
    return validate(JobSpec, data, source=str(source), overrides=overrides)


def _local_folder(value: Path, field: str, what: str, source: Path) -> Path:
    """A folder on this machine (relative to the job file's folder), or the hint that makes it."""
    folder = _absolute(value, source.parent)
    if not folder.is_dir():
        message = _assets_hint(field, value, folder, source) or (
            f"{field} {str(value)!r} is not a local folder (looked for {folder}). The launcher "
            f"reads {what} from disk and never downloads at run time: download it first, e.g. "
            f"`hf download {value} --local-dir models/{value.name}` (pip install "
            f"huggingface_hub), and set {field} to that folder; relative paths are taken from "
            f"the job file's folder"
        )
        raise SpecError(message, source=str(source), field=field)
    return folder


def _absolute(path: Path, base: Path) -> Path:
    """``path`` as given where it is absolute, else taken from ``base`` (the job file's folder)."""
    return path if path.is_absolute() else (base / path).resolve()


def _assets_hint(field: str, value: Path, looked: Path, source: Path) -> str | None:
    """Where the job file's folder has a make_assets.py (as the examples do), the way to make
    a missing path is to run it."""
    script = source.parent / "make_assets.py"
    if not script.is_file():
        return None
    return (
        f"{field} {str(value)!r} does not exist (looked for {looked}). This job's folder makes "
        f"its own assets: run `python {script}` first (it needs the hf extra), then launch again"
    )


def refuse_nul_paths(spec: BaseModel, source: Path, prefix: str = "") -> None:
    """A path anywhere in ``spec`` with a NUL character is a SpecError naming the field (the OS
    would refuse it with a ValueError wherever it is first used)."""
    for name in type(spec).model_fields:
        value, field = getattr(spec, name), prefix + name
        if isinstance(value, BaseModel):
            refuse_nul_paths(value, source, f"{field}.")
        elif isinstance(value, Path) and "\x00" in str(value):
            raise SpecError(
                f"{field} {str(value)!r} contains a NUL character; give a plain path",
                source=str(source),
                field=field,
            )


def resolve_job_paths(job: JobSpec, source: Path) -> JobSpec:
    """Relative data, model, checkpoint and script paths (and an MLflow folder) are taken from
    the job file's folder; scripts must exist."""
    base = source.parent
    updates: dict[str, Any] = {}
    if job.data.source == "text":
        updates["data"] = _resolve_text_paths(job, source)
    elif job.data.path is not None:
        update = {"path": _token_file(job, job.data.path, "data.path", source)}
        if job.data.val_path is not None:
            update["val_path"] = _token_file(job, job.data.val_path, "data.val_path", source)
        updates["data"] = job.data.model_copy(update=update)
    if job.train.checkpoint.dir is not None:
        ckpt_dir = _absolute(job.train.checkpoint.dir, base)
        ckpt = job.train.checkpoint.model_copy(update={"dir": ckpt_dir})
        updates["train"] = job.train.model_copy(update={"checkpoint": ckpt})
    if job.script_entry is not None:
        updates["entrypoint"] = _resolve_script(job.script_entry, base, source)
    if job.report.mlflow is not None:
        updates["report"] = resolve_store(job.report, base)
    return job.model_copy(update=updates) if updates else job


def _token_file(job: JobSpec, path: Path, field: str, source: Path) -> Path:
    """A token file (``data.path``, ``data.val_path``) from the job file's folder, checked."""
    tokens = _absolute(path, source.parent)
    if not tokens.is_file():
        raise SpecError(
            f"{field} {str(path)!r} does not exist (looked for {tokens}); give the "
            f"token file (.npy or .bin) on a path every node sees; relative paths are taken "
            f"from the job file's folder",
            source=str(source),
            field=field,
        )
    if job.uses_builtin:  # what its trainer refuses at start: a window of data.seq_len + 1 tokens
        try:
            check_token_file(tokens, job.data.token_dtype, job.data.seq_len + 1)
        except (OSError, ValueError) as err:
            raise SpecError(str(err), source=str(source), field=field) from None
    return tokens


def _text(path: Path, field: str, source: Path) -> Path:
    """Text (a .txt/.jsonl file or a folder of them: ``data.path``, ``data.val_path``) from the
    job file's folder, checked."""
    text = _absolute(path, source.parent)
    if not (
        text.is_file()
        and text.suffix in (".txt", ".jsonl")
        or text.is_dir()
        and any(p.suffix in (".txt", ".jsonl") for p in text.rglob("*"))
    ):
        raise SpecError(
            _assets_hint(field, path, text, source)
            or f"{field} {str(path)!r} (looked for {text}) is neither a .txt or .jsonl file "
            f"nor a folder holding some; give the text on a path every node sees",
            source=str(source),
            field=field,
        )
    return text


def _resolve_text_paths(job: JobSpec, source: Path) -> Any:
    """data.source text: the text (a .txt/.jsonl file or a folder of them), the tokenizer folder
    (with tokenizer.json) and the cache folder, taken from the job file's folder."""
    from launcher.spec.hf import FolderError, check_tokenizer

    data, base = job.data, source.parent
    assert data.path is not None and data.tokenizer is not None
    text = _text(data.path, "data.path", source)
    tokenizer = _local_folder(data.tokenizer, "data.tokenizer", "the tokenizer", source)
    if not (tokenizer / "tokenizer.json").is_file():
        raise SpecError(
            f"data.tokenizer {str(tokenizer)!r} has no tokenizer.json; save the tokenizer with the "
            f"tokenizers library (tokenizer.save) or with transformers "
            f"(AutoTokenizer.from_pretrained(...).save_pretrained(DIR))",
            source=str(source),
            field="data.tokenizer",
        )
    try:
        check_tokenizer(tokenizer, job.model.arch, job.model.dims()["vocab_size"])
    except FolderError as err:
        raise SpecError(str(err), source=str(source), field=err.field) from None
    update: dict[str, Any] = {"path": text, "tokenizer": tokenizer}
    if data.val_path is not None:
        update["val_path"] = _text(data.val_path, "data.val_path", source)
    if data.cache_dir is not None:
        update["cache_dir"] = _absolute(data.cache_dir, base)
    return data.model_copy(update=update)


def _resolve_script(entry: ScriptEntrypoint, base: Path, source: Path) -> ScriptEntrypoint:
    """The workdir from the job file's folder (default: that folder), the script from the workdir."""
    workdir = (base / entry.workdir).resolve() if entry.workdir is not None else base.resolve()
    if not workdir.is_dir():
        raise SpecError(
            f"entrypoint.workdir {str(entry.workdir)!r} is not a folder (looked for {workdir}); give the "
            f"folder your script runs in, relative to the job file's folder, or leave it out to use "
            f"that folder",
            source=str(source),
            field="entrypoint.workdir",
        )
    script = (workdir / entry.script).resolve()
    if not script.is_file():
        raise SpecError(
            f"entrypoint.script {str(entry.script)!r} does not exist (looked for {script}); the script "
            f"is taken relative to entrypoint.workdir ({workdir})",
            source=str(source),
            field="entrypoint.script",
        )
    return entry.model_copy(update={"workdir": workdir, "script": script})
