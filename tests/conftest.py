"""Shared fixtures. ``netns_cluster``: simulated multi-node clusters (see tests/netns.py)."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from netns import NetnsCluster, missing_requirements  # noqa: E402
from netns import raise_system_exit as netns_sigterm_handler  # noqa: E402

ClusterFactory = Callable[..., NetnsCluster]


@functools.cache
def netns_unavailable() -> str | None:
    """Why simulated clusters cannot run here (tools, root, kernel permissions), else None."""
    reason = missing_requirements()
    if reason:
        return reason
    probe = f"lnchchk{os.getpid():x}"[:15]
    made = subprocess.run(
        ["ip", "link", "add", probe, "type", "bridge"], capture_output=True, text=True
    )
    if made.returncode != 0:
        return f"cannot create network devices here: {made.stderr.strip()}"
    subprocess.run(["ip", "link", "del", probe], capture_output=True)
    made = subprocess.run(
        ["unshare", "--mount", "--uts", "--net", "true"], capture_output=True, text=True
    )
    if made.returncode != 0:
        return f"cannot create namespaces here: {made.stderr.strip()}"
    return None


def _factory() -> Iterator[ClusterFactory]:
    reason = netns_unavailable()
    if reason:
        pytest.skip(f"simulated multi-node cluster unavailable: {reason}")
    clusters: list[NetnsCluster] = []

    def make(n_nodes: int = 3, **kwargs: object) -> NetnsCluster:
        cluster = NetnsCluster(n_nodes, **kwargs)  # type: ignore[arg-type]
        cluster.__enter__()
        clusters.append(cluster)
        return cluster

    try:
        yield make
    finally:
        with contextlib.ExitStack() as closing:  # every cluster is closed, also when one fails to
            for cluster in clusters:
                closing.callback(cluster.close)


@pytest.fixture
def netns_cluster() -> Iterator[ClusterFactory]:
    """``make(n_nodes=3) -> NetnsCluster``: started clusters, torn down after the test.

    Skips with the reason when not root or ``ip``/``sshd``/``unshare``/``nsenter`` are missing.
    """
    yield from _factory()


@pytest.fixture(scope="module")
def netns_cluster_module() -> Iterator[ClusterFactory]:
    """Like ``netns_cluster`` but shared by a test module (clusters live until its end)."""
    yield from _factory()


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A fresh folder under /var/tmp, which every simulated node sees (their /tmp is their own)."""
    path = Path("/var/tmp") / f"launcher-shared-{os.urandom(4).hex()}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def one_process_trainer_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The environment torchrun gives a world of one, and a metrics file under ``tmp_path``
    (returned), for tests that build ``launcher.train.loop.Trainer`` in this process."""
    from launcher.util import free_port

    metrics = tmp_path / "rank{rank}.jsonl"
    monkeypatch.setenv("LAUNCHER_METRICS_FILE", str(metrics))
    world = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    world.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for name, value in world.items():
        monkeypatch.setenv(name, value)
    return metrics


# -- tiers: a test that starts a process says so with a marker -----------------------------------

PROCESS_MARKERS = ("processes", "ray", "netns", "gpu")
NETNS_FIXTURES = {"netns_cluster", "netns_cluster_module"}  # a test that uses one is marked netns


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Integration tests start processes (marked so). Under ``pytest-xdist --dist loadfile`` a
    file's tests share a worker (their module fixtures: one head, one cluster); simulated
    clusters have names and subnets of their own, so two files' clusters may run side by side."""
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.processes)
        if NETNS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.netns)


