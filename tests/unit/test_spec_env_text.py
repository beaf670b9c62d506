"""Environment values reach the workers as written: a value under an ``env`` mapping must be
text. One YAML reads as something else (``true``, ``1.10``, ``0022``, ``1:30``) is refused with
"quote it"; ``--set ...env.NAME=VALUE`` takes the text given. A null is refused too."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.errors import SpecError
from launcher.spec import load_cluster, load_job

WRITTEN = {
    "OMP_PROC_BIND": "true",
    "APP_VERSION": "1.10",
    "UMASK": "0022",
    "T": "1:30",
    "SWITCH": "off",
    "HEX": "0x1f",
    "N": "7",
    "BIG": "1e3",
    "DATE": "2024-01-02",
}
FLOW = ", ".join(f"{k}: {v}" for k, v in WRITTEN.items())


def _write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


QUOTED_FLOW = ", ".join(f"{k}: '{v}'" for k, v in WRITTEN.items())


def test_quoted_env_values_are_their_text(tmp_path):
    job = load_job(
        _write(tmp_path, f"name: j\nlaunch:\n  env: {{{QUOTED_FLOW}}}\nnccl:\n  env: {{X: INFO}}\n")
    )
    assert dict(job.launch.env) == WRITTEN
    assert job.nccl.env == {"X": "INFO"}


@pytest.mark.parametrize("value", ["true", "1.10", "0022", "7", "1:30", "2024-01-02"])
def test_an_env_value_yaml_reads_as_no_text_is_refused_saying_quote_it(tmp_path, value):
    with pytest.raises(
        SpecError, match=r"field 'launch.env.A': YAML read this value as a \w+; quote it"
    ):
        load_job(_write(tmp_path, f"name: j\nlaunch:\n  env:\n    A: {value}\n"))


def test_a_cluster_node_env_value_must_be_text_too(tmp_path):
    path = _write(
        tmp_path,
        "nodes:\n  - name: a\n    host: localhost\n    env: {V: '1.10', Q: x y}\n",
        "cluster.yaml",
    )
    assert load_cluster(path).nodes[0].env == {"V": "1.10", "Q": "x y"}
    path.write_text("nodes:\n  - name: a\n    host: localhost\n    env: {NCCL_IB_DISABLE: 1}\n")
    with pytest.raises(
        SpecError,
        match=r"nodes\[0\].env.NCCL_IB_DISABLE': YAML read this value as a number; quote it",
    ):
        load_cluster(path)


def test_values_outside_env_are_still_typed(tmp_path):
    job = load_job(
        _write(
            tmp_path,
            "name: j\ntrain: {steps: 0x40, lr: 1.0e-3, compile: off}\nlaunch: {env: {A: '0x10'}}\n",
        )
    )
    assert job.train.steps == 64 and job.train.lr == 1e-3 and job.train.compile is False
    assert job.launch.env == {"A": "0x10"}


@pytest.mark.parametrize("null", ["~", "null", ""])
def test_a_null_env_value_is_refused_naming_the_field(tmp_path, null):
    with pytest.raises(SpecError, match=r"field 'launch.env.A': null is not an environment value"):
        load_job(_write(tmp_path, f"name: j\nlaunch:\n  env:\n    A: {null}\n"))


def test_set_env_values_are_the_text_given(tmp_path):
    overrides = [f"launch.env.{k}={v}" for k, v in WRITTEN.items()]
    overrides += [
        "launch.env.OPTS=--fast #not a comment",
        "launch.env.MAP=a: b",
        "launch.env.QUOTED='1.10'",
        "launch.env.EMPTY=",
        "nccl.env.NCCL_DEBUG=INFO",
    ]
    job = load_job(_write(tmp_path, "name: j\n"), overrides)
    assert job.launch.env == {
        **WRITTEN,
        "OPTS": "--fast #not a comment",
        "MAP": "a: b",
        "QUOTED": "1.10",
        "EMPTY": "",
    }
    assert job.nccl.env == {"NCCL_DEBUG": "INFO"}


def test_set_of_a_whole_env_mapping_is_yaml_whose_values_must_be_text(tmp_path):
    job = load_job(_write(tmp_path, "name: j\n"), ["launch.env={A: 'true', B: x}"])
    assert job.launch.env == {"A": "true", "B": "x"}
    with pytest.raises(
        SpecError, match=r"launch.env.B': YAML read this value as a number; quote it"
    ):
        load_job(_write(tmp_path, "name: j\n"), ["launch.env={A: x, B: 1.10}"])


@pytest.mark.parametrize("null", ["~", "null"])
def test_set_of_a_null_env_value_is_refused(tmp_path, null):
    with pytest.raises(
        SpecError, match=r"field 'launch.env.A' \(from --set\): null is not an environment value"
    ):
        load_job(_write(tmp_path, "name: j\n"), [f"launch.env.A={null}"])


def test_the_refusal_of_a_secret_never_shows_its_value(tmp_path):
    with pytest.raises(SpecError) as err:
        load_job(_write(tmp_path, "name: j\nlaunch:\n  env: {DB_PASSWORD: 123456789}\n"))
    assert "123456789" not in str(err.value)
