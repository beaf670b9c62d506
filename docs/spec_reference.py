"""Write docs/spec-reference.md from the committed JSON Schemas (`just schema` runs it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / "launcher" / "spec" / "schemas"
OUT = ROOT / "docs" / "spec-reference.md"

HEADER = """\
# Spec reference

Every field of a job file (`jobs/*.yaml`) and a cluster file (`cluster.yaml`), with its type,
default and description. Generated from `launcher/spec/schemas/*.schema.json` by
`docs/spec_reference.py`; regenerate both with `just schema`. Set any field from the command
line with `--set KEY=VALUE` (e.g. `--set train.steps=50`). *pinned* marks a key that scripts
and docs rely on: its name and meaning are kept.
"""


def _type(prop: dict[str, Any], defs: dict[str, Any]) -> str:
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    if "const" in prop:
        return json.dumps(prop["const"])
    if "enum" in prop:
        return " \\| ".join(json.dumps(v) for v in prop["enum"])
    for key in ("anyOf", "oneOf", "allOf"):
        if key in prop:
            return " \\| ".join(_type(p, defs) for p in prop[key])
    kind = prop.get("type", "any")
    if kind == "array":
        return f"list of {_type(prop.get('items', {}), defs)}"
    if kind == "object" and "additionalProperties" in prop:
        return f"map of {_type(prop['additionalProperties'], defs)}"
    return str(kind)


def _default(prop: dict[str, Any], required: bool) -> str:
    if "default" not in prop:
        if required:
            return "required"
        return "see below" if "$ref" in prop else "see description"
    value = prop["default"]
    if isinstance(value, dict):
        return "(see below)" if value else "{}"
    return f"`{json.dumps(value)}`"


def _section(
    path: str, schema: dict[str, Any], defs: dict[str, Any], lines: list[str], level: int
) -> None:
    nested: list[tuple[str, dict[str, Any]]] = []
    lines += ["", f"{'#' * level} `{path}`", ""] if path else [""]
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    required = set(schema.get("required", []))
    for name, prop in schema.get("properties", {}).items():
        desc = " ".join(prop.get("description", "").split()).replace("|", "\\|")
        default = _default(prop, name in required)
        lines.append(f"| `{name}` | {_type(prop, defs)} | {default} | {desc} |")
        for ref in _refs(prop):
            nested.append((f"{path}.{name}" if path else name, defs[ref]))
    for sub_path, sub in nested:
        _section(sub_path, sub, defs, lines, min(level + 1, 4))


def _refs(prop: dict[str, Any]) -> list[str]:
    if "$ref" in prop:
        return [prop["$ref"].rsplit("/", 1)[-1]]
    if prop.get("type") == "array":
        return _refs(prop.get("items", {}))
    refs: list[str] = []
    for key in ("anyOf", "oneOf", "allOf"):
        for p in prop.get(key, []):
            refs += _refs(p)
    return refs


def render() -> str:
    lines = [HEADER.rstrip()]
    for which, title in (("job", "Job file"), ("cluster", "Cluster file")):
        schema = json.loads((SCHEMAS / f"{which}.schema.json").read_text())
        lines += ["", f"## {title}"]
        _section("", schema, schema.get("$defs", {}), lines, 2)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    text = render()
    if sys.argv[1:] == ["--check"]:
        sys.exit(
            0 if OUT.read_text() == text else "docs/spec-reference.md is stale: run `just schema`"
        )
    OUT.write_text(text)
