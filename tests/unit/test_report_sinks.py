"""The report sinks' logic: records into scalar series, the ``report:`` spec and its package
checks, the spec as MLflow parameters, an MLflow run whose store fails, event files."""

from __future__ import annotations

import base64
import importlib.util
import logging
import threading
from pathlib import Path

import pytest
import yaml

import launcher.orchestrate.sinks as sinks_module
from launcher import cli
from launcher.errors import SpecError
from launcher.orchestrate.rundir import RunDir
from launcher.orchestrate.sinks import ReportSinks, spec_params
from launcher.results.mlflow_run import MlflowRun, Refused, RestStore, Unreachable
from launcher.results.scalars import PENDING_STEPS, RESTART, Point, Scalars
from launcher.results.tensorboard_files import EventFiles
from launcher.spec import JobSpec, load_job


def by(points: list[Point]) -> dict[tuple[str, str], float]:
    return {(p.series, p.key): p.value for p in points}


def test_builtin_step_records_give_rates_mfu_and_every_numeric_field():
    s = Scalars()
    s.attempt(2)
    for rank in (0, 1):
        s.record(rank, {"type": "meta", "flops_per_token": 1e6, "peak_tflops": 10.0})
    step = {
        "type": "step",
        "step": 10,
        "time": 100.0,
        "tokens": 4000,
        "samples": 16,
        "interval_s": 2.0,
        "measured": True,
        "step_times_ms": [150.0, 250.0, 200.0],
        "data_wait_s": 0.5,
        "grad_norm": 1.5,
        "eval_loss": 3.25,
        "clock_limits": ["power cap"],
        "sm_clock_mhz": 1400,
    }
    first = by(s.record(0, {**step, "loss": 2.0, "peak_mem_gib": 3.0}))
    assert ("job", "loss") not in first, "the job's step waits for every rank"
    assert first[("rank0", "tokens_per_s")] == 2000.0
    assert first[("rank0", "samples_per_s")] == 8.0
    assert first[("rank0", "step_time_ms")] == 200.0  # the median of the interval's steps
    assert first[("rank0", "data_wait_pct")] == 25.0
    assert first[("rank0", "tflops")] == pytest.approx(2000.0 * 1e6 / 1e12)
    assert first[("rank0", "mfu")] == pytest.approx(2e-3 / 10.0)
    assert first[("rank0", "grad_norm")] == 1.5 and first[("rank0", "eval_loss")] == 3.25
    assert first[("rank0", "sm_clock_mhz")] == 1400.0
    keys = {k for _, k in first}
    assert not keys & {"step", "time", "tokens", "samples", "interval_s", "measured"}
    assert "clock_limits" not in keys and "step_times_ms" not in keys
    job = by(s.record(1, {**step, "loss": 4.0, "peak_mem_gib": 5.0, "time": 101.0}))
    assert job[("job", "loss")] == 3.0  # the mean of the ranks
    assert job[("job", "tokens_per_s")] == 4000.0  # the sum
    assert job[("job", "peak_mem_gib")] == 5.0  # the highest
    assert {p.time for p in s.record(1, {**step, "step": 11, "time": 99.0})} == {99.0}


def test_a_scripts_reports_are_timed_by_their_gaps_and_pass_their_own_fields():
    s = Scalars()
    s.attempt(1)
    first = by(s.record(0, {"type": "step", "step": 1, "time": 10.0, "tokens": 100, "loss": 5.0}))
    assert first == {("rank0", "loss"): 5.0, ("job", "loss"): 5.0}  # no rate before a gap
    rec = {"type": "step", "step": 3, "time": 12.0, "tokens": 100, "samples": 4, "loss": 4.0}
    second = by(s.record(0, {**rec, "accuracy": 0.5, "compute_s": 1.5, "done": True, "tag": "x"}))
    assert second[("rank0", "tokens_per_s")] == 50.0
    assert second[("rank0", "step_time_ms")] == 1000.0  # two steps in 2 s
    assert second[("rank0", "accuracy")] == 0.5 and second[("rank0", "compute_s")] == 1.5
    assert ("rank0", "done") not in second and ("rank0", "tag") not in second
    assert s.record(0, {"type": "final", "step": 3, "loss": 1.0}) == []
    assert s.record(0, {"type": "step", "step": "3", "loss": 1.0}) == []


