"""Specs: shipped files validate; each bad-input corpus file fails with a one-paragraph SpecError
(exit 2) naming the file and holding its ``# expect:`` text; ``--set``; job-vs-cluster checks; env
values must be text; unreadable tagged values and deep nesting."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launcher.cli import main
from launcher.errors import SpecError, UsageError
from launcher.spec import ClusterSpec, JobSpec, NodeSpec, check_fits, load_cluster, load_job
from launcher.spec.yamlfile import apply_overrides

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BAD_JOBS = sorted((HERE / "bad_inputs" / "jobs").glob("*.yaml"))
BAD_CLUSTERS = sorted((HERE / "bad_inputs" / "clusters").glob("*.yaml"))
SHIPPED_GLOBS = ("jobs/*.yaml", "examples/**/*.yaml", "examples/**/*.yml", "cluster.yaml")
SHIPPED = sorted(path for pattern in SHIPPED_GLOBS for path in REPO.glob(pattern))


def is_cluster_file(path: Path) -> bool:
    data = yaml.safe_load(path.read_text())
    return isinstance(data, dict) and "nodes" in data and "name" not in data


def expectation(path: Path) -> str:
    first = path.read_bytes().split(b"\n", 1)[0].decode()  # the file itself may not be UTF-8
    assert first.startswith("# expect: "), (
        f"{path.name}: first line must be '# expect: <substring>'"
    )
    return first.removeprefix("# expect: ").strip()


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- shipped files ---------------------------------------------------------------------------


def test_shipped_files_exist():
    assert any(p.parent.name == "jobs" for p in SHIPPED)
    assert any(p.parent.name == "examples" for p in SHIPPED)


@pytest.mark.processes
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO)))
def test_shipped_file_validates(path, tmp_path):
    if (path.parent / "make_assets.py").is_file():
        # An example whose files its own script makes (nothing shipped, nothing downloaded):
        # make them in a copy, as a user following the example would.
        copy = tmp_path / path.parent.name
        shutil.copytree(path.parent, copy, ignore=shutil.ignore_patterns("assets", "__pycache__"))
        script = copy / "make_assets.py"
        subprocess.run([sys.executable, str(script)], check=True, capture_output=True, timeout=120)
        path = copy / path.name
    if is_cluster_file(path):
        cluster = load_cluster(path)
        assert cluster.nodes
    else:
        job = load_job(path)
        assert job.name
        assert job.backend in ("nccl", "gloo")


# -- the bad-input corpus --------------------------------------------------------------------


def test_corpus_is_large_enough():
    assert len(BAD_JOBS) + len(BAD_CLUSTERS) >= 45
    assert len(BAD_CLUSTERS) >= 15
    did_you_mean = [p for p in [*BAD_JOBS, *BAD_CLUSTERS] if "did you mean" in expectation(p)]
    assert len(did_you_mean) >= 8  # unknown keys suggest the intended key
    broken = [p for p in [*BAD_JOBS, *BAD_CLUSTERS] if p.stem.startswith("broken_yaml")]
    assert len(broken) >= 4
    assert all(expectation(p).startswith("line ") for p in broken)  # broken YAML: the line


@pytest.mark.parametrize(
    "path", [*BAD_JOBS, *BAD_CLUSTERS], ids=lambda p: f"{p.parent.name}/{p.stem}"
)
def test_bad_input_file(path):
    with pytest.raises(SpecError) as err:
        (load_cluster if path in BAD_CLUSTERS else load_job)(path)
    message = str(err.value)
    assert err.value.exit_code == 2
    assert str(path) in message, "the error names the file"
    assert "\n" not in message, "one paragraph"
    assert "Traceback" not in message
    expected = expectation(path)
    assert expected in message, f"expected {expected!r} in: {message}"


@pytest.mark.parametrize(
    ("load", "name", "said"),
    [
        (load_job, "nope.yaml", "file not found"),
        (load_cluster, "nope.yaml", "file not found"),
        (load_job, ".", "cannot read the file"),  # a directory
    ],
)
def test_a_file_that_cannot_be_read(tmp_path, load, name, said):
    with pytest.raises(SpecError, match=said) as err:
        load(tmp_path / name)
    assert err.value.exit_code == 2


def test_anchors_and_merge_keys_still_work(tmp_path):
    path = write(
        tmp_path,
        "name: j\nlaunch:\n  env: &common {A: '1', B: '2'}\n"
        "nccl:\n  env:\n    <<: *common\n    B: '3'\n",
    )
    job = load_job(path)
    assert job.launch.env == {"A": "1", "B": "2"}
    assert job.nccl.env == {"A": "1", "B": "3"}


def test_a_cluster_file_given_as_the_job_says_to_pass_it_as_cluster(tmp_path):
    with pytest.raises(SpecError) as err:
        load_job(REPO / "cluster.yaml")
    assert err.value.exit_code == 2
    assert "this is a cluster file" in str(err.value) and "--cluster" in str(err.value)
    assert "did you mean" not in str(err.value)
    with pytest.raises(SpecError, match="this is a job file, not a cluster file"):
        load_cluster(REPO / "jobs" / "quickstart.yaml")


# -- paths -----------------------------------------------------------------------------------


def test_relative_paths_are_taken_from_the_job_folder(tmp_path, monkeypatch):
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "train.py").write_text("print('hi')\n")
    for name in ("tokens.bin", "val.bin"):
        (jobs / name).write_bytes(b"\0" * 4096)
    monkeypatch.chdir(tmp_path)
    job = load_job(
        write(
            jobs,
            "name: j\nentrypoint: {script: train.py, args: [--fast]}\n"
            "data: {source: tokens, path: tokens.bin}\nresources: {device: cpu}\n"
            "train: {checkpoint: {dir: ckpt}}\n",
        )
    )
    assert job.entrypoint.script == (jobs / "train.py").resolve()
    assert job.train.checkpoint.dir == (jobs / "ckpt").resolve()
    assert job.entrypoint.args == ["--fast"]
    assert job.data.path == (jobs / "tokens.bin").resolve()
    assert not job.uses_builtin
    # held-out token files too, and they are checked
    text = "name: j\ndata: {source: tokens, path: tokens.bin, val_path: VAL, seq_len: 16}\n"
    text += "train: {eval_every: 10}\nresources: {device: cpu}\n"
    job = load_job(write(jobs, text.replace("VAL", "val.bin")))
    assert job.data.val_path == (jobs / "val.bin").resolve()
    missing = write(jobs, text.replace("VAL", "nope.bin"))
    with pytest.raises(SpecError, match=r"data.val_path 'nope.bin' does not exist") as err:
        load_job(missing)
    assert err.value.field == "data.val_path"


def _npy(header: bytes, data: bytes = b"\0" * 4096) -> bytes:
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + data


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        (
            "short.bin",
            b"\0" * 64,
            "holds 32 tokens, fewer than the 513 of one sample (data.seq_len 512)",
        ),
        (
            "short.npy",
            _npy(b"{'descr': '<i4', 'fortran_order': False, 'shape': (8,)}", b"\0" * 32),
            "holds 8 tokens, fewer than the 513 of one sample",
        ),
        (
            "floats.npy",
            _npy(b"{'descr': '<f4', 'fortran_order': False, 'shape': (1024,)}"),
            "holds dtype '<f4'; .npy token files must be uint8, uint16, uint32, int32 or int64",
        ),
        (
            "garbled.npy",
            _npy(b"{'descr': '<i4', 'fortran_"),
            "has a .npy header that cannot be read",
        ),
        ("list.npy", _npy(b"['<i4']"), "has a .npy header that cannot be read"),
        ("cut.npy", b"\x93NUMPY", "has a .npy header that cannot be read"),
        ("text.npy", b"1 2 3 4\n" * 200, "is not a .npy file (bad magic)"),
    ],
)
def test_token_file_problems_are_spec_errors(tmp_path, name, content, expected):
    """What the built-in trainer would refuse at start (a traceback on every worker, exit 4) is
    found when the job is loaded: exit 2, one paragraph naming data.path."""
    (tmp_path / name).write_bytes(content)
    path = write(tmp_path, f"name: j\ndata: {{source: tokens, path: {name}, seq_len: 512}}\n")
    with pytest.raises(SpecError) as err:
        load_job(path)
    message = str(err.value)
    assert err.value.exit_code == 2 and err.value.field == "data.path" and "\n" not in message
    assert expected in message, message
    (tmp_path / name).write_bytes(
        _npy(b"{'descr': '<u2', 'fortran_order': False, 'shape': (2048,)}")
    )
    assert load_job(path).data.path == (tmp_path / name)  # enough tokens of a token dtype


def test_user_script_job_needs_only_name_entrypoint_resources(tmp_path):
    (tmp_path / "train.py").write_text("")
    text = "name: mine\nentrypoint: {script: train.py}\n"
    job = load_job(
        write(tmp_path, text + "resources: {nodes: 1, nproc_per_node: 2, device: cpu}\n")
    )
    assert job.backend == "gloo" and job.resources.nproc_per_node == 2


def test_default_cluster_is_this_machine(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cluster = load_cluster()
    assert [n.name for n in cluster.nodes] == ["local"] and cluster.all_local


# -- --set overrides -------------------------------------------------------------------------


QUICK = (
    "name: q\nmodel: {arch: bert, size: tiny}\ndata: {seq_len: 64}\n"
    "train: {steps: 30, warmup_steps: 5, micro_batch: 8}\nprecision: {dtype: fp32}\n"
    "cudnn: {benchmark: false}\nresources: {nodes: all, nproc_per_node: 2, device: cpu}\n"
)


def test_set_typed_values(tmp_path):
    (tmp_path / "train.py").write_text("")
    job = load_job(
        write(tmp_path, QUICK.replace("name: q\n", "name: q\nentrypoint: {script: train.py}\n")),
        [
            "launch.env.OPTS=a=b",
            "entrypoint.args=[--x, '1']",
            "train.steps=50",
            "train.lr=3e-4",
            "train.compile=true",
            "launch.hang_timeout_s=null",
            "model.dropout=0.1",
            "name=renamed",
            "resources.nodes=1",
            "train.lr_schedule=linear",
        ],
    )
    assert job.train.steps == 50 and isinstance(job.train.steps, int)
    assert job.train.lr == pytest.approx(3e-4)
    assert job.train.compile is True
    assert job.launch.hang_timeout_s is None
    assert job.model.dropout == pytest.approx(0.1)
    assert job.name == "renamed"
    assert job.resources.nodes == 1
    assert job.train.lr_schedule == "linear"
    assert job.train.micro_batch == 8  # untouched keys keep the file's value
    assert job.launch.env["OPTS"] == "a=b"  # split at the first '='
    assert job.entrypoint.args == ["--x", "1"]


def test_set_does_not_mutate_the_input():
    data = {"name": "j", "train": {"steps": 10}}
    out = apply_overrides(data, ["train.steps=20", "launch.env.A=1"])
    assert data == {"name": "j", "train": {"steps": 10}}
    assert out["train"]["steps"] == 20 and out["launch"] == {"env": {"A": "1"}}  # env values: text


@pytest.mark.parametrize(
    ("item", "error", "said"),
    [
        ("train.stepz=5", SpecError, ["field 'train.stepz' (from --set)", "did you mean 'steps'"]),
        ("train.micro_batch=lots", SpecError, ["field 'train.micro_batch' (from --set)"]),
        ("precision.dtype=fp16", SpecError, ["fp16 on device cpu"]),  # breaks a cross-check
        *[
            (i, UsageError, ["KEY=VALUE"])
            for i in ["foo", "=3", "train..steps=1", ".x=1", "train.=1", ""]
        ],
    ],
)
def test_a_bad_or_malformed_set_is_refused_naming_it(tmp_path, item, error, said):
    with pytest.raises(error) as err:
        load_job(write(tmp_path, QUICK), [item])
    assert err.value.exit_code == 2 and all(s in str(err.value) for s in said), str(err.value)


# -- job vs cluster --------------------------------------------------------------------------


def two_nodes(gpus: int | str = "auto", gpus1: int | str | None = None) -> ClusterSpec:
    node0 = NodeSpec(name="node0", host="10.0.0.1", gpus=gpus)
    node1 = NodeSpec(name="node1", host="10.0.0.2", gpus=gpus if gpus1 is None else gpus1)
    return ClusterSpec(nodes=[node0, node1])


def test_job_asking_for_more_nodes_than_the_cluster_has(tmp_path):
    job = load_job(write(tmp_path, QUICK), ["resources.nodes=3"])
    with pytest.raises(SpecError) as err:
        check_fits(job, two_nodes(), job_source="jobs/q.yaml")
    msg = str(err.value)
    assert err.value.exit_code == 2
    assert msg.startswith("jobs/q.yaml, field 'resources.nodes'")
    assert "asks for 3 nodes but the cluster has 2 (node0, node1)" in msg
    assert "lower resources.nodes" in msg


def test_fitting_jobs_pass(tmp_path):
    check_fits(load_job(write(tmp_path, QUICK), ["resources.nodes=2"]), two_nodes(gpus=0))
    check_fits(load_job(write(tmp_path, "name: g\n")), two_nodes())  # gpus: auto, asked later


def test_a_cuda_job_needs_gpus_on_the_nodes_it_uses(tmp_path):
    cluster = two_nodes(8, 0)
    check_fits(load_job(write(tmp_path, "name: g\nresources: {nodes: 1}\n")), cluster)
    with pytest.raises(SpecError) as err:
        check_fits(load_job(write(tmp_path, "name: g\n")), cluster)
    assert err.value.exit_code == 2
    assert "node 'node1' declares gpus: 0" in str(err.value)
    assert "resources.device" in str(err.value)


def test_models_are_frozen():
    job = JobSpec(name="j")
    with pytest.raises(Exception, match="frozen"):
        job.name = "k"  # type: ignore[misc]


# -- env values are text --------------------------------------------------------------------


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
QUOTED_FLOW = ", ".join(f"{k}: '{v}'" for k, v in WRITTEN.items())


def test_quoted_env_values_are_their_text(tmp_path):
    job = load_job(
        write(tmp_path, f"name: j\nlaunch:\n  env: {{{QUOTED_FLOW}}}\nnccl:\n  env: {{X: INFO}}\n")
    )
    assert dict(job.launch.env) == WRITTEN
    assert job.nccl.env == {"X": "INFO"}


@pytest.mark.parametrize("value", ["true", "1.10", "0022", "7", "1:30", "2024-01-02"])
def test_an_env_value_yaml_reads_as_no_text_is_refused_saying_quote_it(tmp_path, value):
    pattern = r"field 'launch.env.A': YAML read this value as a \w+; quote it"
    with pytest.raises(SpecError, match=pattern):
        load_job(write(tmp_path, f"name: j\nlaunch:\n  env:\n    A: {value}\n"))


def test_a_cluster_node_env_value_must_be_text_too(tmp_path):
    path = write(
        tmp_path,
        "nodes:\n  - name: a\n    host: localhost\n    env: {V: '1.10', Q: x y}\n",
        "cluster.yaml",
    )
    assert load_cluster(path).nodes[0].env == {"V": "1.10", "Q": "x y"}
    path.write_text("nodes:\n  - name: a\n    host: localhost\n    env: {NCCL_IB_DISABLE: 1}\n")
    pattern = r"nodes\[0\].env.NCCL_IB_DISABLE': YAML read this value as a number; quote it"
    with pytest.raises(SpecError, match=pattern):
        load_cluster(path)


def test_values_outside_env_are_still_typed(tmp_path):
    text = "name: j\ntrain: {steps: 0x40, lr: 1.0e-3, compile: off}\nlaunch: {env: {A: '0x10'}}\n"
    job = load_job(write(tmp_path, text))
    assert job.train.steps == 64 and job.train.lr == 1e-3 and job.train.compile is False
    assert job.launch.env == {"A": "0x10"}


@pytest.mark.parametrize("null", ["~", "null", ""])
def test_a_null_env_value_is_refused_naming_the_field(tmp_path, null):
    with pytest.raises(SpecError, match=r"field 'launch.env.A': null is not an environment value"):
        load_job(write(tmp_path, f"name: j\nlaunch:\n  env:\n    A: {null}\n"))
    if null:  # --set launch.env.A= is the empty text
        pattern = r"field 'launch.env.A' \(from --set\): null is not an environment value"
        with pytest.raises(SpecError, match=pattern):
            load_job(write(tmp_path, "name: j\n"), [f"launch.env.A={null}"])


def test_set_env_values_are_the_text_given(tmp_path):
    overrides = [f"launch.env.{k}={v}" for k, v in WRITTEN.items()]
    overrides += [
        "launch.env.OPTS=--fast #not a comment",
        "launch.env.MAP=a: b",
        "launch.env.QUOTED='1.10'",
        "launch.env.EMPTY=",
        "nccl.env.NCCL_DEBUG=INFO",
    ]
    job = load_job(write(tmp_path, "name: j\n"), overrides)
    assert job.launch.env == {
        **WRITTEN,
        "OPTS": "--fast #not a comment",
        "MAP": "a: b",
        "QUOTED": "1.10",
        "EMPTY": "",
    }
    assert job.nccl.env == {"NCCL_DEBUG": "INFO"}


def test_set_of_a_whole_env_mapping_is_yaml_whose_values_must_be_text(tmp_path):
    job = load_job(write(tmp_path, "name: j\n"), ["launch.env={A: 'true', B: x}"])
    assert job.launch.env == {"A": "true", "B": "x"}
    pattern = r"launch.env.B': YAML read this value as a number; quote it"
    with pytest.raises(SpecError, match=pattern):
        load_job(write(tmp_path, "name: j\n"), ["launch.env={A: x, B: 1.10}"])


def test_the_refusal_of_a_secret_never_shows_its_value(tmp_path):
    with pytest.raises(SpecError) as err:
        load_job(write(tmp_path, "name: j\nlaunch:\n  env: {DB_PASSWORD: 123456789}\n"))
    assert "123456789" not in str(err.value)


# -- tagged YAML values and deep nesting ----------------------------------------------------


DEEP = "[" * 3000 + "]" * 3000

TAGGED = {  # case: (job file, where its error points, the same value as --set, what is said)
    "int": ("name: j\ntrain: {steps: !!int 1e3}\n", "line 2, column 16: ", "train.steps=!!int 1e3"),
    "float": (
        "name: j\ntrain:\n  lr: !!float 3e-4x\n",
        "line 3, column 7: ",
        "train.lr=!!float 3e-4x",
    ),
    "bool": ("name: j\ntrain: {compile: !!bool maybe}\n", "", "train.compile=!!bool maybe"),
    "timestamp": ("name: !!timestamp today\n", "line 1, column 7: ", "name=!!timestamp today"),
    "deep": (f"name: j\ntrain: {DEEP}\n", "", f"train.steps={DEEP}"),
}
SAID = {
    "int": "'1e3' is not a valid !!int",
    "float": "'3e-4x' is not a valid !!float",
    "bool": "'maybe' is not a valid !!bool",
    "timestamp": "'today' is not a valid !!timestamp",
    "deep": "nested too deeply",
}


@pytest.mark.parametrize("case", list(TAGGED))
def test_an_unreadable_tagged_value_is_refused_in_one_paragraph(tmp_path, capsys, case):
    """In a job file: a SpecError naming the line; in --set: a UsageError quoting the item."""
    text, where, override = TAGGED[case]
    expected = SAID[case]
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert err.value.exit_code == 2
    assert str(err.value).startswith(f"{path}: invalid YAML")
    assert where + expected in str(err.value)
    assert "\n" not in str(err.value)
    assert main(["plan", str(path)]) == 2  # the CLI: one paragraph, no traceback
    cli = capsys.readouterr().err
    assert cli.startswith("error: ") and cli.count("\n") == 1 and expected in cli, cli

    path = write(tmp_path, "name: j\n")
    with pytest.raises(UsageError) as err:
        load_job(path, [override])
    assert err.value.exit_code == 2
    assert str(err.value).startswith("--set '")
    assert override[:40] in str(err.value)
    assert expected in str(err.value)
    assert "\n" not in str(err.value) and len(str(err.value)) < 400  # a deep value is shortened
    assert main(["plan", str(path), "--set", override]) == 2
    cli = capsys.readouterr().err
    assert cli.startswith("error: ") and cli.count("\n") == 1 and expected in cli, cli


def test_set_values_that_are_not_yaml_are_still_taken_as_text(tmp_path):
    job = load_job(write(tmp_path, "name: j\n"), ["name=!!str renamed", "launch.env.A=x: y: z"])
    assert job.name == "renamed"
    assert job.launch.env["A"] == "x: y: z"