@pytest.fixture(autouse=True)
def _no_process_unless_marked(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """In a run that leaves the process markers out (``just test-fast``), a test that starts a
    process fails: the marker is what keeps that tier free of them."""
    markexpr = request.config.getoption("markexpr") or ""
    if (
        "not" not in markexpr
        or "processes" not in markexpr
        or any(request.node.get_closest_marker(m) for m in PROCESS_MARKERS)
    ):
        yield
        return
    started: list[str] = []
    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    fork = os.fork

    def recording_execute_child(self: subprocess.Popen, args: object, *rest: object) -> None:
        started.append(str(args)[:200])
        execute_child(self, args, *rest)

    def recording_fork() -> int:
        started.append("os.fork()")
        return fork()

    monkeypatch.setattr(subprocess.Popen, "_execute_child", recording_execute_child)
    monkeypatch.setattr(os, "fork", recording_fork)
    yield
    if started:
        pytest.fail(
            f"started a process ({started[0]}) without a marker: mark the test "
            f"{' / '.join(PROCESS_MARKERS)} (pyproject.toml) or keep it to pure logic"
        )


# -- the checkout stays clean: no test (or Slurm job) writes output into it ----------------------

ROOT = Path(__file__).resolve().parents[1]
_UNTRACKED = pytest.StashKey[set[str] | None]()


def _untracked() -> set[str] | None:
    """Files in the checkout that git neither tracks nor ignores; None outside a git checkout."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "--others", "--exclude-standard", "-z"],
        capture_output=True,
        text=True,
    )
    return set(listed.stdout.split("\0")) - {""} if listed.returncode == 0 else None


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_UNTRACKED] = _untracked()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A run that left new files in the checkout fails, naming them (under xdist the controller
    checks, once every worker has ended)."""
    before = session.config.stash.get(_UNTRACKED, None)
    if before is None or hasattr(session.config, "workerinput"):
        return
    new = sorted((_untracked() or set()) - before)
    if new:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"tests wrote into the checkout ({ROOT}): {', '.join(new[:10])}; write into "
                f"tmp_path or the cluster's folder instead",
                red=True,
            )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# -- no global state left behind: environment, signal handlers, inductor's config ----------------

# SIGALRM is pytest-timeout's during each test
GUARDED_SIGNALS = [
    signal.Signals[f"SIG{name}"] for name in ("INT", "TERM", "HUP", "PIPE", "USR1", "USR2")
]


def _inductor_config() -> dict[str, object] | None:
    """Inductor's settings where a test has imported it (importing it here costs seconds)."""
    config = sys.modules.get("torch._inductor.config")
    return None if config is None else config.get_config_copy()  # type: ignore[attr-defined]


# What libraries set in os.environ once per process, and need there afterwards: not a test's doing.
SET_BY_LIBRARIES = {
    "RAY_CLIENT_MODE",  # importing ray (ray/_private/client_mode_hook.py)
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",  # inductor's first CPU compile (codecache.py)
    "TORCHINDUCTOR_CACHE_DIR",  # inductor's cache folder, once chosen (cache_dir_utils.py)
    "TRITON_CACHE_DIR",  # inductor's first GPU kernel (runtime/triton_heuristics.py)
    "TRITON_PTXAS_PATH",  # inductor's first GPU kernel build (runtime/compile_tasks.py)
    "KMP_DUPLICATE_LIB_OK",  # importing sklearn (transformers does); inductor's OpenMP builds
    "KMP_INIT_AT_FORK",  # importing sklearn
}


def _environment() -> dict[str, str]:
    """This process's environment but the variable pytest sets for each phase of a test and
    what libraries set."""
    return {
        k: v
        for k, v in os.environ.items()
        if k != "PYTEST_CURRENT_TEST" and k not in SET_BY_LIBRARIES
    }


@pytest.fixture(autouse=True)
def _no_global_state_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that changes this process's environment, signal handlers or inductor's config
    and leaves it so fails, naming what it changed; the state is put back for the next test.
    The netns helper's SIGTERM handler (teardown on SIGTERM) is meant to stay."""
    env = _environment()
    handlers = {s: signal.getsignal(s) for s in GUARDED_SIGNALS}
    inductor = _inductor_config()
    yield
    changed = []
    now = _environment()
    if now != env:
        keys = sorted(k for k in env.keys() | now.keys() if env.get(k) != now.get(k))
        changed.append(f"environment variables {', '.join(keys)}")
        for key in keys:
            if key in env:
                os.environ[key] = env[key]
            else:
                del os.environ[key]
    for s, handler in handlers.items():
        current = signal.getsignal(s)
        if current is not handler and current is not netns_sigterm_handler:
            changed.append(f"the {signal.Signals(s).name} handler")
            signal.signal(s, handler)  # type: ignore[arg-type]
    after = _inductor_config()
    if inductor is not None and after is not None and after != inductor:
        keys = sorted(k for k in inductor if after.get(k) != inductor.get(k))
        changed.append(f"inductor's config ({', '.join(keys)})")
        import torch._inductor.config as config

        for key in keys:
            setattr(config, key, inductor[key])
    if changed:
        pytest.fail(f"{request.node.nodeid} left global state behind: {'; '.join(changed)}")
