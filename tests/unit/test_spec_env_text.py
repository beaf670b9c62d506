"""Environment values reach the workers as written: a scalar under an ``env`` mapping (in a job
file, a cluster file or a ``--set``) is its text, not what YAML 1.1 makes of it (``true`` -> 1,
``1.10`` -> 1.1, ``0022`` -> 18, ``1:30`` -> 90). A null is refused, as before; secrets stay masked."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.errors import SpecError
from launcher.spec import apply_overrides, load_cluster, load_job

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


def test_job_file_env_values_are_their_text(tmp_path):
    job = load_job(
        _write(tmp_path, f"name: j\nlaunch:\n  env: {{{FLOW}}}\nnccl:\n  env:\n    NCCL_DEBUG: 1\n")
    )
    assert dict(job.launch.env) == WRITTEN
    assert job.nccl.env == {"NCCL_DEBUG": "1"}


def test_merged_env_values_are_their_text(tmp_path):
    job = load_job(
        _write(
            tmp_path,
            f"name: j\nlaunch:\n  env: &common {{{FLOW}}}\n"
            "nccl:\n  env:\n    <<: *common\n    UMASK: 0077\n",
        )
    )
    assert job.nccl.env == {**WRITTEN, "UMASK": "0077"}


def test_cluster_node_env_values_are_their_text(tmp_path):
    cluster = load_cluster(
        _write(
            tmp_path,
            "nodes:\n  - name: a\n    host: localhost\n"
            "    env: {NCCL_IB_DISABLE: true, V: 1.10, Q: 'x y'}\n",
            "cluster.yaml",
        )
    )
    assert cluster.nodes[0].env == {"NCCL_IB_DISABLE": "true", "V": "1.10", "Q": "x y"}


def test_values_outside_env_are_still_typed(tmp_path):
    job = load_job(
        _write(
            tmp_path,
            "name: j\ntrain: {steps: 0x40, lr: 1.0e-3, compile: off}\nlaunch: {env: {A: 0x10}}\n",
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


def test_set_of_a_whole_env_mapping_keeps_the_text():
    out = apply_overrides({}, ["launch.env={A: true, B: 1.10}", "launch.max_restarts=2"])
    assert out == {"launch": {"env": {"A": "true", "B": "1.10"}, "max_restarts": 2}}


@pytest.mark.parametrize("null", ["~", "null"])
def test_set_of_a_null_env_value_is_refused(tmp_path, null):
    with pytest.raises(
        SpecError, match=r"field 'launch.env.A' \(from --set\): null is not an environment value"
    ):
        load_job(_write(tmp_path, "name: j\n"), [f"launch.env.A={null}"])


def test_secrets_given_as_numbers_are_kept_whole_and_masked(tmp_path):
    from launcher.orchestrate.plan import mask_env

    job = load_job(
        _write(tmp_path, "name: j\nlaunch:\n  env: {DB_PASSWORD: 0022, API_TOKEN: 1.10}\n")
    )
    assert job.launch.env["DB_PASSWORD"] == "0022" and job.launch.env["API_TOKEN"] == "1.10"
    masked = mask_env(dict(job.launch.env))
    assert masked["DB_PASSWORD"] == masked["API_TOKEN"] == "****"


def test_an_anchor_merged_into_env_keeps_its_numbers_outside_env(tmp_path):
    """The merge retags the env mapping's own copy: the anchored mapping, used again as the job's
    train, keeps 0x40 -> 64, 0022 -> 18 and off -> False (the text only under env)."""
    job = load_job(
        _write(
            tmp_path,
            "name: j\ntrain: &t {steps: 0x40, seed: 0022, compile: off}\n"
            "launch:\n  env: {<<: *t, A: 1}\nnccl:\n  env: *t\n",
        )
    )
    assert (job.train.steps, job.train.seed, job.train.compile) == (64, 18, False)
    assert dict(job.launch.env) == {"steps": "0x40", "seed": "0022", "compile": "off", "A": "1"}
    assert job.nccl.env == {"steps": "0x40", "seed": "0022", "compile": "off"}


def test_an_anchor_used_in_env_and_elsewhere_is_typed_outside_env_in_any_order(tmp_path):
    """At the YAML level (no schema): whether the anchor is defined under env or outside it, and
    whether env merges it, lists it in a merge list or is it, every other use keeps its types."""
    from launcher.spec.loader import read_yaml

    data = read_yaml(
        _write(
            tmp_path,
            (
                "launch:\n  env: &e {N: 0x10, V: 1.10}\n"
                "base: &b {n: 7, flag: true}\n"
                "nccl:\n  env: {<<: [*b, *e], X: 2}\n"
                "numbers: {<<: [*e, *b]}\n"
                "node: {env: *b, other: *b}\n"
                "again: *b\n"
            ),
        )
    )
    assert data["launch"]["env"] == {"N": "0x10", "V": "1.10"}
    assert data["nccl"]["env"] == {"n": "7", "flag": "true", "N": "0x10", "V": "1.10", "X": "2"}
    assert data["numbers"] == {"N": 16, "V": 1.1, "n": 7, "flag": True}
    assert data["node"] == {"env": {"n": "7", "flag": "true"}, "other": {"n": 7, "flag": True}}
    assert data["again"] == {"n": 7, "flag": True}
