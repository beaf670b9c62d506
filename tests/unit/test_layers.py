"""No private name crosses a package boundary (the layers themselves: `lint-imports`, the
contracts in pyproject.toml)."""

from __future__ import annotations

import ast
from pathlib import Path

import launcher

ROOT = Path(launcher.__file__).parent


def _package(module: str) -> str:
    """``launcher.jobs.head`` -> ``launcher.jobs``; a top-level module is its own package."""
    return ".".join(module.split(".")[:2])


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(source: str, module: str) -> list[str]:
    """``from launcher.x import _name`` and ``module._name`` where the module is another
    package's, in the source of ``module``."""
    here = _package(module)
    tree = ast.parse(source)
    found: list[str] = []
    aliases: dict[str, str] = {}  # local name -> launcher module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not node.module.startswith("launcher"):
                continue
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                if _package(node.module) != here and _private(alias.name):
                    found.append(f"{module}:{node.lineno} imports {target}")
                aliases[alias.asname or alias.name] = target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("launcher") and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and _private(node.attr)
            and _package(aliases[node.value.id]) != here
        ):
            found.append(f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_private_name_crosses_a_package() -> None:
    found = [
        use
        for path in sorted(ROOT.rglob("*.py"))
        for use in private_uses(path.read_text(), _module_name(path))
    ]
    assert found == []


def test_the_check_finds_private_uses() -> None:
    bad = "from launcher.cli import _parse\nimport launcher.util as u\nu._replace\n"
    assert len(private_uses(bad, "launcher.jobs.driver")) == 2
    assert private_uses("from launcher.jobs.head import _read\n", "launcher.jobs.api") == []