def test_a_new_attempt_starts_the_rates_afresh_and_steps_may_go_back():
    s = Scalars()
    s.attempt(1)
    s.record(0, {"type": "step", "step": 20, "time": 10.0, "tokens": 100})
    s.attempt(1)
    again = by(s.record(0, {"type": "step", "step": 11, "time": 50.0, "tokens": 100}))
    assert ("rank0", "tokens_per_s") not in again  # not 100 tokens over 40 s of restart
    assert s.step == 11


def test_a_rank_that_never_reports_leaves_a_bounded_backlog():
    s = Scalars()
    s.attempt(2)
    for step in range(PENDING_STEPS * 3):
        assert not [
            p for p in s.record(0, {"type": "step", "step": step, "loss": 1.0}) if p.series == "job"
        ]
    assert len(s._pending) <= PENDING_STEPS + 1


def test_telemetry_samples_are_a_series_per_gpu_at_the_latest_step():
    s = Scalars()
    s.attempt(1)
    s.record(0, {"type": "step", "step": 7, "loss": 1.0})
    sample = {"time": 5.0, "gpu": 1, "sm_clock_mhz": 1980.0, "power_w": 650.5, "clock_limits": []}
    points = s.telemetry("n1", sample)
    assert {(p.series, p.key, p.step) for p in points} == {
        ("gpu/n1/1", "sm_clock_mhz", 7),
        ("gpu/n1/1", "power_w", 7),
    }


def write_job(tmp_path: Path, report: dict) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"name": "r", "report": report}))
    return path


def test_report_spec_defaults_off_and_refuses_a_typo(tmp_path):
    assert JobSpec(name="x").report.tensorboard is False
    assert JobSpec(name="x").report.mlflow is None
    with pytest.raises(SpecError, match="tensorboard"):
        load_job(write_job(tmp_path, {"tensorbord": True}))
    with pytest.raises(SpecError, match="tracking_uri"):
        load_job(write_job(tmp_path, {"mlflow": {"experiment": "e"}}))


