"""Metrics where users look, on real runs (CPU, gloo, embedded Ray): TensorBoard event files
read by TensorBoard's own reader, an MLflow run on a real tracking server this module starts
(and stops, also on failure), and a tracking server that is down."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import yaml
from fixtures.launching import QUICK, ROOT, Launcher, wait_for
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from launcher.results.mlflow_run import MlflowRun
from launcher.results.scalars import Point
from launcher.util import free_port

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``mlflow server`` on a SQLite store and a free port of 127.0.0.1; its URL."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    with open(root / "server.log", "wb") as out:
        argv = [sys.executable, "-m", "mlflow", "server"]
        argv += ["--backend-store-uri", f"sqlite:///{root}/mlflow.db"]
        argv += ["--default-artifact-root", str(root / "artifacts")]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: the server and its workers
        )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"{url}/health", timeout=5) as answer,
        ):
            return answer.status == 200
        return False

    try:
        wait_for(healthy, timeout=240, what="the MLflow server to answer", proc=proc)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def records(run_dir: Path, rank: int) -> list[dict]:
    lines = (run_dir / f"metrics/rank{rank}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == "step"]


def test_the_quick_start_writes_tensorboard_files_and_an_mlflow_run(tmp_path, mlflow_server):
    run_dir = tmp_path / f"quick-{tmp_path.name}"
    experiment = f"quick-{uuid.uuid4().hex[:8]}"
    settings = ["train.eval_every=4", "train.eval_steps=2", "report.tensorboard=true"]
    settings += [f"report.mlflow.tracking_uri={mlflow_server}"]
    settings += [f"report.mlflow.experiment={experiment}"]
    args = [a for setting in settings for a in ("--set", setting)]
    with Launcher(
        str(ROOT / "jobs/quickstart.yaml"), *QUICK, *args, run_dir=run_dir, cwd=tmp_path
    ) as run:
        assert run.wait(timeout=400) == 0, run.output[-3000:]
        out = run.output
    assert "MLflow" not in out, out[-3000:]  # no warning
    steps = [r["step"] for r in records(run_dir, 0)]
    assert steps == [2, 4, 6]

    board = run_dir / "tensorboard"
    for series in ("job", "rank0", "rank1"):
        assert [s for s, _ in scalars(board / series, "loss")] == steps, series
        rates = scalars(board / series, "tokens_per_s")
        assert [s for s, _ in rates] == steps and all(v > 0 for _, v in rates), series
    rank_loss = [scalars(board / f"rank{r}", "loss") for r in (0, 1)]
    assert rank_loss[0] == [
        (r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records(run_dir, 0)
    ]
    job_loss = scalars(board / "job", "loss")
    for i, (_, value) in enumerate(job_loss):
        assert value == pytest.approx((rank_loss[0][i][1] + rank_loss[1][i][1]) / 2, rel=1e-5)
    job_rate = dict(scalars(board / "job", "tokens_per_s"))
    rank_rates = [dict(scalars(board / f"rank{r}", "tokens_per_s")) for r in (0, 1)]
    assert job_rate[6] == pytest.approx(rank_rates[0][6] + rank_rates[1][6], rel=1e-5)
    acc = EventAccumulator(str(board / "job"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"step_time_ms", "peak_mem_gib", "data_wait_pct", "lr", "tflops", "grad_norm"} <= tags
    evals = [(r["step"], r["eval_loss"]) for r in records(run_dir, 0) if r.get("eval_loss")]
    assert [s for s, _ in evals] == [4, 6]  # every 4 steps and at the last
    assert [s for s, _ in scalars(board / "rank0", "eval_loss")] == [4, 6]

    client = MlflowClient(mlflow_server)
    found = client.get_experiment_by_name(experiment)
    assert found is not None
    (mlrun,) = client.search_runs([found.experiment_id])
    assert mlrun.info.status == "FINISHED"
    assert mlrun.info.run_name == run_dir.name
    assert mlrun.data.tags["launcher.run_dir"] == str(run_dir)
    params = mlrun.data.params
    assert params["train.steps"] == "6" and params["model.arch"] == "bert"
    assert params["resources.nproc_per_node"] == "2" and params["report.tensorboard"] == "true"
    history = client.get_metric_history(mlrun.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [
        (s, pytest.approx(v, rel=1e-5)) for s, v in job_loss
    ]
    rank1 = client.get_metric_history(mlrun.info.run_id, "rank1/tokens_per_s")
    assert sorted(m.step for m in rank1) == steps
    assert "tokens_per_s" in mlrun.data.metrics and "rank0/step_time_ms" in mlrun.data.metrics
    assert mlrun.data.metrics["eval_loss"] > 0 and mlrun.data.metrics["grad_norm"] > 0


SCRIPT = """
import time

import torch.distributed as dist

import launcher

dist.init_process_group("gloo")
rank = dist.get_rank()
for step in range(1, 5):
    time.sleep(0.2)
    launcher.report(step=step, tokens=1000, samples=10, loss=4.0 / step, accuracy=0.2 * step + rank)
dist.destroy_process_group()
"""


def test_a_tracking_server_that_is_down_is_a_warning_and_a_scripts_metrics_still_land(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    port = free_port()  # nothing listens there
    job = {
        "name": "down",
        "resources": {"nproc_per_node": 2, "device": "cpu"},
        "entrypoint": {"script": "train.py"},
        "report": {"tensorboard": True, "mlflow": {"tracking_uri": f"http://127.0.0.1:{port}"}},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    run_dir = tmp_path / f"down-{tmp_path.name}"
    started = time.monotonic()
    with Launcher(
        str(tmp_path / "job.yaml"), "--skip-parity", run_dir=run_dir, cwd=tmp_path
    ) as run:
        assert run.wait(timeout=300) == 0, run.output[-3000:]
        out = run.output
    took = time.monotonic() - started
    assert f"MLflow at http://127.0.0.1:{port} did not answer" in out, out[-3000:]
    assert out.count("did not answer") == 1
    assert "metric value(s) were not sent" in out
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "succeeded"
    board = run_dir / "tensorboard"
    assert [s for s, _ in scalars(board / "rank1", "accuracy")] == [1, 2, 3, 4]
    assert scalars(board / "rank1", "accuracy")[0][1] == pytest.approx(1.2)
    assert [v for _, v in scalars(board / "job", "loss")] == pytest.approx([4.0, 2.0, 4 / 3, 1.0])
    rates = scalars(board / "rank0", "tokens_per_s")
    assert [s for s, _ in rates] == [2, 3, 4] and all(0 < v <= 5000 for _, v in rates)
    assert took < 240, f"the launch took {took:.0f} s"


def test_a_sqlite_store_is_written_through_the_mlflow_package(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with mock.patch.dict(os.environ):  # mlflow adds its telemetry session id to the environment
        run = MlflowRun(uri, experiment="e", run_name="r", params={"train.steps": "3"}, tags={})
        run.write([Point("job", "loss", 1, 2.5, 100.0), Point("rank1", "loss", 1, 3.0, 100.0)])
        run.close("failed")
        assert run.run_id is not None
        found = MlflowClient(uri).get_run(run.run_id)
    assert found.info.status == "FAILED" and found.info.run_name == "r"
    assert found.data.params == {"train.steps": "3"}
    assert found.data.metrics == {"loss": 2.5, "rank1/loss": 3.0}
    assert found.data.tags["launcher.status"] == "failed"
