"""Property: any YAML document (or any text) either loads into a valid spec or raises
SpecError / UsageError with exit code 2 — never another exception, never a traceback."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from launcher.errors import SpecError, UsageError
from launcher.spec import ClusterSpec, JobSpec, load_cluster, load_job

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def field_names(model: type[BaseModel]) -> set[str]:
    """Every field name of a model and the models nested in it."""
    schema = model.model_json_schema(by_alias=False)
    return {k for d in [schema, *schema.get("$defs", {}).values()] for k in d.get("properties", {})}


def enum_words(node: object) -> set[str]:
    """Every word a schema allows as a value (its Literal fields' choices)."""
    if isinstance(node, dict):
        found = {v for v in [*node.get("enum", []), node.get("const")] if isinstance(v, str)}
        return found.union(*map(enum_words, node.values()))
    return set().union(*map(enum_words, node)) if isinstance(node, list) else set()


KEYS = sorted(field_names(JobSpec) | field_names(ClusterSpec))
WORDS = sorted(
    enum_words(JobSpec.model_json_schema()) | enum_words(ClusterSpec.model_json_schema())
) + [
    "localhost",
    "10.0.0.1",
    "ray://head:10001",
    "head:6379",
    "node0",
    "train.py",
    "~/.ssh/id_ed25519",
    "",
    "1e-4",
    "0x10",
    "yes",
    "null",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(WORDS),
    st.text(max_size=12),
)
keys = st.one_of(st.sampled_from(KEYS), st.text(max_size=10), st.integers(-3, 3), st.booleans())
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=5)),
    max_leaves=25,
)
# Documents shaped like specs: top-level mappings whose keys are mostly real field names.
documents = st.one_of(
    st.dictionaries(st.sampled_from(KEYS), values, max_size=8),
    st.fixed_dictionaries(
        {"name": st.one_of(st.sampled_from(["job", "a b", "x" * 70]), scalars)},
        optional={k: values for k in JobSpec.model_fields if k not in ("name", "report")},
    ),
    st.fixed_dictionaries(
        {"nodes": st.lists(st.dictionaries(st.sampled_from(KEYS), values, max_size=5), max_size=3)},
        optional={k: values for k in ("ssh", "ray", "parity")},
    ),
    values,
)
set_items = st.lists(
    st.builds(
        lambda k, sep, v: f"{k}{sep}{v}",
        st.one_of(
            st.lists(st.sampled_from(KEYS), min_size=1, max_size=3).map(".".join),
            st.text(max_size=8),
        ),
        st.sampled_from(["=", "", "=="]),
        st.one_of(st.sampled_from(WORDS), st.text(max_size=8)),
    ),
    max_size=3,
)


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


def load_both(path: Path, overrides: list[str] = ()) -> None:
    for load in (lambda: load_job(path, overrides), lambda: load_cluster(path)):
        try:
            load()
        except (SpecError, UsageError) as err:
            assert err.exit_code == 2
            assert str(err) and "Traceback" not in str(err)


@FUZZ
@given(doc=documents, overrides=set_items)
def test_any_yaml_document_loads_or_fails_cleanly(workdir, doc, overrides):
    path = workdir / "doc.yaml"
    try:
        text = yaml.safe_dump(doc, allow_unicode=True)
    except yaml.YAMLError:
        return
    path.write_text(text, encoding="utf-8")
    load_both(path, overrides)


@FUZZ
@given(
    text=st.one_of(
        st.text(max_size=200),
        st.lists(
            st.sampled_from(
                [
                    "name: j",
                    "train:",
                    "  steps: 5",
                    "  - x",
                    "nodes:",
                    "- {name: a, host: b}",
                    "{",
                    "}",
                    "[",
                    ":",
                    "&a x",
                    "*a",
                    "!!python/object:os.system",
                    "\t",
                    "key: 'unclosed",
                    "---",
                    "...",
                    "? complex",
                    "resources: {device: cpu}",
                    "<<: *a",
                    "%YAML 1.1",
                    "train: &r [*r]",
                    "launch: {env: &e {A: *e}}",
                    "1: x",
                    "on: off",
                    'entrypoint: {script: "a\\0b"}',
                    'data: {source: tokens, path: "\\0"}',
                    'train: {checkpoint: {dir: "\\0"}}',
                ]
            ),
            max_size=8,
        ).map("\n".join),
    )
)
def test_any_text_loads_or_fails_cleanly(workdir, text):
    path = workdir / "text.yaml"
    path.write_text(text, encoding="utf-8")
    load_both(path)


@FUZZ
@given(overrides=set_items)
def test_overrides_on_a_valid_job_load_or_fail_cleanly(workdir, overrides):
    path = workdir / "valid.yaml"
    text = "name: j\nresources: {device: cpu}\nprecision: {dtype: fp32}\n"
    path.write_text(text, encoding="utf-8")
    load_both(path, overrides)