def without(monkeypatch, *gone: str) -> None:
    """The spec loader's package check finds none of ``gone``."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in gone else real(name, *a)
    )


def test_a_missing_package_is_one_paragraph_naming_the_extra(tmp_path, monkeypatch):
    without(monkeypatch, "tensorboard", "mlflow")
    with pytest.raises(SpecError) as err:
        load_job(write_job(tmp_path, {"tensorboard": True}))
    assert "report.tensorboard" in str(err.value) and "'.[tensorboard]'" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(SpecError, match=r"'\.\[mlflow\]'.*tracking server"):
        load_job(write_job(tmp_path, {"mlflow": {"tracking_uri": "mlruns"}}))
    # A server is written to without the package.
    job = load_job(write_job(tmp_path, {"mlflow": {"tracking_uri": "http://h:5000/"}}))
    assert job.report.mlflow is not None and job.report.mlflow.server


@pytest.mark.parametrize(
    ("given", "wanted"),
    [
        ("mlruns", "{base}/mlruns"),
        ("file:mlruns", "{base}/mlruns"),
        ("/abs/mlruns", "/abs/mlruns"),
        ("file:///abs/mlruns", "file:///abs/mlruns"),
        ("sqlite:///mlflow.db", "sqlite:///{base}/mlflow.db"),
        ("sqlite:////abs/mlflow.db", "sqlite:////abs/mlflow.db"),
        ("postgresql://u@db/mlflow", "postgresql://u@db/mlflow"),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
    ],
)
def test_a_relative_mlflow_folder_is_taken_from_the_job_files_folder(tmp_path, given, wanted):
    job = load_job(write_job(tmp_path, {"mlflow": {"tracking_uri": given}}))
    assert job.report.mlflow is not None
    assert job.report.mlflow.tracking_uri == wanted.format(base=tmp_path.resolve())


def test_spec_params_are_flat_text_with_secrets_masked():
    launch = {"env": {"HF_TOKEN": "hf_secret", "MODE": "x"}}
    report = {"mlflow": {"tracking_uri": "https://me:pw123@mlflow.example.org"}}
    job = JobSpec.model_validate({"name": "p", "launch": launch, "report": report})
    params = spec_params(job)
    assert params["name"] == "p" and params["train.steps"] == str(job.train.steps)
    assert params["launch.env.MODE"] == "x" and params["launch.env.HF_TOKEN"] != "hf_secret"
    assert "pw123" not in params["report.mlflow.tracking_uri"]
    assert params["model.n_layers"] == "null"
    assert all(isinstance(v, str) for v in params.values())


class FakeStore:
    def __init__(self, *, down: bool = False, refuse_run: bool = False):
        self.down, self.refuse_run = down, refuse_run
        self.metrics: list[dict] = []
        self.params: list[tuple[str, str]] = []
        self.finished: list[str] = []
        self.calls = 0

    def _maybe_down(self):
        self.calls += 1
        if self.down:
            raise Unreachable("ConnectionRefusedError: [Errno 111] Connection refused")

    def experiment_id(self, name):
        self._maybe_down()
        return "1"

    def create_run(self, experiment_id, run_name, tags):
        self._maybe_down()
        if self.refuse_run:
            raise Refused("HTTP 403 from runs/create: forbidden")
        return "run1"

    def log_batch(self, run_id, metrics, params):
        self._maybe_down()
        self.metrics += metrics
        self.params += params

    def finish(self, run_id, status, tags):
        self._maybe_down()
        self.finished.append(status)


def points(n: int, series: str = "job") -> list[Point]:
    return [Point(series, "loss", i, 1.0 / (i + 1), 100.0 + i) for i in range(n)]


def test_mlflow_values_wait_while_the_store_is_down_and_are_sent_when_it_answers(caplog):
    store = FakeStore(down=True)
    run = MlflowRun(
        "http://h:1", experiment="e", run_name="r", params={"a": "1"}, tags={}, store=store
    )
    with caplog.at_level(logging.WARNING):
        run.write(points(3))
        run.write(points(2, "rank0"))
    assert len(caplog.records) == 1 and "did not answer" in caplog.text, "said once"
    assert store.calls == 1, "no second try within RETRY_S"
    store.down = False
    run.write([])
    assert store.metrics == []
    run.flush(now=True)
    assert [m["key"] for m in store.metrics] == ["loss"] * 3 + ["rank0/loss"] * 2
    assert store.params == [("a", "1")]
    assert store.metrics[0] == {"key": "loss", "value": 1.0, "timestamp": 100000, "step": 0}
    run.close("interrupted")
    assert store.finished == ["KILLED"]


def test_a_servers_credentials_go_in_a_header_not_the_url(monkeypatch):
    for name in ("TOKEN", "USERNAME", "PASSWORD"):
        monkeypatch.delenv(f"MLFLOW_TRACKING_{name}", raising=False)
    store = RestStore("https://me:p%40ss@[::1]:5000/mlflow/")
    assert store.base == "https://[::1]:5000/mlflow"
    assert store.headers["Authorization"] == "Basic " + base64.b64encode(b"me:p@ss").decode()


def test_mlflow_batches_keep_to_the_servers_limits():
    store = FakeStore()
    params = {f"p{i}": "v" * 900 for i in range(150)}
    run = MlflowRun("http://h:1", experiment="e", run_name="r", params=params, tags={}, store=store)
    sizes: list[tuple[int, int]] = []
    real = store.log_batch
    store.log_batch = lambda run_id, m, p: (sizes.append((len(m), len(p))), real(run_id, m, p))  # type: ignore[method-assign]
    run.write(points(2500))
    assert sizes == [(0, 100), (0, 50), (1000, 0), (1000, 0), (500, 0)]
    assert max(len(v) for _, v in store.params) == 500


def test_mlflow_values_not_sent_by_the_end_are_counted_in_a_warning(caplog):
    store = FakeStore(down=True)
    run = MlflowRun(
        "http://u:secret@h:1", experiment="e", run_name="r", params={}, tags={}, store=store
    )
    with caplog.at_level(logging.WARNING):
        run.write(points(4))
        run.close("succeeded")
    assert "4 metric value(s) were not sent" in caplog.text
    assert "secret" not in caplog.text


def test_a_refused_run_is_said_once_and_nothing_more_is_tried(caplog):
    store = FakeStore(refuse_run=True)
    run = MlflowRun("http://h:1", experiment="e", run_name="r", params={}, tags={}, store=store)
    with caplog.at_level(logging.WARNING):
        run.write(points(2))
        calls = store.calls
        run.write(points(2))
        run.close("failed")
    assert store.calls == calls and store.metrics == []
    assert caplog.text.count("refused the run") == 1


def scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    """What TensorBoard's own reader finds of ``tag`` in ``folder``: (step, value) pairs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.fixture
def board_job(tmp_path) -> tuple[JobSpec, RunDir]:
    """A job that writes TensorBoard files, and its run directory."""
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    return JobSpec.model_validate({"name": "t", "report": {"tensorboard": True}}), run_dir


