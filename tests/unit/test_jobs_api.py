"""The Jobs API failing after the launcher connected to it: one paragraph and exit 3, never a
traceback; the launcher's own errors and Ctrl-C pass through as they are."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import types

import pytest
import requests
from ray.exceptions import AuthenticationError

from launcher.errors import PreflightError, UsageError
from launcher.jobs import api, commands


class Failing:
    def __init__(self, error: BaseException):
        self.error = error

    def list_jobs(self):
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        requests.ConnectionError("Connection refused"),
        RuntimeError("Request failed with status code 500: Internal Server Error."),
        AuthenticationError("token refused"),
    ],
)
def test_a_failing_call_is_a_preflight_error(error):
    client = api._Guarded(Failing(error), "http://127.0.0.1:8265")
    with pytest.raises(PreflightError) as err:
        client.list_jobs()
    said = f"the Ray Jobs API at http://127.0.0.1:8265 failed (list_jobs): {error}"
    assert str(err.value).startswith(said)


@pytest.mark.parametrize("error", [UsageError("no job 'x'"), KeyboardInterrupt()])
def test_our_errors_and_ctrl_c_pass_through(error):
    client = api._Guarded(Failing(error), "http://127.0.0.1:8265")
    with pytest.raises(type(error)):
        client.list_jobs()


class Breaking:
    """A Jobs API whose log stream starts at the log's beginning each time and breaks off
    (WebSocket 1006) after ``breaks[i]`` characters on the i-th stream."""

    def __init__(self, log: str, breaks: list[int]):
        self.log = log
        self.breaks = list(breaks)
        self.streams = 0

    def list_jobs(self):
        return []

    async def tail_job_logs(self, job_id):
        self.streams += 1
        end = self.breaks.pop(0) if self.breaks else None
        text = self.log if end is None else self.log[:end]
        for i in range(0, len(text), 5):  # chunks that split lines, as Ray's may
            yield text[i : i + 5]
        if end is not None:
            raise RuntimeError("WebSocket connection closed unexpectedly with close code 1006")


def _follow(monkeypatch, client):
    running = types.SimpleNamespace(
        submission_id="job-1", status=types.SimpleNamespace(value="RUNNING")
    )
    guarded = api._Guarded(client, "http://127.0.0.1:8265")

    def job(job_id):
        guarded.list_jobs()
        return running

    jobs = types.SimpleNamespace(client=guarded, url="http://127.0.0.1:8265", job=job)
    monkeypatch.setattr(
        commands, "_connect_for", lambda cluster, job_id: contextlib.nullcontext(jobs)
    )
    monkeypatch.setattr(commands, "_shown", lambda jobs, details: "SUCCEEDED")
    monkeypatch.setattr(commands, "RECONNECT_WAIT_S", 0.0)
    return commands.logs(None, "job-1", follow=True)


LOG = "".join(f"step {i}\n" for i in range(1, 9))


def test_a_broken_log_stream_is_followed_on_without_repeating_a_line(monkeypatch, capsys):
    client = Breaking(LOG, breaks=[10, 10, 33])  # mid-line; no progress once; then on
    assert _follow(monkeypatch, client) == 0
    assert capsys.readouterr().out == LOG + "job job-1 ended: SUCCEEDED\n"
    assert client.streams == 4


def test_a_stream_that_keeps_breaking_without_news_is_exit_3(monkeypatch, capsys):
    client = Breaking(LOG, breaks=[14] * 20)
    with pytest.raises(
        PreflightError, match=r"following job job-1 stopped: .*1006.*3 reconnections"
    ):
        _follow(monkeypatch, client)
    assert capsys.readouterr().out == "step 1\nstep 2\n"
    assert client.streams == 1 + commands.RECONNECTS


def test_a_stream_that_says_nothing_once_reopened_is_exit_3(monkeypatch, capsys):
    """A tunnel whose forwarding died accepts the new connection and says nothing: each
    reopened stream must resend what was printed within RESEND_S."""

    class Silent(Breaking):
        async def tail_job_logs(self, job_id):
            self.streams += 1
            if self.streams == 1:
                yield "step 1\n"
                raise RuntimeError("WebSocket connection closed unexpectedly with close code 1006")
            await asyncio.sleep(3600)
            yield ""

    monkeypatch.setattr(commands, "RESEND_S", 0.05)
    client = Silent(LOG, breaks=[])
    with pytest.raises(PreflightError, match="following job job-1 stopped: .*nothing came within"):
        _follow(monkeypatch, client)
    assert capsys.readouterr().out == "step 1\n"
    assert client.streams == 1 + commands.RECONNECTS


FOLLOWED = """
import contextlib, sys, types
from launcher import cli
from launcher.jobs import commands

