"""YAML files and ``--set`` overrides in, validated specs out; every failure is a SpecError.

Errors name the file, the dotted field path and the fix, suggest the closest known key for a
typo, and report the line of broken YAML. They never carry a traceback to the user.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from launcher.errors import SpecError, UsageError
from launcher.spec import sshconfig
from launcher.spec.cluster import ClusterSpec
from launcher.spec.job import SIZE_PRESETS, JobSpec, ScriptEntrypoint
from launcher.tokenfile import check_token_file
from launcher.util import MASK, first_line, is_secret, mask_urls

DEFAULT_CLUSTER_FILE = Path("cluster.yaml")
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # job and node names
_MODEL_INPUT = re.compile(r"a valid dictionary or instance of (\w+)")


def load_job(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> JobSpec:
    """Read a job file, apply ``--set KEY=VALUE`` overrides and validate."""
    source = Path(path)
    data = read_yaml(source)
    data = apply_overrides(data, overrides)
    job = validate(JobSpec, data, source=str(source), overrides=overrides)
    _refuse_nul_paths(job, source)  # before any path is resolved (init_from's is, next)
    if job.model.init_from is not None:
        job = _with_pretrained_shape(job, source, overrides)
    return _resolve_job_paths(job, source)


def load_cluster(path: str | os.PathLike[str] | None = None) -> ClusterSpec:
    """Read a cluster file; with no path, ./cluster.yaml where it exists, else this machine."""
    if path is None:
        if not DEFAULT_CLUSTER_FILE.is_file():
            return ClusterSpec.this_machine()
        path = DEFAULT_CLUSTER_FILE
    source = Path(path)
    return with_ssh_addresses(validate(ClusterSpec, read_yaml(source), source=str(source)))


def with_ssh_addresses(cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` with each remote node's ``address`` set to the HostName its SSH config
    gives its host (an alias), where the cluster file sets none."""
    nodes = []
    for node in cluster.nodes:
        if node.address is None and not node.is_local:
            hostname = sshconfig.lookup(node.host, cluster.ssh.config).hostname
            if hostname != node.host:
                node = node.model_copy(update={"address": hostname})
        nodes.append(node)
    return cluster.model_copy(update={"nodes": nodes})


def read_yaml(path: Path) -> dict[str, Any]:
    """Parse one YAML mapping; a missing file or broken YAML names the file and line."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError("file not found; check the path", source=str(path)) from None
    except UnicodeDecodeError as err:
        raise SpecError(
            f"not UTF-8 text (byte {err.start}: {err.object[err.start : err.start + 1]!r}); "
            f"YAML files are read as UTF-8: save it so, or check that this is the file you meant",
            source=str(path),
        ) from None
    except OSError as err:
        raise SpecError(f"cannot read the file ({err.strerror})", source=str(path)) from None
    try:
        data = yaml.load(
            text, Loader=_StrictLoader
        )  # a SafeLoader that also rejects duplicate keys
        cycle = _has_cycle(data)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or first_line(err)
        raise SpecError(f"invalid YAML{where}: {problem}", source=str(path)) from None
    except _YAML_VALUE_ERRORS as err:  # a tagged value no constructor could read, deep nesting
        raise SpecError(f"invalid YAML: {_value_problem(err)}", source=str(path)) from None
    if cycle:
        raise SpecError(
            "invalid YAML: an alias (*name) refers to a mapping or list that contains it; "
            "write the value out instead of the cycle",
            source=str(path),
        )
    if data is None:
        raise SpecError(
            "the file is empty; a job file needs at least 'name', a cluster file at least 'nodes'",
            source=str(path),
        )
    if not isinstance(data, dict):
        raise SpecError(
            f"the top level must be a mapping of keys, not a {type(data).__name__} "
            f"('name: ...' and sections in a job file; a cluster file puts its node list under 'nodes:')",
            source=str(path),
        )
    return data


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a copy of ``data``; values are parsed as YAML scalars,
    except an environment variable's (``launch.env.NAME=VALUE``): its text as given."""
    out = _deep_copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise UsageError(
                f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. --set train.steps=50"
            )
        try:
            if len(parts) > 1 and parts[-2] == "env":
                value = _env_text(raw)
            else:
                value = yaml.load(raw, Loader=_SetValueLoader) if raw.strip() else ""
        except _TagError as err:
            raise UsageError(
                f"--set {_shortened(item)!r}: the value cannot be read: {err.problem}"
            ) from None
        except yaml.YAMLError:
            value = raw  # not YAML (e.g. 'a: b: c'): the text itself
        except _YAML_VALUE_ERRORS as err:
            raise UsageError(
                f"--set {_shortened(item)!r}: the value cannot be read: {_value_problem(err)}"
            ) from None
        node = out
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return out


