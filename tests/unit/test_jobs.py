"""Detached jobs, the pure parts: the queue's decision, state lines, status rows, the spec and
command line of the job commands."""

from __future__ import annotations

import types

import pytest

from launcher.cli import _parser
from launcher.errors import SpecError
from launcher.jobs import state
from launcher.jobs.commands import STOP_WAIT_MIN_S, _stop_wait
from launcher.jobs.queue import Alive, JobBoard, Ticket, decide
from launcher.spec import load_cluster

CAPACITY = {"10.0.0.1": {"CPU": 2.0, "GPU": 8.0}, "10.0.0.2": {"CPU": 2.0, "GPU": 8.0}}
NAMES = {"10.0.0.1": "node0", "10.0.0.2": "node1"}


def ticket(
    job_id: str, gpus: float = 8, nodes=("10.0.0.1", "10.0.0.2"), resource: str = "GPU"
) -> Ticket:
    return Ticket(job_id, f"name-{job_id}", {n: {resource: gpus} for n in nodes}, NAMES)


def alive(*ids: str) -> list[Alive]:
    return [Alive(j, f"name-{j}", 1000 + i) for i, j in enumerate(ids)]


HELD = "waiting for 8 GPUs on node0, held by job a (name-a)"
BEHIND_B = "queued behind job b (name-b), submitted earlier and not started yet"
ARRIVED = [Alive("c", "name-c", 2000), Alive("b", "name-b", 1000)]  # c joined the queue first
BIG = Ticket("b", "big", {"10.0.0.1": {"CPU": 64.0}}, NAMES)  # more than the node has: all of it
ONE = {"a": Ticket("a", "one", {"10.0.0.1": {"CPU": 1.0}}, NAMES)}


@pytest.mark.parametrize(
    ("job", "order", "started", "reason"),
    [
        (ticket("a"), alive("a"), {}, None),  # the first job starts at once
        (ticket("b"), alive("a", "b"), {"a": ticket("a")}, HELD),
        (ticket("b", gpus=4), alive("a", "b"), {"a": ticket("a", gpus=4)}, None),  # side by side
        (ticket("b"), alive("b"), {"a": ticket("a")}, None),  # a's driver was SIGKILLed
        (ticket("b"), alive("a", "b", "c"), {"a": ticket("a", gpus=4)}, HELD),
        # a later small job does not overtake a waiting big one
        (ticket("c", gpus=1), alive("a", "b", "c"), {"a": ticket("a", gpus=4)}, BEHIND_B),
        # the order is submission time, not arrival
        (ticket("c", gpus=1), ARRIVED, {}, BEHIND_B),
        (ticket("b", gpus=1), ARRIVED, {}, None),
        (BIG, alive("b"), {}, None),
        (BIG, alive("a", "b"), ONE, "waiting for 2 CPU slots on node0, held by job a (one)"),
    ],
    ids=["first", "held", "share", "dead", "big", "small", "order", "earlier", "whole", "held-all"],
)
def test_a_job_waits_only_for_gpus_held_by_a_live_job(job, order, started, reason):
    assert decide(job, order, started, CAPACITY) == reason


def test_board_forgets_jobs_that_are_no_longer_alive():
    board = JobBoard()
    board.start(ticket("a"))
    board.start(ticket("b"))
    assert set(board.started(["a", "b"])) == {"a", "b"}
    assert set(board.started(["b"])) == {"b"}
    board.end("b")
    assert board.started(["b"]) == {}


def test_state_lines_round_trip_and_stay_out_of_the_logs():
    done = {"state": "done", "status": "succeeded", "tokens_per_s": 9.5}
    running = state.line({"state": "running", "step": 1})
    logs = "\n".join(["step 1", running, "step 2", state.line(done), "bye", ""])
    assert state.last_state(logs) == done
    assert state.strip(logs) == "step 1\nstep 2\nbye\n"
    assert state.last_state("no state here\n") is None


@pytest.mark.parametrize(
    ("ray_status", "last", "shown"),
    [
        ("PENDING", None, "PENDING"),
        ("RUNNING", None, "PENDING"),
        ("RUNNING", {"state": "starting"}, "PENDING"),
        ("RUNNING", {"state": "pending", "reason": "x"}, "PENDING"),
        ("RUNNING", {"state": "running"}, "RUNNING"),
        ("SUCCEEDED", {"state": "done"}, "SUCCEEDED"),
        ("STOPPED", {"state": "done", "status": "interrupted"}, "STOPPED"),
        ("FAILED", None, "FAILED"),
    ],
)
def test_status_of(ray_status, last, shown):
    assert state.status_of(ray_status, last) == shown


def details(status: str, message: str = ""):
    return types.SimpleNamespace(
        submission_id="job-1",
        status=types.SimpleNamespace(value=status),
        message=message,
        metadata={"name": "quickstart", "world_size": "2", "nodes": "1", "run_dir": "/runs/job-1"},
        start_time=1_700_000_000_000,
        end_time=None,
    )