def test_report_sinks_write_event_files_from_a_thread(board_job):
    job, run_dir = board_job
    sinks = ReportSinks(job, run_dir, flush_s=0.05)
    sinks.attempt(1)
    for step in (1, 2, 3):
        sinks.record(
            0, {"type": "step", "step": step, "time": 10.0 + step, "tokens": 64, "loss": 3.0 / step}
        )
    sinks.telemetry("local", [{"time": 12.0, "gpu": 0, "power_w": 300.0}])
    sinks.close("succeeded", timeout_s=30)
    board = run_dir.root / "tensorboard"
    assert scalars(board / "job", "loss") == [(1, 3.0), (2, 1.5), (3, 1.0)]
    assert [v for _, v in scalars(board / "job", "tokens_per_s")] == [64.0, 64.0]
    assert [v for _, v in scalars(board / "gpu/local/0", "power_w")] == [300.0]


def test_a_sink_that_cannot_open_is_a_warning_and_records_are_no_longer_kept(
    board_job, monkeypatch, caplog
):
    def broken(root):
        raise ModuleNotFoundError("No module named 'tensorboard'")

    monkeypatch.setattr(sinks_module, "EventFiles", broken)
    job, run_dir = board_job
    with caplog.at_level(logging.WARNING):
        sinks = ReportSinks(job, run_dir, flush_s=0.05)
        sinks._thread.join(10)
        sinks.record(0, {"type": "step", "step": 1, "loss": 1.0})
        sinks.close("succeeded", timeout_s=5)
    assert "TensorBoard: nothing is written there: No module named 'tensorboard'" in caplog.text
    assert not sinks._inbox and not (run_dir.root / "tensorboard").exists()


def test_records_beyond_the_backlog_are_left_out_with_one_warning(board_job, monkeypatch, caplog):
    monkeypatch.setattr(sinks_module, "BACKLOG", 3)
    go = threading.Event()
    real = sinks_module.EventFiles

    def held(root):  # the writer thread takes nothing until every record is given
        go.wait(30)
        return real(root)

    monkeypatch.setattr(sinks_module, "EventFiles", held)
    job, run_dir = board_job
    with caplog.at_level(logging.WARNING):
        sinks = ReportSinks(job, run_dir, flush_s=3600)
        sinks.attempt(1)
        for step in range(1, 7):
            sinks.record(0, {"type": "step", "step": step, "loss": 1.0})
        go.set()
        sinks.close("succeeded", timeout_s=30)
    assert [s for s, _ in scalars(run_dir.root / "tensorboard/rank0", "loss")] == [1, 2]
    assert caplog.text.count("fall behind") == 1


@pytest.mark.parametrize("command", ["plan", "run", "submit"])
def test_launch_plan_run_and_submit_refuse_a_missing_package_with_exit_2(
    tmp_path, monkeypatch, capsys, command
):
    without(monkeypatch, "tensorboard")
    job = write_job(tmp_path, {"tensorboard": True})
    run_dir = [] if command == "plan" else ["--run-dir", str(tmp_path / "run")]
    assert cli.main([command, str(job), *run_dir]) == 2
    err = capsys.readouterr().err
    assert "report.tensorboard" in err and "pip install -e '.[tensorboard]'" in err
    assert not (tmp_path / "run").exists()


def test_a_restart_replaces_the_steps_the_earlier_attempt_recorded_past_its_checkpoint(tmp_path):
    s = Scalars()
    s.attempt(1)
    points = s.record(0, {"type": "meta", "start_step": 0, "time": 1.0})
    assert points == [], "a first attempt marks nothing"
    for step, loss in ((5, 5.0), (10, 4.0), (15, 3.0)):
        points += s.record(0, {"type": "step", "step": step, "time": 1.0 + step, "loss": loss})
    s.attempt(1)  # the node was lost after step 15; the checkpoint is step 10's
    marks = s.record(0, {"type": "meta", "start_step": 10, "time": 30.0})
    assert {(p.series, p.key, p.step) for p in marks} == {
        ("rank0", RESTART, 11),
        ("job", RESTART, 11),
    }
    points += marks
    points += s.record(0, {"type": "step", "step": 15, "time": 40.0, "loss": 2.5})
    files = EventFiles(tmp_path)
    files.write(points)
    for series in ("rank0", "job"):
        assert scalars(tmp_path / series, "loss") == [(5, 5.0), (10, 4.0), (15, 2.5)]
    store = FakeStore()
    run = MlflowRun("http://h:1", experiment="e", run_name="r", params={}, tags={}, store=store)
    run.write(points)
    assert RESTART not in {m["key"] for m in store.metrics}
    assert [m["step"] for m in store.metrics if m["key"] == "loss"] == [5, 10, 15, 15]