def validate(
    model: type[BaseModel], data: Any, *, source: str, overrides: Sequence[str] = ()
) -> Any:
    """Validate ``data`` into ``model``; all problems go into one SpecError paragraph."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        problems = _describe(model, err, data)
        from_set = {o.partition("=")[0].strip() for o in overrides}
        lines = [
            f"field '{f}'{' (from --set)' if f in from_set else ''}: {msg}" if f else msg
            for f, msg in problems
        ]
        count = "" if len(lines) == 1 else f" ({len(lines)} problems)"
        raise SpecError(
            f"invalid {_kind(model)}{count}: " + "; ".join(lines), source=source
        ) from err


# -- internals ------------------------------------------------------------------------------


def _kind(model: type[BaseModel]) -> str:
    return {"JobSpec": "job spec", "ClusterSpec": "cluster spec"}.get(
        model.__name__, model.__name__
    )


# What PyYAML's safe constructors raise besides YAMLError: a tagged value they cannot read
# ('!!int 1e3' ValueError, '!!bool maybe' KeyError, '!!timestamp today' AttributeError), and
# nesting deeper than Python's recursion limit.
_YAML_VALUE_ERRORS = (
    ValueError,
    TypeError,
    KeyError,
    AttributeError,
    ArithmeticError,
    RecursionError,
)


class _TagError(yaml.constructor.ConstructorError):
    """A tagged scalar that its constructor could not read, with the scalar's line."""


def _shortened(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _value_problem(err: BaseException) -> str:
    if isinstance(err, RecursionError):
        return "mappings or lists are nested too deeply to read; flatten them"
    return f"a value cannot be read ({type(err).__name__}: {first_line(err)}); fix it or quote it"


_NULL_WORDS = {"~", "null", "Null", "NULL"}  # YAML 1.1's nulls


def _env_text(raw: str) -> str | None:
    """The value of ``--set ...env.NAME=VALUE``: the text as given, which the worker gets.
    A YAML-quoted value (``'1.10'``) loses its quotes; a null word (``~``, ``null``) is null,
    which the spec refuses, as in a file."""
    stripped = raw.strip()
    if stripped in _NULL_WORDS:
        return None
    if stripped[:1] in ("'", '"'):
        try:
            node = yaml.compose(stripped, Loader=yaml.SafeLoader)
        except yaml.YAMLError:
            return raw
        if isinstance(node, yaml.ScalarNode) and node.style in ("'", '"'):
            return node.value
    return raw


class _SpecLoader(yaml.SafeLoader):
    """A SafeLoader whose failures to construct a tagged scalar (``!!int 1e3``) are _TagErrors
    naming the value, its tag and its line, instead of a bare ValueError or KeyError."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError):
            if not isinstance(node, yaml.ScalarNode):
                raise
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise _TagError(
                None,
                None,
                f"{node.value!r} is not a valid {tag}; fix the value, or quote it to mean the text",
                node.start_mark,
            ) from None


class _SetValueLoader(_SpecLoader):
    """The value of one ``--set`` override."""


class _StrictLoader(_SpecLoader):
    """A SafeLoader that rejects a key given twice in one mapping (PyYAML keeps the last) and
    keys that YAML reads as something other than text (``1:``, ``on:``, ``null:``)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *anchor' keys merge, never repeat
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key_node.value!r} is read as {type(key).__name__}, not text; quote it",
                    key_node.start_mark,
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice in the same mapping; keep one",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _has_cycle(data: Any, parents: frozenset[int] = frozenset()) -> bool:
    """True when an alias makes a mapping or list contain itself (``a: &x [*x]``)."""
    if not isinstance(data, dict | list):
        return False
    if id(data) in parents:
        return True
    inner = parents | {id(data)}
    children = data.values() if isinstance(data, dict) else data
    return any(_has_cycle(child, inner) for child in children)


