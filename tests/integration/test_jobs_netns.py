"""Detached jobs on two simulated nodes (network namespaces with their own sshd, /tmp, ~/.ray):
the launcher outside them submits, follows the logs and fetches the run directory through an
SSH tunnel to the head's 127.0.0.1 Jobs API, which refuses requests without the token."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from fixtures.launching import launch as run_launcher
from fixtures.launching import launcher_env, quick_job
from fixtures.user_code import project, rank_workdirs


def ended_succeeded(job_id: str, follow_output: str) -> bool:
    """``logs --follow`` saw the job end, or (a short job) found it ended already: either way
    it printed the whole log first."""
    ended = rf"job {job_id} (ended: SUCCEEDED|has ended \(SUCCEEDED\))"
    return re.search(ended, follow_output) is not None


def test_submit_follow_fetch_on_two_nodes(netns_cluster, tmp_path):
    cluster = netns_cluster(2)
    cluster_file = cluster.cluster_yaml(tmp_path / "cluster.yaml")
    job_file = quick_job(tmp_path)
    env = launcher_env(uuid.uuid4().hex, LAUNCHER_STATE_DIR=str(tmp_path / "state"))

    def launch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        cluster = ("--cluster", str(cluster_file))
        return run_launcher(*args, *cluster, cwd=tmp_path, env=env, timeout=timeout)

    head = cluster.node_names[0]
    try:
        # The run directory lies in the head's private /tmp: only the SSH fetch can bring it here.
        run_dir = f"/tmp/jobrun-{uuid.uuid4().hex[:8]}"
        submitted = launch("submit", str(job_file), "--run-dir", run_dir, "--json")
        assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
        job_id = json.loads(submitted.stdout.strip().splitlines()[-1])["job_id"]

        follow = launch("logs", job_id, "--follow")
        assert follow.returncode == 0, follow.stderr[-3000:]
        assert f"[{head}/rank0] step 6/6" in follow.stdout and "Per rank" in follow.stdout
        assert ended_succeeded(job_id, follow.stdout), follow.stdout[-3000:]
        state = json.loads(launch("status", job_id, "--json").stdout)
        assert state["status"] == "SUCCEEDED" and state["world_size"] == 2
        assert state["tokens_per_s"] > 0

        assert not Path(run_dir).exists()
        fetched = tmp_path / "fetched"
        result = launch("fetch", job_id, "--to", str(fetched))
        assert result.returncode == 0, result.stderr[-2000:]
        summary = json.loads((fetched / "summary.json").read_text())
        assert summary["status"] == "succeeded" and summary["nodes"] == 2
        hosts = {cluster.host(n) for n in cluster.node_names}
        assert {r["host"] for r in summary["ranks"]} == hosts
        for rank, node in enumerate(cluster.node_names):
            assert (fetched / f"logs/{node}/rank{rank}.log").stat().st_size > 0
            assert (fetched / f"preflight/{node}.json").is_file()  # the preflight made outside
        report = run_launcher("report", str(fetched), cwd=tmp_path, env=env, timeout=60)
        assert report.returncode == 0 and "Per node" in report.stdout

        # The Jobs API listens on the head's 127.0.0.1 only, and wants the token.
        code = (
            "from launcher.jobs.api import connect; from launcher.jobs.head import api_status\n"
            "from launcher.spec import load_cluster\n"
            f"with connect(load_cluster({str(cluster_file)!r})) as jobs:\n"
            "    print(api_status(jobs.url, None), api_status(jobs.url, '0' * 64))"
        )
        argv = [sys.executable, "-c", code]
        check = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        answers = check.stdout.split()
        assert answers[:1] == ["401"] and answers[1:] in (["401"], ["403"]), check.stderr
        bound = cluster.exec(head, "ss -ltnH 'sport = :8265'").stdout
        assert bound and all("127.0.0.1:8265" in line for line in bound.splitlines()), bound
        # the token never reached a command line or the launcher's output
        assert "RAY_AUTH_TOKEN=" not in submitted.stdout + submitted.stderr + follow.stdout

        a_failed_second_start_leaves_ray_running(launch, cluster, tmp_path, job_file, job_id)
        submit_a_script_whose_workdir_travels(launch, cluster, tmp_path)
        a_stopped_ray_is_said_not_to_answer(launch, cluster, job_id)
    finally:
        down = launch("down", "--yes")
    assert down.returncode == 0, down.stdout + down.stderr
    assert not list((tmp_path / "state/clusters").glob("*.json"))
    assert not (left := cluster.left_running()), f"left on the nodes: {left}"


def submit_a_script_whose_workdir_travels(launch, cluster, tmp_path: Path) -> None:
    """The user's script, in a folder under this machine's /tmp that the head cannot see: submit
    ships a snapshot with the submission (what its .gitignore lists too), and each rank runs in its
    node's copy of it."""
    job_file = project(tmp_path)
    workdir = job_file.parent
    (workdir / ".gitignore").write_text("data/\n")  # the job's excludes decide, not a .gitignore
    run_dir = f"/tmp/scriptrun-{uuid.uuid4().hex[:8]}"
    submitted = launch("submit", str(job_file), "--run-dir", run_dir, "--json")
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    job_id = json.loads(submitted.stdout.strip().splitlines()[-1])["job_id"]
    follow = launch("logs", job_id, "--follow")
    assert follow.returncode == 0 and ended_succeeded(job_id, follow.stdout), follow.stdout[-3000:]
    fetched = tmp_path / "fetched-script"
    assert launch("fetch", job_id, "--to", str(fetched)).returncode == 0
    assert str(workdir) not in rank_workdirs(fetched), follow.stdout[-3000:]  # a copy on the node
    assert json.loads((fetched / "plan.json").read_text())["code"]["mode"] == "ray"
    assert not (workdir / "out").exists()  # the outputs stay in the nodes' copies
    for node in cluster.node_names:
        assert cluster.exec(node, f"test -e {workdir} || echo no").stdout.strip() == "no"


