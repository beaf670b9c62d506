"""User code: excludes, the workdir's plan (in place, shipped by Ray, shared), its snapshot, and
the shared-filesystem parity row. Pure logic on folders in tmp_path; nothing is started."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.fake_launch import two_nodes

from launcher.errors import SpecError
from launcher.orchestrate import code as code_mod
from launcher.orchestrate.code import plan_code, stage
from launcher.orchestrate.plan import plan, render
from launcher.preflight.parity import evaluate
from launcher.preflight.probe import exclude_matcher, user_code_info, walk_tree
from launcher.spec import ClusterSpec, load_job
from launcher.spec.job import DEFAULT_EXCLUDE

PROBE = Path(__file__).resolve().parents[2] / "launcher/preflight/probe.py"


def tree(root: Path, files: dict[str, str | bytes]) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


def job_in(folder: Path, **entrypoint: object):
    entry = {"script": "train.py", **entrypoint}
    cpu = {"resources": {"device": "cpu"}, "precision": {"dtype": "fp32"}}
    (folder / "job.yaml").write_text(json.dumps({"name": "u", "entrypoint": entry, **cpu}))
    return load_job(folder / "job.yaml")


# -- excludes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "path", "is_dir", "excluded"),
    [
        ("__pycache__", "a/b/__pycache__", True, True),  # a name matches at any depth
        ("*.pt", "ckpt/model.pt", False, True),
        ("*.pt", "model.pth", False, False),
        ("runs/", "runs", True, True),  # a trailing slash: folders only
        ("runs/", "runs", False, False),
        ("data/raw", "data/raw", True, True),  # a slash anchors at the workdir
        ("data/raw", "x/data/raw", True, False),
        ("/build", "build", True, True),
        ("/build", "src/build", True, False),
        ("**/cache", "a/b/cache", True, True),
        ("logs/**", "logs/a/b.txt", False, True),
        ("a?c.py", "abc.py", False, True),
        ("[ab]x", "cx", False, False),
        ("[!ab]x", "cx", False, True),
    ],
)
def test_exclude_patterns_follow_gitignore(pattern, path, is_dir, excluded):
    assert exclude_matcher([pattern])(path, is_dir) is excluded


def test_walk_skips_excluded_folders_and_files(tmp_path):
    tree(
        tmp_path,
        {
            "train.py": "x",
            "pkg/mod.py": "yy",
            ".git/HEAD": "ref",
            "pkg/__pycache__/m.pyc": "c",
            "runs/r1/summary.json": "{}",
            "model.pt": b"\0" * 10,
            "data/in.txt": "abc",
        },
    )
    assert walk_tree(tmp_path, list(DEFAULT_EXCLUDE)) == [
        ("data/in.txt", 3),
        ("pkg/mod.py", 2),
        ("train.py", 1),
    ]


# -- the plan of the workdir ------------------------------------------------------------------


def test_local_nodes_run_the_script_in_place(tmp_path):
    tree(tmp_path, {"train.py": "print(1)", "helper.py": "V = 1", "data/x.bin": b"\0" * 100})
    job = job_in(tmp_path)
    code = plan_code(job, ClusterSpec.this_machine().nodes)
    assert (code.mode, code.cwd()) == ("local", str(tmp_path))
    assert code.script == str(tmp_path / "train.py")
    job_bytes = len((tmp_path / "job.yaml").read_text())
    assert code.files == 4 and code.size_bytes == len("print(1)") + len("V = 1") + 100 + job_bytes


def test_remote_nodes_get_a_copy_and_a_relative_script(tmp_path):
    tree(tmp_path, {"src/train.py": "print(1)"})
    job = job_in(tmp_path, script="src/train.py")
    code = plan_code(job, two_nodes().nodes)
    assert (code.mode, code.travels, code.cwd(), code.script) == ("ray", True, None, "src/train.py")
    lp = plan(job, two_nodes(), None, run_id="r", master_port=29500, launcher_env={}, code=code)
    assert all(n.cwd is None and n.argv[-1] == "src/train.py" for n in lp.nodes)
    assert lp.to_json()["code"]["mode"] == "ray"
    text = render(lp)
    assert "copied to every node by Ray" in text and "the copy of" in text


def test_sync_true_copies_even_here_and_false_shares(tmp_path):
    tree(tmp_path, {"train.py": "print(1)"})
    here = ClusterSpec.this_machine().nodes
    assert plan_code(job_in(tmp_path, sync=True), here).mode == "ray"
    shared = plan_code(job_in(tmp_path, sync=False), two_nodes().nodes)
    assert shared.mode == "shared" and shared.cwd() == str(tmp_path)


def test_script_outside_a_travelling_workdir_is_refused(tmp_path):
    tree(tmp_path, {"code/keep.py": "", "train.py": "print(1)"})
    job = job_in(tmp_path, workdir="code", script="../train.py")
    with pytest.raises(SpecError, match="lies outside entrypoint.workdir"):
        plan_code(job, two_nodes().nodes)
    assert plan_code(job, ClusterSpec.this_machine().nodes).mode == "local"  # in place it is fine


def test_oversized_workdir_names_its_largest_folders(tmp_path, monkeypatch):
    monkeypatch.setattr(code_mod, "SYNC_LIMIT_BYTES", 1000)
    tree(
        tmp_path,
        {
            "train.py": "print(1)",
            "data/a.bin": b"\0" * 900,
            "data/b.bin": b"\0" * 300,
            "assets/c.bin": b"\0" * 200,
        },
    )
    job = job_in(tmp_path)
    with pytest.raises(SpecError) as err:
        plan_code(job, two_nodes().nodes)
    message = str(err.value)
    assert "entrypoint.workdir" in message and "data/ (0.0 MiB)" in message
    assert message.index("data/") < message.index("assets/") and "sync: false" in message
    assert plan_code(job_in(tmp_path, exclude=["data/"]), two_nodes().nodes).files == 3
    assert plan_code(job, ClusterSpec.this_machine().nodes).mode == "local"  # nothing travels here


def test_stage_copies_exactly_what_travels(tmp_path):
    src = tree(
        tmp_path / "src",
        {"train.py": "print(1)", "pkg/m.py": "x", ".git/HEAD": "h", "w.safetensors": "w"},
    )
    job = job_in(src, sync=True)
    code = plan_code(job, ClusterSpec.this_machine().nodes)
    snapshot = stage(code)
    try:
        copied = sorted(rel for rel, _ in walk_tree(snapshot, []))
        assert copied == ["job.yaml", "pkg/m.py", "train.py"]
    finally:
        shutil.rmtree(snapshot)


def test_the_code_hash_follows_code_files_only(tmp_path):
    tree(tmp_path, {"train.py": "print(1)", "data/x.txt": "a"})
    before = plan_code(job_in(tmp_path), two_nodes().nodes).code_hash
    (tmp_path / "data/x.txt").write_text("b")
    assert plan_code(job_in(tmp_path), two_nodes().nodes).code_hash == before
    (tmp_path / "train.py").write_text("print(2)")
    assert plan_code(job_in(tmp_path), two_nodes().nodes).code_hash != before


# -- the shared-filesystem check --------------------------------------------------------------


def probes(**code: dict) -> dict:
    """Each node's preflight report, with ``code`` as its ``user_code``."""
    same = {"launcher": {"hash": "h"}}
    return {n: dict(node=n, host=n, hostname=n, user_code=c, **same) for n, c in code.items()}


