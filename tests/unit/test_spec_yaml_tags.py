"""Tagged YAML values that PyYAML's safe constructors cannot read (``!!int 1e3``, ``!!bool
maybe``, ``!!timestamp today``) and nesting deeper than Python's recursion limit: in a job or
cluster file a SpecError naming the file (and the value's line), in a ``--set`` a UsageError
naming the override; exit 2 from the CLI with one paragraph and no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.cli import main
from launcher.errors import SpecError, UsageError
from launcher.spec import load_job

DEEP = "[" * 3000 + "]" * 3000

BAD_FILES = {
    "int": (
        "name: j\ntrain: {steps: !!int 1e3}\n",
        "line 2, column 16: '1e3' is not a valid !!int",
    ),
    "float": (
        "name: j\ntrain:\n  lr: !!float 3e-4x\n",
        "line 3, column 7: '3e-4x' is not a valid !!float",
    ),
    "bool": ("name: j\ntrain: {compile: !!bool maybe}\n", "'maybe' is not a valid !!bool"),
    "timestamp": (
        "name: !!timestamp today\n",
        "line 1, column 7: 'today' is not a valid !!timestamp",
    ),
    "deep": (f"name: j\ntrain: {DEEP}\n", "nested too deeply"),
}

BAD_SETS = {
    "float": ("train.lr=!!float 3e-4x", "'3e-4x' is not a valid !!float"),
    "timestamp": ("name=!!timestamp today", "'today' is not a valid !!timestamp"),
    "bool": ("train.compile=!!bool maybe", "'maybe' is not a valid !!bool"),
    "int": ("train.steps=!!int 1e3", "'1e3' is not a valid !!int"),
    "deep": (f"train.steps={DEEP}", "nested too deeply"),
}


def _write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_an_unreadable_tagged_value_in_a_job_file_is_a_spec_error(tmp_path, case):
    text, expected = BAD_FILES[case]
    path = _write(tmp_path, text)
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert err.value.exit_code == 2
    assert str(err.value).startswith(f"{path}: invalid YAML")
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("case", list(BAD_SETS))
def test_an_unreadable_tagged_set_value_is_a_usage_error(tmp_path, case):
    override, expected = BAD_SETS[case]
    with pytest.raises(UsageError) as err:
        load_job(_write(tmp_path, "name: j\n"), [override])
    assert err.value.exit_code == 2
    assert str(err.value).startswith("--set '")
    assert override[:40] in str(err.value)
    assert expected in str(err.value)
    assert "\n" not in str(err.value) and len(str(err.value)) < 400  # a deep value is shortened


def test_set_values_that_are_not_yaml_are_still_taken_as_text(tmp_path):
    job = load_job(_write(tmp_path, "name: j\n"), ["name=!!str renamed", "launch.env.A=x: y: z"])
    assert job.name == "renamed"
    assert job.launch.env["A"] == "x: y: z"


@pytest.mark.parametrize(
    "case", ["file int", "file bool", "file deep", "set float", "set timestamp", "set deep"]
)
def test_the_cli_exits_2_with_one_paragraph(tmp_path, capsys, case):
    kind, name = case.split()
    if kind == "file":
        argv = ["plan", str(_write(tmp_path, BAD_FILES[name][0]))]
        expected = BAD_FILES[name][1]
    else:
        argv = ["plan", str(_write(tmp_path, "name: j\n")), "--set", BAD_SETS[name][0]]
        expected = BAD_SETS[name][1]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert "Traceback" not in err
    assert err.startswith("error: ") and err.count("\n") == 1, err
