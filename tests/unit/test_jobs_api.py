"""The Jobs API failing after the launcher connected to it: one paragraph and exit 3, never a
traceback; the launcher's own errors and Ctrl-C pass through as they are."""

from __future__ import annotations

import types

import pytest
import requests

from launcher.errors import PreflightError, UsageError
from launcher.jobs import api, commands


class Failing:
    def __init__(self, error: BaseException):
        self.error = error

    def list_jobs(self):
        raise self.error

    def get_job_logs(self, job_id):
        raise self.error

    async def tail_job_logs(self, job_id):
        yield "step 1\n"
        raise self.error


@pytest.mark.parametrize("error", [
    requests.ConnectionError("Connection refused"),
    RuntimeError("Request failed with status code 500: Internal Server Error."),
])
def test_a_failing_call_is_a_preflight_error(error):
    client = api._Guarded(Failing(error), "http://127.0.0.1:8265")
    with pytest.raises(PreflightError, match=r"the Ray Jobs API at http://127.0.0.1:8265 failed \(list_jobs\)"):
        client.list_jobs()


def test_a_refused_token_is_a_preflight_error():
    from ray.exceptions import AuthenticationError

    client = api._Guarded(Failing(AuthenticationError("token refused")), "http://127.0.0.1:8265")
    with pytest.raises(PreflightError, match="token refused"):
        client.get_job_logs("x")


@pytest.mark.parametrize("error", [UsageError("no job 'x'"), KeyboardInterrupt()])
def test_our_errors_and_ctrl_c_pass_through(error):
    client = api._Guarded(Failing(error), "http://127.0.0.1:8265")
    with pytest.raises(type(error)):
        client.list_jobs()


def test_a_broken_log_stream_is_a_preflight_error(monkeypatch, capsys):
    import contextlib

    running = types.SimpleNamespace(submission_id="job-1", status=types.SimpleNamespace(value="RUNNING"))
    client = api._Guarded(Failing(RuntimeError("Websocket closed abnormally")), "http://127.0.0.1:8265")
    jobs = types.SimpleNamespace(client=client, url="http://127.0.0.1:8265", job=lambda job_id: running)

    @contextlib.contextmanager
    def connect_for(cluster, job_id):
        yield jobs

    monkeypatch.setattr(commands, "_connect_for", connect_for)
    with pytest.raises(PreflightError, match="following job job-1 stopped: .*Websocket closed abnormally"):
        commands.logs(None, "job-1", follow=True)
    assert "step 1" in capsys.readouterr().out
