"""Faults on real processes (CPU, gloo): a SIGKILLed worker, a hung rank, a crash resumed from
a checkpoint, SIGINT/SIGTERM in every phase of a launch. Each test checks the exit code, that
the failing rank and node are named, that logs, metrics so far and a summary are kept, and
that nothing the launch started is left running (tests/fixtures/launching.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from fixtures.launching import FIXTURES, Launcher, kill, wait_for, write_job

from launcher.metrics import read_records


def fault_job(tmp_path: Path) -> Path:
    """A job that runs until stopped."""
    script = {"script": str(FIXTURES / "fault_train.py"), "args": ["--steps", "100000"]}
    return write_job(tmp_path, script)


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def seconds_to_exit_4(run: Launcher, rank1_says: str, *, what: str) -> float:
    """From the moment rank 1's log says ``rank1_says`` until the launch exits 4, nothing of it
    left running."""
    log1 = run.run_dir / "logs/local/rank1.log"

    def said() -> bool:
        return log1.is_file() and rank1_says in log1.read_text()

    wait_for(said, timeout=180, what=what, proc=run.proc)
    start = time.monotonic()
    assert run.wait(timeout=120) == 4, run.output[-3000:]
    took = time.monotonic() - start
    run.assert_nothing_left()
    return took


def nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def test_sigkilled_worker_is_named_and_the_job_stops(tmp_path):
    run_dir = tmp_path / f"kill-{tmp_path.name}"
    job = fault_job(tmp_path)
    with Launcher(str(job), "--skip-parity", run_dir=run_dir, cwd=tmp_path) as run:
        run.wait_file("metrics/rank1.jsonl")
        victim = wait_for(lambda: run.workers().get(1), timeout=30, what="rank 1's worker process")
        killed_at = time.monotonic()
        os.kill(int(victim["PID"]), signal.SIGKILL)
        assert run.wait(timeout=90) == 4, run.output[-3000:]
        took = time.monotonic() - killed_at
        out = run.output
        run.assert_nothing_left()
    assert took < 30, f"a killed worker took {took:.0f} s to stop the job"
    assert "rank 1 on node local" in out and "SIGKILL" in out
    summary = summary_of(run_dir)
    assert summary["status"] == "failed"
    failure = summary["failure"]
    assert (failure["rank"], failure["node"], failure["signal"]) == (1, "local", "SIGKILL")
    assert failure["exit_code"] == -9
    assert all((run_dir / f"logs/local/rank{r}.log").is_file() for r in (0, 1))
    records = read_records(run_dir / "metrics/rank1.jsonl")
    assert records and records[-1]["type"] == "step"  # the metrics so far are kept
    assert summary["ranks"][1]["steps"] > 0


def test_crash_restarts_and_resumes_from_the_checkpoint(tmp_path):
    """max_restarts 1: rank 0 crashes after step 12 of 20; every worker restarts and resumes from
    the step-10 checkpoint; the run succeeds with 20 steps and one continuous loss curve."""
    ckpt = tmp_path / "ckpt"
    run_dir = tmp_path / f"resume-{tmp_path.name}"
    job = write_job(
        tmp_path,
        {"script": str(FIXTURES / "crash_once_train.py"), "args": ["--crash-at", "12"]},
        model={"arch": "bert", "size": "tiny"},
        data={"source": "synthetic", "seq_len": 32},
        train={
            "steps": 20,
            "warmup_steps": 2,
            "micro_batch": 4,
            "lr": 1.0e-3,
            "log_every": 5,
            "checkpoint": {"dir": str(ckpt), "every_steps": 10, "resume": "auto"},
        },
        cudnn={"benchmark": False},
        launch={"max_restarts": 1},
    )
    with Launcher(str(job), "--skip-parity", run_dir=run_dir, cwd=tmp_path) as run:
        assert run.wait(timeout=300) == 0, run.output[-4000:]
        out = run.output
        run.assert_nothing_left()
    assert "injected crash at step 12" in (run_dir / "logs/local/rank0.log").read_text()
    summary = summary_of(run_dir)
    assert summary["status"] == "succeeded" and summary["failure"] is None
    assert [r["steps"] for r in summary["ranks"]] == [20, 20]
    assert "restarting every worker (restart 1 of 1)" in out
    for rank in (0, 1):
        records = read_records(run_dir / f"metrics/rank{rank}.jsonl")
        metas = [r for r in records if r["type"] == "meta"]
        # two attempts, the second resumed
        assert [m["start_step"] for m in metas] == [0, 10], metas
        cut = records.index(metas[1])
        first = [(r["step"], r["loss"]) for r in records[:cut] if r["type"] == "step"]
        second = [(r["step"], r["loss"]) for r in records[cut:] if r["type"] == "step"]
        # Records come every log_every=5 steps and at the end of the 2 warm-up steps of each attempt.
        # the crash at 12 came before step 15's record; the second continues after step 10
        assert [s for s, _ in first] == [2, 5, 10], first
        assert [s for s, _ in second] == [12, 15, 20], second
        finals = [r for r in records if r["type"] == "final"]
        assert len(finals) == 1 and finals[0]["steps"] == 20
        # A continuous loss curve: the resumed attempt goes on from the checkpoint's weights and
        # optimizer state (deterministic on CPU); a fresh start would jump back up to the first loss.
        losses = [loss for _, loss in first + second]
        assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000010", "step_00000020"]


def test_a_rank_failing_on_every_attempt_exhausts_the_restarts(tmp_path):
    """max_restarts 2 and a rank that fails at step 5 each time: exit 4, all three attempts on record."""
    run_dir = tmp_path / f"exhaust-{tmp_path.name}"
    script = Path(__file__).resolve().parents[2] / "examples/custom_train.py"
    job = write_job(
        tmp_path,
        {"script": str(script), "args": ["--steps", "4000", "--fail-at", "5"]},
        launch={"max_restarts": 2, "stop_grace_s": 2},
    )
    with Launcher(str(job), "--skip-parity", run_dir=run_dir, cwd=tmp_path) as run:
        assert run.wait(timeout=300) == 4, run.output[-4000:]
        out = run.output
        run.assert_nothing_left()
    summary = summary_of(run_dir)
    assert summary["status"] == "failed" and summary["failure"]["rank"] == 1
    assert [r["attempt"] for r in summary["restarts"]] == [1, 2]
    assert all("rank 1 on node local" in r["reason"] for r in summary["restarts"])
    assert [a["attempt"] for a in summary["attempts"]] == [0, 1, 2]
    ports = [
        json.loads((run_dir / name).read_text())["master_port"]
        for name in ("plan.json", "plan.attempt1.json", "plan.attempt2.json")
    ]
    assert len(set(ports)) == 3
    assert out.count("restarting every worker") == 2


# -- SIGINT / SIGTERM in each phase ------------------------------------------------------------

PHASES = {
    # phase → (how to know the launcher is in it, what must not have happened yet); the
    # preflight runs beside Ray's start, so a signal in it lands before any worker starts
    "preflight": (lambda run: run.wait_file("job.yaml"), "Started 2 worker(s)"),
    "ray-start": (lambda run: run.wait_output("Starting an embedded Ray"), "Started 2 worker(s)"),
    "startup": (lambda run: run.wait_output("Started 2 worker(s)"), None),
    "training": (lambda run: run.wait_file("metrics/rank0.jsonl"), None),
}


def interrupt(run: Launcher, sig: signal.Signals, *, what: str) -> str:
    """Send ``sig``; the launcher exits 130 within 15 s in one clean paragraph, nothing left running."""
    sent = time.monotonic()
    run.proc.send_signal(sig)
    code = run.wait(timeout=60)
    took = time.monotonic() - sent
    out = run.output
    assert code == 130, out[-3000:]
    run.assert_nothing_left()
    assert took < 15, f"{what}: exit took {took:.0f} s"
    own = [line for line in out.splitlines() if not line.startswith("[")]  # not a worker's line
    # one clean paragraph: no traceback, no Ray "SIGTERM received" dump
    assert not any("Traceback" in line or "SIGTERM received" in line for line in own), out[-3000:]
    return out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("phase", list(PHASES))
def test_signal_in_each_phase_exits_130_and_stops_everything(tmp_path, phase, sig):
    run_dir = tmp_path / f"sig-{phase}-{sig.name}-{tmp_path.name}"
    job = fault_job(tmp_path)
    args = [str(job)] if phase == "preflight" else [str(job), "--skip-parity"]
    reached, not_yet = PHASES[phase]
    with Launcher(*args, run_dir=run_dir, cwd=tmp_path) as run:
        reached(run)
        if phase == "training":  # Ray runs its workers niced (15); training must not be
            niced = {r: nice(int(w["PID"])) for r, w in run.workers().items()}
            assert niced and not any(niced.values()), niced
        out = interrupt(run, sig, what=f"{sig.name} in {phase}")
    if not_yet:
        assert not_yet not in out, f"the signal came too late to test phase {phase}"
    summary = summary_of(run_dir)
    assert summary["status"] == "interrupted" and summary["failure"] is None
    assert (run_dir / "job.yaml").is_file()
    if phase == "training":
        assert summary["ranks"][0]["steps"] > 0
        assert all((run_dir / f"logs/local/rank{r}.log").is_file() for r in (0, 1))
        assert (run_dir / "logs/local/torchrun.log").stat().st_size > 0
        assert read_records(run_dir / "metrics/rank0.jsonl")


@pytest.mark.parametrize("phase", ["ray-start", "training"])
def test_sigterm_during_a_scaling_study_exits_130_and_keeps_what_was_measured(tmp_path, phase):
    study = tmp_path / f"study-{phase}-{tmp_path.name}"
    job = fault_job(tmp_path)
    args = ["scale", str(job), "--world", "1,2", "--skip-parity"]
    with Launcher(*args, run_dir=study, cwd=tmp_path, dir_flag="--out") as run:
        if phase == "ray-start":
            run.wait_output("Starting an embedded Ray")
        else:
            run.wait_file("w1-n1/r0/metrics/rank0.jsonl")
        out = interrupt(run, signal.SIGTERM, what=f"SIGTERM in the study's {phase}")
    assert "scaling study interrupted" in out
    assert (study / "scaling.json").is_file()  # the points measured so far (none yet)
    if phase == "training":
        assert summary_of(study / "w1-n1/r0")["status"] == "interrupted"


# -- a node lost mid-run (two simulated nodes, Ray bootstrapped over SSH) ---------------------


def test_lost_node_is_detected_and_named(netns_cluster, tmp_path):
    cluster = netns_cluster(2)
    lost = cluster.node_names[1]
    cluster_file = cluster.cluster_yaml(tmp_path / "cluster.yaml")
    # The nodes' /tmp is their own: the script reaches them in its workdir, through Ray.
    (tmp_path / "code").mkdir()
    shutil.copy(FIXTURES / "fault_train.py", tmp_path / "code/fault_train.py")
    job = write_job(
        tmp_path,
        {"script": "fault_train.py", "workdir": "code", "args": ["--steps", "100000"]},
        resources={"nproc_per_node": 1, "device": "cpu"},
        launch={"stop_grace_s": 2},
    )
    run_dir = tmp_path / f"lost-{tmp_path.name}"
    with Launcher(
        str(job), "--cluster", str(cluster_file), "--skip-parity", run_dir=run_dir, cwd=tmp_path
    ) as run:
        run.wait_file("metrics/rank1.jsonl", timeout=300)
        keep = cluster.sshd_pids(lost)  # its sshd stays, so the launcher's `ray stop` is quick
        victims = [pid for pid in cluster.pids(lost) if pid not in keep]
        assert victims, f"nothing runs on {lost}"
        lost_at = time.monotonic()
        kill(victims)  # the node's raylet, agent, torchrun and worker die at once
        assert run.wait(timeout=180) == 4, run.output[-4000:]
        took = time.monotonic() - lost_at
        out = run.output
        run.assert_nothing_left()
    assert took < 60, f"the lost node was noticed after {took:.0f} s"
    summary = summary_of(run_dir)
    assert summary["status"] == "failed"
    assert summary["failure"]["node"] == lost, summary["failure"]
    assert f"node {lost}" in out and "was lost" in out
    assert read_records(run_dir / "metrics/rank1.jsonl")  # what it reported before is kept
    assert not (left := cluster.left_running()), f"left on the nodes: {left}"


def test_a_hung_rank_is_caught_by_the_watchdog_and_named_from_every_ranks_stack(tmp_path):
    """Rank 1 blocks in its own function, rank 0 waits in the all-reduce: the watchdog stops the
    launch past launch.hang_timeout_s; the stacks dumped before the stop show both, and rank 1
    is blamed with its frames. Its log and the metrics so far are kept."""
    hang_timeout = 15
    run_dir = tmp_path / f"stuck-{tmp_path.name}"
    job = write_job(
        tmp_path,
        {"script": str(FIXTURES / "stuck_rank.py")},
        launch={"hang_timeout_s": hang_timeout, "stop_grace_s": 2},
    )
    with Launcher(str(job), "--skip-parity", run_dir=run_dir, cwd=tmp_path) as run:
        took = seconds_to_exit_4(run, "blocks in load_batch", what="rank 1 to block")
        out = run.output
    assert took < 60, f"the hang was reported {took:.0f} s after the stall"
    assert "rank 1 on node local made no progress" in out
    assert f"hang_timeout_s={hang_timeout}" in out
    summary = summary_of(run_dir)
    failure = summary["failure"]
    assert summary["status"] == "failed" and "blocks in load_batch" in failure["log_tail"]
    assert (failure["rank"], failure["node"]) == (1, "local"), failure["reason"]
    assert "all_reduce" in failure["reason"] and "load_batch (stuck_rank.py:" in failure["reason"]
    stack0 = (run_dir / "stacks/rank0.txt").read_text()
    stack1 = (run_dir / "stacks/rank1.txt").read_text()
    assert "in all_reduce" in stack0 and "stuck_rank.py" in stack0
    assert "in load_batch" in stack1 and "in all_reduce" not in stack1
    assert [read_records(run_dir / f"metrics/rank{r}.jsonl")[-1]["step"] for r in (0, 1)] == [0, 0]
