"""The user's code on every node: a research-style script that uses relative paths runs as
under `cd workdir && torchrun`, here and on nodes that cannot see the launcher's files, and a
shared filesystem whose copies differ stops the launch.

``tests/fixtures/user_project`` execs a config file, imports a helper next to it, reads a data
file and writes into an output folder, all by relative paths.
"""

from __future__ import annotations

import json
import os

from fixtures.launching import launch, sets
from fixtures.user_code import project, rank_workdirs
from test_as_under_torchrun import FORWARDED, SHELL, seen_env


def test_script_runs_in_its_workdir_here(tmp_path):
    """Every node is this machine: no copy; relative reads and writes happen in the folder itself."""
    job_file = project(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_dir = tmp_path / "run"
    result = launch(
        str(job_file), *sets("resources.nproc_per_node=2"), "--run-dir", str(run_dir), cwd=elsewhere
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    workdir = job_file.parent
    assert rank_workdirs(run_dir) == {str(workdir)}
    assert sorted(p.name for p in (workdir / "out").iterdir()) == ["rank0.txt", "rank1.txt"]
    assert not list(elsewhere.iterdir())  # nothing written where the launcher was started
    code = json.loads((run_dir / "plan.json").read_text())["code"]
    assert code["mode"] == "local" and code["workdir"] == str(workdir)


def test_workdir_and_forwarded_variables_travel_to_nodes_that_cannot_see_them(
    netns_cluster, tmp_path
):
    """The project lies under the launcher's /tmp, which the nodes' private /tmp hides: Ray
    ships it, and each rank runs in its node's copy. The shell's variables that
    launch.env_forward names reach the ranks on both nodes; the others stay here."""
    cluster = netns_cluster(2)
    cluster_file = cluster.cluster_yaml(tmp_path / "cluster.yaml")
    job_file = project(tmp_path)
    workdir = job_file.parent
    (workdir / "checkpoints").mkdir()
    (workdir / "checkpoints/big.bin").write_bytes(b"x" * 1024)  # excluded by default: stays here
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_dir = tmp_path / "run"
    result = launch(
        *(str(job_file), "--cluster", str(cluster_file), "--run-dir", str(run_dir)),
        cwd=elsewhere,
        env={**os.environ, **SHELL},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank, node in enumerate(cluster.node_names):
        seen = seen_env(run_dir, node, rank)
        assert {name: seen.get(name) for name in FORWARDED} == FORWARDED, rank
        assert "MY_OWN_SETTING" not in seen  # not in launch.env_forward: this machine's alone

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["world_size"] == 2
    assert {r["host"] for r in summary["ranks"]} == {cluster.host(n) for n in cluster.node_names}
    # each rank ran in a copy: the original is invisible to the node
    assert str(workdir) not in rank_workdirs(run_dir)
    code = json.loads((run_dir / "plan.json").read_text())["code"]
    assert code["mode"] == "ray" and code["script"] == "train.py"
    # train, configurator, helper, job.yaml, data/input.txt; not checkpoints/
    assert code["files"] == 5
    assert not (workdir / "out").exists()  # outputs stay in the node's copy
    for node in cluster.node_names:  # the workdir never existed on the nodes
        assert cluster.exec(node, f"test -e {workdir} || echo absent").stdout == "absent\n"


def test_shared_workdir_is_hashed_on_every_node_and_must_exist_there(
    netns_cluster, tmp_path, shared_dir
):
    """sync: false: a node whose copy of a helper differs stops the launch (exit 3, its cell
    marked); so does a workdir under the launcher's /tmp, which the nodes do not have."""
    cluster = netns_cluster(2)
    cluster_file = cluster.cluster_yaml(tmp_path / "cluster.yaml")
    job_file = project(shared_dir, sync=False)
    helper = job_file.parent / "helper.py"
    stale = shared_dir / "helper-stale.py"
    stale.write_text('VALUE = "helper-v0"\n')
    odd = cluster.node_names[1]
    # Only that node sees the stale helper (its mount namespace is its own).
    cluster.exec(odd, f"mount --bind {stale} {helper}", check=True)

    check = ("check", "--job", str(job_file), "--fast", "--json")
    result = launch(*check, "--cluster", str(cluster_file), cwd=tmp_path)
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    row = next(f for f in json.loads(result.stdout)["fields"] if f["field"] == "user_code")
    marks = {n: c["mark"] for n, c in row["cells"].items()}
    assert marks == {cluster.node_names[0]: None, odd: "fail"}
    result = launch("plan", str(job_file), "--cluster", str(cluster_file), cwd=tmp_path)
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    assert odd in result.stderr and "user code" in result.stderr

    cluster.exec(odd, f"umount {helper}", check=True)
    result = launch("plan", str(job_file), "--cluster", str(cluster_file), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "the same path on every node" in result.stdout
    row = next(
        line for line in result.stdout.splitlines() if line.startswith("user code (workdir)")
    )
    assert "✗" not in row

    job_file = project(tmp_path, sync=False)
    result = launch("plan", str(job_file), "--cluster", str(cluster_file), cwd=tmp_path)
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    for node in cluster.node_names:
        assert node in result.stderr
    assert "does not exist here" in result.stdout + result.stderr