def test_row_of_a_waiting_job_carries_the_reason():
    logs = state.line(
        {"state": "pending", "reason": "waiting for 2 CPU slots on local, held by job x (q)"}
    )
    row = state.row(details("RUNNING"), logs)
    assert row["status"] == "PENDING" and row["reason"].startswith("waiting for 2 CPU slots")
    assert set(state.to_json(row)) == set(state.JSON_KEYS)
    assert "PENDING — waiting for 2 CPU slots on local" in state.render_one(row)


def test_row_of_a_finished_job_has_the_summary_figures_and_failure():
    failure = {"rank": 1, "node": "local", "reason": "rank 1 exited with code 1"}
    done = {"state": "done", "status": "failed", "tokens_per_s": 1234.5, "mfu": 0.42}
    logs = state.line({**done, "failure": failure})
    row = state.row(details("FAILED"), logs)
    assert row["status"] == "FAILED" and row["failure"] == failure
    assert (row["tokens_per_s"], row["mfu"]) == (1234.5, 0.42)
    text = state.render_one(row)
    assert "1,234 tokens/s" in text and "MFU 42.0%" in text and "failure: rank 1 on local" in text
    assert "1 × 2" in state.render_table([row])


def test_a_restarted_job_shows_its_attempt():
    logs = state.line({"state": "running", "step": 30, "tokens_per_s": 10.0, "attempt": 1})
    row = state.row(details("RUNNING"), logs)
    assert row["attempt"] == 1 and "attempt 1 (after 1 restart(s))" in state.render_one(row)
    done = state.row(
        details("SUCCEEDED"),
        state.line({"state": "done", "status": "succeeded", "attempt": 1, "world_size": 1}),
    )
    # the last attempt's world, not the first's
    assert (done["attempt"], done["world_size"]) == (1, 1)
    first = state.row(details("RUNNING"), state.line({"state": "running"}))
    assert "attempt" not in state.render_one(first)


def test_a_killed_driver_is_failed_with_rays_reason():
    reason = "Job entrypoint command failed with exit code -9"
    message = f"{reason}, last available logs (truncated):\n..."
    row = state.row(details("FAILED", message), state.line({"state": "running", "step": 3}))
    assert row["status"] == "FAILED" and row["failure"] == {"reason": reason}


def test_jobs_address_needs_an_attached_cluster(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "nodes: [{name: local, host: localhost}]\nray: {jobs_address: 'http://head:8265'}\n"
    )
    with pytest.raises(SpecError, match="jobs_address is for a cluster the launcher attaches to"):
        load_cluster(path)
    path.write_text(
        "nodes: [{name: local, host: localhost}]\nray: {address: auto, jobs_address: 'ftp://x'}\n"
    )
    with pytest.raises(SpecError, match="must be http://host:port"):
        load_cluster(path)
    path.write_text(
        "nodes: [{name: local, host: localhost}]\n"
        "ray: {address: 'ray://head:10001', jobs_address: 'https://head.example:8265'}\n"
    )
    assert load_cluster(path).ray.jobs_address == "https://head.example:8265"


def test_job_commands_parse():
    parser, _ = _parser()
    args = parser.parse_args(["run", "job.yaml", "--detach", "--json"])
    assert args.detach and args.json
    args = parser.parse_args(
        ["submit", "job.yaml", "--set", "train.steps=5", "--run-dir", "/r", "--json"]
    )
    assert args.set == ["train.steps=5"] and str(args.run_dir) == "/r"
    assert parser.parse_args(["status"]).job_id is None
    assert parser.parse_args(["logs", "j", "-f"]).follow
    assert parser.parse_args(["down", "--yes", "--cluster", "c.yaml"]).yes
    assert str(parser.parse_args(["fetch", "j", "--to", "d"]).to) == "d"


def test_down_and_stop_wait_as_long_as_ray_gives_each_job_to_tear_down():
    long = types.SimpleNamespace(runtime_env={"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "140"}})
    assert _stop_wait(long) == 140.0
    assert _stop_wait(types.SimpleNamespace(runtime_env=None)) == STOP_WAIT_MIN_S


def test_launch_logs_leaves_out_rays_own_lines():
    logs = (
        "2026-12-04 20:56:19,317\tINFO job_manager.py:581 -- Runtime env is setting up.\n"
        "Running entrypoint for job j-1: exec python -m launcher.jobs.driver submission.json\n"
        "2026-12-04 20:56:20,001\tINFO sdk.py:12 -- Uploading package\n"
        "[local/rank0] 2026-12-04 20:56:21,000 INFO mine.py:3 -- the user's own\n"
        "2026-12-04 20:56:22 a line of the user's\n"
    )
    assert state.strip(logs) == (
        "[local/rank0] 2026-12-04 20:56:21,000 INFO mine.py:3 -- the user's own\n"
        "2026-12-04 20:56:22 a line of the user's\n"
    )