def a_failed_second_start_leaves_ray_running(
    launch, cluster, tmp_path: Path, job_file: Path, job_id: str
) -> None:
    """A submit that cannot reach the head over SSH keeps the record and starts nothing; one that
    finds no token on the head starts Ray again, finds Ray's port taken and stops nothing: the
    Ray that runs there, and its jobs, go on."""
    head = cluster.node_names[0]
    record = next((tmp_path / "state/clusters").glob("*.json"))
    saved = record.read_text()
    unreachable = json.loads(saved)
    unreachable["ssh"]["key"] = str(cluster.extra_key())  # the head refuses this key
    record.write_text(json.dumps(unreachable))
    try:
        failed = launch("submit", str(job_file), "--json")
        assert failed.returncode == 3 and "does not answer" in failed.stderr, failed.stderr[-2000:]
        assert json.loads(record.read_text()) == unreachable  # kept
    finally:
        record.write_text(saved)
    cluster.exec(head, "mv /root/.ray/launcher_auth_token /root/.ray/kept-token", check=True)
    try:
        failed = launch("submit", str(job_file), "--json")
        said = failed.stderr[-2000:]
        assert failed.returncode == 3 and "is in use: a Ray runs there" in failed.stderr, said
    finally:
        cluster.exec(head, "mv /root/.ray/kept-token /root/.ray/launcher_auth_token", check=True)
    state = launch("status", job_id, "--json")
    assert state.returncode == 0, state.stderr[-2000:]
    assert json.loads(state.stdout)["status"] == "SUCCEEDED"


def a_stopped_ray_is_said_not_to_answer(launch, cluster, job_id: str) -> None:
    """Ray stopped on the head behind the launcher's back, its token file left: the commands say
    Ray does not answer (exit 3) instead of waiting forever; `launch down --yes` still works."""
    head = cluster.node_names[0]
    # Ray's processes on the head (`ray stop` would look beyond the node's namespaces)
    for pid in cluster.pids(head):
        with contextlib.suppress(OSError):
            if b"sshd" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
    for args in (("status", job_id), ("list",), ("down",)):
        result = launch(*args, timeout=90)
        assert result.returncode == 3, (args, result.stdout[-2000:], result.stderr[-2000:])
        assert "does not answer" in result.stderr and "Traceback" not in result.stderr, (
            result.stderr[-2000:]
        )
