"""``status`` and ``list`` answer while another process (flock) holds a launcher Ray's jobs lock,
which is not its head's lock. Ray and SSH are stubbed."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import pytest
from fixtures.fake_launch import two_nodes
from fixtures.launching import ROOT

from launcher.jobs import api, commands, records
from launcher.jobs import head as heads
from launcher.spec import ClusterSpec

pytestmark = pytest.mark.processes  # starts processes: not in `just test-fast`
LOCAL = ClusterSpec.model_validate({"nodes": [{"name": "local", "host": "localhost"}]})
REMOTE = two_nodes()
PROMPTLY_S = 10.0

HOLDER = """
import json, sys
from launcher.jobs import records
from launcher.spec import ClusterSpec
cluster = ClusterSpec.model_validate(json.loads(sys.argv[2]))
lock = records.jobs_lock(cluster) if sys.argv[1] == "jobs" else (
    records.cluster_lock(cluster) if not cluster.all_local else records.locked(records.local_folder() / ".lock"))
with lock:
    print("held", flush=True)
    sys.stdin.read()  # until the test closes stdin
"""


@pytest.fixture(autouse=True)
def state(tmp_path, monkeypatch):
    monkeypatch.setenv(records.STATE_ENV, str(tmp_path / "state"))


@contextlib.contextmanager
def held_elsewhere(which: str, cluster: ClusterSpec) -> Iterator[None]:
    """Another process holds ``which`` lock ("jobs" or "head") of ``cluster``'s Ray."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, which, json.dumps(cluster.model_dump(mode="json"))],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "held", "the holder failed"
        yield
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def finishes(fn: Callable[[], Any], what: str) -> Any:
    """``fn()`` returns within PROMPTLY_S (in a thread: a flock wait cannot be interrupted)."""
    try:
        return futures.ThreadPoolExecutor(1).submit(fn).result(timeout=PROMPTLY_S)
    except futures.TimeoutError:
        raise AssertionError(f"{what} waited for the lock another process holds") from None


def takes(lock: Callable[[], contextlib.AbstractContextManager[None]], what: str) -> None:
    """``lock()`` is taken (and let go) within PROMPTLY_S."""

    def take() -> bool:
        with lock():
            return True

    assert finishes(take, what) is True


def bootstrapped(monkeypatch) -> None:
    """A bootstrapped cluster's record and a Jobs API (through a stubbed tunnel) with no jobs."""
    tunnel = contextlib.nullcontext(("http://127.0.0.1:1", "secret"))
    records.save_cluster(REMOTE)
    monkeypatch.setattr(api, "_tunnel", lambda cluster, *, token=False: tunnel)
    monkeypatch.setattr(
        api, "_client", lambda url, token: type("C", (), {"list_jobs": lambda self: []})()
    )
    monkeypatch.setattr(api, "_bootstrap", lambda cluster: pytest.fail("bootstrapped again"))


@pytest.mark.parametrize("cluster", [LOCAL, REMOTE], ids=["local", "bootstrapped"])
def test_status_and_list_answer_while_a_submission_holds_the_jobs_lock(
    cluster, monkeypatch, capsys
):
    if cluster is REMOTE:
        bootstrapped(monkeypatch)
    with held_elsewhere("jobs", cluster):
        if cluster is LOCAL:
            takes(lambda: records.locked(records.local_folder() / ".lock"), "the head's lock")
            assert finishes(lambda: heads.local_head(start=False), "finding the head") is None
        else:
            takes(lambda: records.cluster_lock(REMOTE), "taking the cluster's lock")
        assert finishes(lambda: commands.list_jobs(cluster, as_json=True), "launch list") == 0
        assert finishes(lambda: commands.status(cluster, None, as_json=True), "launch status") == 0
    assert capsys.readouterr().out == "[]\n[]\n"


@pytest.mark.parametrize("cluster", [LOCAL, REMOTE], ids=["local", "bootstrapped"])
def test_the_jobs_lock_is_not_the_heads_lock(cluster):
    """Either is free while another process holds the other (a file each); a submission waits
    for another's jobs lock."""
    with held_elsewhere("head", cluster):
        takes(lambda: records.jobs_lock(cluster), "taking the jobs lock")
    with held_elsewhere("jobs", cluster):
        entered = threading.Event()

        def submit() -> None:
            with records.jobs_lock(cluster):
                entered.set()

        threading.Thread(target=submit, daemon=True).start()
        assert not entered.wait(1.0), "two holders of one jobs lock at once"
    assert entered.wait(PROMPTLY_S)
