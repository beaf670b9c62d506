"""YAML files and ``--set`` overrides in, plain data out; broken YAML is a SpecError naming
the file and the line, a bad override a UsageError."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from launcher.errors import SpecError, UsageError
from launcher.util import first_line


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
        # a SafeLoader that also rejects duplicate keys
        data = yaml.load(text, Loader=_StrictLoader)
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
                value = yaml.load(raw, Loader=_SpecLoader) if raw.strip() else ""
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


# What PyYAML's safe constructors raise besides YAMLError ('!!int 1e3'), and deep nesting's.
_CONSTRUCT_ERRORS = (ValueError, TypeError, KeyError, AttributeError, ArithmeticError)
_YAML_VALUE_ERRORS = (*_CONSTRUCT_ERRORS, RecursionError)


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
        except _CONSTRUCT_ERRORS:
            if not isinstance(node, yaml.ScalarNode):
                raise
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise _TagError(
                None,
                None,
                f"{node.value!r} is not a valid {tag}; fix the value, or quote it to mean the text",
                node.start_mark,
            ) from None


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
                problem = (
                    f"key {key_node.value!r} is read as {type(key).__name__}, not text; quote it"
                )
            elif key in seen:
                problem = f"key {key!r} appears twice in the same mapping; keep one"
            else:
                seen.add(key)
                continue
            raise yaml.constructor.ConstructorError(None, None, problem, key_node.start_mark)
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


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data