def test_a_node_whose_code_differs_is_marked(tmp_path):
    tree(tmp_path, {"train.py": "print(1)"})
    same = user_code_info(tmp_path, "train.py", list(DEFAULT_EXCLUDE))
    (tmp_path / "train.py").write_text("print(2)")
    other = user_code_info(tmp_path, "train.py", list(DEFAULT_EXCLUDE))
    report = evaluate(probes(a=same, b=same, c=other), deep=False)
    row = next(r for r in report.rows if r.field.key == "user_code")
    assert row.marks == {"c": "fail"} and not report.ok
    assert [p.node for p in report.failures] == ["c"]


def test_a_missing_workdir_or_script_fails_the_node(tmp_path):
    tree(tmp_path, {"other.py": ""})
    missing_dir = user_code_info(tmp_path / "nope", "train.py", [])
    missing_script = user_code_info(tmp_path, "train.py", [])
    report = evaluate(probes(a=missing_dir, b=missing_script), deep=False)
    messages = {p.node: p.message for p in report.failures if p.key == "user_code_present"}
    assert "does not exist here" in messages["a"] and "script train.py is missing" in messages["b"]


def run_probe(*args: str, cwd: Path, env: dict[str, str]) -> dict:
    """The report of the probe run as a node runs it: ``python ARGS`` with its source on stdin."""
    out = subprocess.run(
        [sys.executable, *args],
        input=PROBE.read_text(),
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.processes
def test_the_probe_reports_the_installed_launcher_not_a_folder_named_launcher(tmp_path):
    (tmp_path / "launcher").mkdir()  # like /tmp/launcher, the nodes' run folders
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    report = run_probe("-", "--workdir", str(tmp_path), cwd=tmp_path, env=env)
    assert report["launcher"]["path"] != str(tmp_path / "launcher")
    assert Path(report["launcher"]["path"], "__init__.py").is_file()
    assert report["user_code"]["exists"] and report["user_code"]["code_files"] == 0


@pytest.mark.processes
def test_the_probe_still_finds_a_launcher_named_on_pythonpath_in_the_current_folder(tmp_path):
    """A checkout on PYTHONPATH, run from that checkout, as on a machine without an install
    (``-S``: no site-packages, so no installed launcher to fall back on)."""
    root = Path(__file__).resolve().parents[2]
    report = run_probe("-S", "-", cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert report["launcher"]["path"] == str(root / "launcher")


@pytest.mark.processes
def test_the_probe_says_whether_torch_has_bytecode_or_may_write_it(tmp_path):
    """Without either, every process compiles torch's source again (seconds per start)."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"}
    site = str(tmp_path)

    def bytecode() -> dict:
        return run_probe("-S", "-", cwd=tmp_path, env=env)["bytecode"]

    assert bytecode() == {"site": site, "cached": False, "writable": False}
    del env["PYTHONDONTWRITEBYTECODE"]
    assert bytecode() == {"site": site, "cached": False, "writable": True}
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tmp_path / "torch")], check=True)
    assert bytecode()["cached"]