LINES = 200_000
status = sys.argv[1]
details = types.SimpleNamespace(submission_id="job-1", status=types.SimpleNamespace(value=status))

class Client:
    async def tail_job_logs(self, job_id):
        for i in range(LINES):
            yield f"line {i}\\n"

jobs = types.SimpleNamespace(client=Client(), url="http://127.0.0.1:8265", job=lambda job_id: details,
                             logs=lambda d: "".join(f"line {i}\\n" for i in range(LINES)))

commands._connect_for = lambda cluster, job_id: contextlib.nullcontext(jobs)
commands._shown = lambda jobs, details: details.status.value
sys.exit(cli.main(["logs", "job-1", "--follow"]))
"""


@pytest.mark.processes
@pytest.mark.parametrize("status", ["RUNNING", "SUCCEEDED"])  # followed, or the whole log at once
def test_logs_into_a_pipe_closed_early_exit_quietly(status, tmp_path):
    """`launch logs ID --follow | head -n 1`: the closed pipe is no failure of the Jobs API (not
    exit 3), and Python says nothing of it at exit either."""
    script = tmp_path / "followed.py"
    script.write_text(FOLLOWED)
    launch = subprocess.Popen(
        [sys.executable, str(script), status],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    head = subprocess.Popen(["head", "-n", "1"], stdin=launch.stdout, stdout=subprocess.PIPE)
    launch.stdout.close()
    out, _ = head.communicate(timeout=60)
    err = launch.stderr.read().decode()
    assert launch.wait(timeout=60) == 0, err
    assert out == b"line 0\n" and err == ""


class LogAPI:
    """Ray's log API for one job's log (``requests.get`` of its last ``lines`` lines), counting
    the bytes it sends; ``get_job_logs`` (the whole log) counts too."""

    def __init__(self, log: str):
        self.log, self.sent = log, 0

    def get(self, url, *, params, headers, timeout):
        assert url == "http://127.0.0.1:8265/api/v0/logs/file"
        assert (params["submission_id"], params["node_id"]) == ("job-1", "n1")
        assert headers == {"Authorization": "Bearer t"}
        body = "".join(self.log.splitlines(keepends=True)[-int(params["lines"]) :]).encode()
        self.sent += len(body)
        return contextlib.nullcontext(types.SimpleNamespace(status_code=200, content=body))

    def get_job_logs(self, job_id):
        self.sent += len(self.log.encode())
        return self.log


def state_of(log: str, monkeypatch) -> tuple[dict, int]:
    served = LogAPI(log)
    monkeypatch.setattr(requests, "get", served.get)
    client = api._Guarded(served, "http://127.0.0.1:8265", {"Authorization": "Bearer t"})
    jobs = api.JobsCluster("local", None, client, "http://127.0.0.1:8265")
    running = types.SimpleNamespace(
        submission_id="job-1", status=types.SimpleNamespace(value="RUNNING"), driver_node_id="n1"
    )
    return api.job_state.last_state(jobs.state_log(running)), served.sent


def test_status_reads_the_end_of_a_50_mb_log_not_all_of_it(monkeypatch):
    noise = "rank 0 says something rather long about its step, padded to a line\n"
    state = api.job_state.line({"state": "running", "step": 7}) + "\n"
    big = noise * (50 * 2**20 // len(noise)) + state + noise * 100
    small = noise * api.STATE_TAIL_LINES + state + noise * 100  # 50 MB less
    big_state, big_sent = state_of(big, monkeypatch)
    small_state, small_sent = state_of(small, monkeypatch)
    assert big_state == small_state == {"state": "running", "step": 7}
    assert big_sent == small_sent  # the same tail, whatever came before it
    assert big_sent <= api.STATE_TAIL_LINES * len(noise) < len(big) / 300
    # No state line in the tail of a long log: the whole log is read for it.
    _, sent = state_of(state + noise * 3 * api.STATE_TAIL_LINES, monkeypatch)
    assert sent > 3 * api.STATE_TAIL_LINES * len(noise)
