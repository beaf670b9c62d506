"""Pydantic's validation errors as one SpecError paragraph: the dotted field path, what was
wrong and the fix, the closest known key for a typo."""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from launcher.errors import SpecError
from launcher.spec.base import NAME_PATTERN
from launcher.util import MASK, is_secret, mask_urls

_MODEL_INPUT = re.compile(r"a valid dictionary or instance of (\w+)")


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
        kind = {"JobSpec": "job spec", "ClusterSpec": "cluster spec"}.get(model.__name__)
        raise SpecError(
            f"invalid {kind or model.__name__}{count}: " + "; ".join(lines), source=source
        ) from err


# -- internals ------------------------------------------------------------------------------


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
    return [(".".join(path), _message(model, path, errs)) for path, errs in merged.items()]


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
            out.append(part)
            field = current.model_fields.get(part)  # None: an unknown key
            current = field.annotation if field is not None else None
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
    return non_none[0] if args and len(non_none) == 1 else annotation


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
