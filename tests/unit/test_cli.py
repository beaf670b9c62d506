"""The CLI contract: commands, exit codes, one-paragraph errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fixtures.launching import ROOT

from launcher.cli import _parse, main
from launcher.spec import ClusterSpec, JobSpec


def test_schema_commands_match_the_committed_schemas(capsys):
    for which in ("job", "cluster"):
        assert main(["schema", which]) == 0
        printed = json.loads(capsys.readouterr().out)
        committed = json.loads((ROOT / f"launcher/spec/schemas/{which}.schema.json").read_text())
        assert printed == committed, f"run `just schema`: {which}.schema.json is stale"


def test_every_field_has_a_description():
    def walk(schema, defs, path=""):
        for name, prop in schema.get("properties", {}).items():
            assert prop.get("description"), f"{path}{name} has no description"
            ref = prop.get("$ref") or next(
                (a.get("$ref") for a in prop.get("anyOf", []) if "$ref" in a), None
            )
            if ref:
                walk(defs[ref.split("/")[-1]], defs, f"{path}{name}.")

    for model in (JobSpec, ClusterSpec):
        schema = model.model_json_schema()
        walk(schema, schema.get("$defs", {}))


@pytest.mark.parametrize(
    ("text", "argv", "hint"),
    [
        ("name: x\ntrain: {stepz: 3}\n", ["plan", "JOB", "--skip-parity"], "did you mean 'steps'"),
        ("name: x\nmodle: {}\n", ["JOB", "--dry-run"], "did you mean 'model'"),  # = run JOB
        ("name: x\nresources: {nodes: 3}\n", ["plan", "JOB", "--skip-parity"], "asks for 3 nodes"),
    ],
)
def test_bad_job_exits_2_with_one_paragraph(tmp_path, capsys, text, argv, hint):
    job = tmp_path / "j.yaml"
    job.write_text(text)
    assert main([str(job) if a == "JOB" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert hint in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_plan_of_the_multinode_example(capsys):
    cluster = str(ROOT / "examples/cluster-multinode.yaml")
    rc = main(["plan", str(ROOT / "jobs/bert_ddp.yaml"), "--cluster", cluster, "--skip-parity"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "world size 16" in out and "--node-rank 1" in out and "gpu01.example.internal:" in out


@pytest.mark.processes
@pytest.mark.parametrize("argv", [["--version"], ["-m", "launcher", "--version"]])
def test_entry_points(argv):
    cmd = ["launch", "--version"] if argv == ["--version"] else [sys.executable, *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.startswith("launch ")


@pytest.mark.parametrize(
    ("argv", "debug"),
    [
        (["--debug", "run", "j.yaml"], True),
        (["run", "j.yaml", "--debug"], True),
        (["--debug", "j.yaml"], True),
        (["j.yaml", "--debug"], True),
        (["--debug", "status", "--json"], True),
        (["run", "j.yaml"], False),
        (["j.yaml"], False),
        (["status"], False),
    ],
)
def test_debug_before_or_after_the_command(argv, debug):
    assert _parse(argv).debug is debug