def _describe(
    model: type[BaseModel], err: ValidationError, data: Any = None
) -> list[tuple[str, str]]:
    """Turn pydantic's errors into (dotted field, message) pairs a person can act on."""
    raw: list[tuple[tuple[str, ...], dict[str, Any]]] = []
    for e in err.errors(include_url=False):
        details: dict[str, Any] = dict(e)
        if e["type"] == "extra_forbidden":
            details["given"] = _keys_beside(data, e["loc"])
        raw.append((_field_path(model, e["loc"]), details))
    # A union (e.g. entrypoint: builtin | {script, ...}) reports one error per branch; when a
    # branch got further (a nested field is wrong), the shallow "expected X" error is noise.
    paths = [p for p, _ in raw]
    kept = [(p, d) for p, d in raw if not any(len(q) > len(p) and q[: len(p)] == p for q in paths)]
    merged: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for p, d in kept:
        merged.setdefault(p, []).append(d)
    out = []
    for path, errs in merged.items():
        dotted = ".".join(path)
        out.append((dotted, _message(model, path, errs)))
    return out


def _field_path(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[str, ...]:
    """The user's dotted path for a pydantic loc: field names and indices, no union-branch tags."""
    out: list[str] = []
    current: Any = model
    for part in loc:
        current = _unwrap(current)
        if isinstance(part, int):
            if out:
                out[-1] += f"[{part}]"
            current = get_args(current)[0] if get_args(current) else None
        elif _is_model(current):
            if part in current.model_fields:
                out.append(part)
                current = current.model_fields[part].annotation
            else:
                out.append(part)  # an unknown key
                current = None
        elif get_origin(current) is dict:
            out.append(part)
            current = get_args(current)[1]
        elif _union_args(current):
            branch = next(
                (a for a in _union_args(current) if getattr(a, "__name__", "") == part), None
            )
            current = branch  # a tag like "literal['builtin']" or "int" matches no model: None
        else:
            out.append(part)
            current = None
    return tuple(out)


def _is_model(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseModel)


def _union_args(annotation: Any) -> tuple[Any, ...]:
    return get_args(annotation) if get_origin(annotation) in (Union, UnionType) else ()


def _unwrap(annotation: Any) -> Any:
    """Optional[X] / X | None -> X; Annotated[X, ...] -> X."""
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    args = _union_args(annotation)
    non_none = [a for a in args if a is not type(None)]
    if args and len(non_none) == 1:
        return non_none[0]
    return annotation


def _model_at(model: type[BaseModel], path: tuple[str, ...]) -> type[BaseModel] | None:
    """The model holding the last key of ``path`` (for did-you-mean suggestions)."""
    current: Any = model
    for part in path:
        name = part.split("[")[0]
        current = _unwrap(current)
        if not _is_model(current) or name not in current.model_fields:
            return None
        current = _unwrap(current.model_fields[name].annotation)
        if get_origin(current) is list:
            current = _unwrap(get_args(current)[0])
        models = [a for a in _union_args(current) if _is_model(a)]
        if len(models) == 1:
            current = models[0]
    return current if _is_model(current) else None


def _keys_beside(data: Any, loc: tuple[Any, ...]) -> set[str]:
    """The other keys the user gave next to the unknown key at ``loc`` (union tags skipped)."""
    node = data
    for part in loc[:-1]:
        if isinstance(node, dict):
            node = node.get(part, node)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
    return {str(k) for k in node if k != loc[-1]} if isinstance(node, dict) else set()


def _message(model: type[BaseModel], path: tuple[str, ...], errs: list[dict[str, Any]]) -> str:
    first = errs[0]
    if first["type"] == "extra_forbidden":
        return _unknown_key(model, path, first.get("given", set()))
    if first["type"] == "missing":
        return "required but missing; add it"
    if (
        first["type"] == "string_pattern_mismatch"
        and first.get("ctx", {}).get("pattern") == NAME_PATTERN
    ):
        return (
            f"{first.get('input')!r} is not a valid name; use letters, digits, '.', '_' and '-' "
            f"(at most 64, starting with a letter or digit)"
        )
    texts = []
    for e in errs:
        msg = e["msg"]
        msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        msg = _MODEL_INPUT.sub(lambda m: _mapping_of(model, path, m.group(1)), msg)
        texts.append(msg.removeprefix("Input should be ") if len(errs) > 1 else msg)
    # the value as given, a URL's password masked; a secret-looking key's value not shown at all
    given = MASK if any(is_secret(str(p)) for p in path) else mask_urls(repr(first.get("input")))
    if len(errs) > 1:
        return f"got {given}; expected " + " or ".join(dict.fromkeys(texts))
    if first["type"] in {"value_error", "assertion_error"}:
        return texts[0]
    return f"{texts[0]} (got {given})"


def _mapping_of(model: type[BaseModel], path: tuple[str, ...], name: str) -> str:
    """'a valid dictionary or instance of DataSpec' -> 'a mapping with keys source, seq_len, ...'."""
    target = _model_at(model, path)
    if target is None or target.__name__ != name:
        return "a mapping"
    return f"a mapping with keys {', '.join(target.model_fields)}"


def _unknown_key(
    model: type[BaseModel], path: tuple[str, ...], given: AbstractSet[str] = frozenset()
) -> str:
    key = path[-1]
    parent = _model_at(model, path[:-1])
    known = list(parent.model_fields) if parent is not None else []
    # Keys not given yet are the likelier meaning ('hostname' beside 'name' means 'host'),
    # then any close key, then a key the typo abbreviates ('nproc' for 'nproc_per_node').
    not_given = [k for k in known if k not in given]
    hint = difflib.get_close_matches(key, not_given, n=1, cutoff=0.6) or difflib.get_close_matches(
        key, known, n=1, cutoff=0.6
    )
    if not hint and len(key) >= 3:
        hint = [k for k in not_given if k.startswith(key) or key in k.split("_")][:1]
    if hint:
        return f"unknown key. Instead of '{key}', did you mean '{hint[0]}'?"
    if known:
        return f"unknown key '{key}'; known keys here: {', '.join(known)}"
    return f"unknown key '{key}'"


def _with_pretrained_shape(job: JobSpec, source: Path, overrides: Sequence[str]) -> JobSpec:
    """model.init_from: arch and dims come from the folder's config.json, its tensors are checked
    against them (names and shapes), and any arch, size or dim the job gives must agree."""
    from launcher.spec.hf import FolderError, check_folder

    assert job.model.init_from is not None
    folder = _local_folder(
        job.model.init_from, source.parent, "model.init_from", "model weights", source
    )
    try:
        arch, dims = check_folder(folder)
    except FolderError as err:
        raise SpecError(str(err), source=str(source), field=err.field) from None
    model, given = job.model, job.model.model_fields_set
    conflicts = (
        [f"model.arch {model.arch} (the folder holds a {arch})"]
        if "arch" in given and model.arch != arch
        else []
    )
    conflicts += [
        f"model.{k} {getattr(model, k)} (config.json: {v})"
        for k, v in dims.items()
        if k in given and getattr(model, k) != v
    ]
    if not model.bias:
        conflicts.append("model.bias false (the folder's weights have biases)")
    # A size preset decides only the dims the job does not give explicitly.
    if "size" in given:
        preset = dict(
            zip(("n_layers", "d_model", "n_heads"), SIZE_PRESETS[model.size], strict=True)
        )
        wrong = [k for k, v in preset.items() if k not in given and v != dims[k]]
        if wrong:
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


def _local_folder(value: Path, base: Path, field: str, what: str, source: Path) -> Path:
    """A folder on this machine (relative to the job file's folder), or the download hint."""
    folder = value if value.is_absolute() else (base / value).resolve()
    if not folder.is_dir():
        from launcher.spec.hf import not_a_folder

        raise SpecError(
            str(not_a_folder(field, str(value), folder, what)), source=str(source), field=field
        )
    return folder


def _refuse_nul_paths(job: JobSpec, source: Path) -> None:
    """A path with a NUL character is a SpecError naming the field (the OS would refuse it
    with a ValueError wherever it is first used)."""
    entry = job.script_entry
    for field, value in (
        ("data.path", job.data.path),
        ("train.checkpoint.dir", job.train.checkpoint.dir),
        ("entrypoint.script", entry and entry.script),
        ("entrypoint.workdir", entry and entry.workdir),
        ("model.init_from", job.model.init_from),
        ("data.tokenizer", job.data.tokenizer),
        ("data.cache_dir", job.data.cache_dir),
    ):
        if value is not None and "\x00" in str(value):
            raise SpecError(
                f"{field} {str(value)!r} contains a NUL character; give a plain path",
                source=str(source),
                field=field,
            )


def _resolve_job_paths(job: JobSpec, source: Path) -> JobSpec:
    """Relative data, model and script paths are taken from the job file's folder (a relative
    checkpoint folder from where ``launch`` runs, as every checkpoint folder); scripts must exist."""
    base = source.parent
    updates: dict[str, Any] = {}
    if job.data.source == "text":
        updates["data"] = _resolve_text_paths(job, source)
    elif job.data.path is not None:
        tokens = job.data.path if job.data.path.is_absolute() else (base / job.data.path).resolve()
        if not tokens.is_file():
            raise SpecError(
                f"data.path {str(job.data.path)!r} does not exist (looked for {tokens}); give the "
                f"token file (.npy or .bin) on a path every node sees; relative paths are taken "
                f"from the job file's folder",
                source=str(source),
                field="data.path",
            )
        if (
            job.uses_builtin
        ):  # what its trainer refuses at start: a window of data.seq_len + 1 tokens
            try:
                check_token_file(tokens, job.data.token_dtype, job.data.seq_len + 1)
            except (OSError, ValueError) as err:
                raise SpecError(str(err), source=str(source), field="data.path") from None
        updates["data"] = job.data.model_copy(update={"path": tokens})
    if job.train.checkpoint.dir is not None and not job.train.checkpoint.dir.is_absolute():
        ckpt = job.train.checkpoint.model_copy(update={"dir": job.train.checkpoint.dir.resolve()})
        updates["train"] = job.train.model_copy(update={"checkpoint": ckpt})
    if job.script_entry is not None:
        updates["entrypoint"] = _resolve_script(job.script_entry, base, source)
    return job.model_copy(update=updates) if updates else job


def _resolve_text_paths(job: JobSpec, source: Path) -> Any:
    """data.source text: the text (a .txt/.jsonl file or a folder of them), the tokenizer folder
    (with tokenizer.json) and the cache folder, taken from the job file's folder."""
    from launcher.spec.hf import FolderError, check_tokenizer, require

    data, base = job.data, source.parent
    assert data.path is not None and data.tokenizer is not None
    text = data.path if data.path.is_absolute() else (base / data.path).resolve()
    if not (
        text.is_file()
        and text.suffix in (".txt", ".jsonl")
        or text.is_dir()
        and any(p.suffix in (".txt", ".jsonl") for p in text.rglob("*"))
    ):
        raise SpecError(
            f"data.path {str(data.path)!r} (looked for {text}) is neither a .txt or .jsonl file nor "
            f"a folder holding some; give the text on a path every node sees",
            source=str(source),
            field="data.path",
        )
    tokenizer = _local_folder(data.tokenizer, base, "data.tokenizer", "the tokenizer", source)
    if not (tokenizer / "tokenizer.json").is_file():
        raise SpecError(
            f"data.tokenizer {str(tokenizer)!r} has no tokenizer.json; save the tokenizer with the "
            f"tokenizers library (tokenizer.save) or with transformers "
            f"(AutoTokenizer.from_pretrained(...).save_pretrained(DIR))",
            source=str(source),
            field="data.tokenizer",
        )
    try:
        require("tokenizers", "data.source text", "data.tokenizer")
        check_tokenizer(tokenizer, job.model.arch, job.model.dims()["vocab_size"])
    except FolderError as err:
        raise SpecError(str(err), source=str(source), field=err.field) from None
    update: dict[str, Any] = {"path": text, "tokenizer": tokenizer}
    if data.cache_dir is not None and not data.cache_dir.is_absolute():
        update["cache_dir"] = (base / data.cache_dir).resolve()
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


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data
