"""Scaling studies: job adjustment per point, weak and strong efficiency, files and plot."""

from __future__ import annotations

import csv
import io
import json
import re
import sys
import types

import pytest
import yaml
from fixtures.fake_launch import Session

from launcher import cli
from launcher.errors import EXIT_INVALID_INPUT, JobFailed, SpecError, UsageError
from launcher.orchestrate import scale as scale_study
from launcher.orchestrate.records import Status
from launcher.results.scaling import (
    build_table,
    load_scaling,
    plot_scaling,
    render_scaling,
    scale_job,
    write_scaling,
)
from launcher.results.summary import report_command
from launcher.spec import ClusterSpec
from launcher.spec.job import JobSpec

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def job(micro_batch: int = 32, grad_accum: int = 1) -> JobSpec:
    train = {"steps": 50, "warmup_steps": 10, "micro_batch": micro_batch, "grad_accum": grad_accum}
    return JobSpec.model_validate({"name": "bert-ddp", "train": train})


def summary_with(tokens_per_s: float | None) -> dict:
    """A repeat as `launch scale` gets it: a summary dict (only totals matter here)."""
    status = "succeeded" if tokens_per_s else "failed"
    return {"job": "bert-ddp", "status": status, "totals": {"tokens_per_s": tokens_per_s}}


# -- scale_job -------------------------------------------------------------------------------


def test_weak_scaling_keeps_the_job():
    j = job(32, 2)
    assert scale_job(j, 8, 1, "weak") is j


@pytest.mark.parametrize(
    ("mb", "ga", "base", "world", "expect"),
    [
        (32, 1, 1, 1, (32, 1)),
        (32, 1, 1, 2, (16, 1)),
        (32, 1, 1, 8, (4, 1)),
        (32, 1, 2, 8, (8, 1)),
        (8, 4, 1, 4, (2, 4)),  # keep grad_accum, shrink micro_batch
        (8, 4, 1, 8, (1, 4)),
        (4, 4, 1, 2, (2, 4)),
        # 3 per rank: neither ga 4 nor mb 6 divides; largest micro-batch that does
        (6, 4, 1, 8, (3, 1)),
        (16, 1, 4, 2, (32, 1)),  # fewer ranks than the base: the micro-batch grows
        (6, 2, 2, 3, (4, 2)),
        # 12 per rank: ga 5 does not divide; micro_batch 4 kept with ga 3 does
        (4, 5, 3, 5, (4, 3)),
        # the micro-batch never grows when splitting: 14 per rank, ga 3 does not divide, mb 7 does
        (7, 3, 2, 3, (7, 2)),
        (5, 3, 2, 3, (5, 2)),  # 10 per rank: mb 5 does
        (4, 3, 3, 2, (6, 3)),  # 18 per rank: ga 3 divides
        (4, 4, 5, 8, (2, 5)),  # 10 per rank: 4 does not divide; the largest divisor <= 4 is 2
    ],
)
def test_strong_scaling_keeps_the_global_batch(mb, ga, base, world, expect):
    scaled = scale_job(job(mb, ga), world, base, "strong")
    assert (scaled.train.micro_batch, scaled.train.grad_accum) == expect
    assert scaled.train.micro_batch * scaled.train.grad_accum * world == mb * ga * base
    assert scaled.name == "bert-ddp" and scaled.train.steps == 50


@pytest.mark.parametrize(
    ("mb", "ga", "base", "world"), [(32, 1, 1, 3), (8, 1, 1, 16), (6, 1, 1, 4), (3, 3, 1, 2)]
)
def test_strong_scaling_indivisible_global_batch_is_a_spec_error(mb, ga, base, world):
    with pytest.raises(SpecError) as err:
        scale_job(job(mb, ga), world, base, "strong")
    msg = str(err.value)
    assert err.value.exit_code == 2
    assert "train.micro_batch" in msg
    assert f"{mb * ga * base} samples" in msg
    assert f"over {world} ranks" in msg
    assert "use world sizes that divide" in msg


def test_scale_job_and_build_table_reject_a_bad_mode_and_world():
    with pytest.raises(UsageError, match="weak or strong"):
        scale_job(job(), 2, 1, "diagonal")
    with pytest.raises(UsageError):
        build_table([], job="j", mode="both")
    with pytest.raises(UsageError, match=">= 1"):
        scale_job(job(), 0, 1, "strong")


# -- the table -------------------------------------------------------------------------------


def test_weak_efficiency_is_per_rank_throughput_over_the_base():
    summaries = [summary_with(28_000.0), summary_with(30_000.0), summary_with(29_000.0)]
    points = [
        {"nodes": 2, "ranks": 8, "global_batch": 256, "repeats": summaries},
        {"nodes": 1, "ranks": 1, "global_batch": 32, "repeats": [4_000.0, 4_200.0, 3_900.0]},
        {"nodes": 1, "ranks": 4, "global_batch": 128, "repeats": [15_000.0, 16_000.0]},
    ]
    t = build_table(points, job="bert-ddp", mode="weak")
    assert [p["ranks"] for p in t["points"]] == [1, 4, 8]
    assert t["base_ranks"] == 1
    base, four, eight = t["points"]
    assert base["tokens_per_s"] == 4_000.0 and base["tokens_per_s_min"] == 3_900.0
    assert base["speedup"] == pytest.approx(1.0) and base["efficiency"] == pytest.approx(1.0)
    assert four["tokens_per_s"] == pytest.approx(15_500.0)  # median of two
    assert four["tokens_per_s_per_rank"] == pytest.approx(15_500.0 / 4)
    assert four["efficiency"] == pytest.approx((15_500.0 / 4) / 4_000.0)
    assert eight["tokens_per_s"] == 29_000.0 and eight["tokens_per_s_min"] == 28_000.0
    assert eight["speedup"] == pytest.approx(29_000.0 / 4_000.0)
    assert eight["efficiency"] == pytest.approx(29_000.0 / 8 / 4_000.0)


def test_strong_efficiency_is_speedup_over_rank_ratio():
    points = [
        {"nodes": 1, "ranks": n, "global_batch": 64, "repeats": [v]}
        for n, v in [(2, 10_000.0), (4, 18_000.0), (8, 30_000.0)]
    ]
    t = build_table(points, job="j", mode="strong")
    assert t["base_ranks"] == 2
    for p in t["points"]:
        assert p["efficiency"] == pytest.approx(p["speedup"] / (p["ranks"] / 2))
    assert t["points"][2]["efficiency"] == pytest.approx(0.75)


def test_failed_repeats_and_points_are_kept_but_not_counted():
    points = [
        {"nodes": 1, "ranks": 1, "global_batch": 32, "repeats": [summary_with(None)]},  # all failed
        {
            "nodes": 1,
            "ranks": 2,
            "global_batch": 64,
            "repeats": [summary_with(7_000.0), summary_with(None)],
            "run_dirs": ["runs/x-2"],
        },
        {"nodes": 1, "ranks": 4, "global_batch": 128, "repeats": [12_000.0]},
    ]
    t = build_table(points, job="j", mode="weak")
    one, two, four = t["points"]
    assert one["tokens_per_s"] is None and one["speedup"] is None and one["failed_repeats"] == 1
    assert t["base_ranks"] == 2  # the smallest point that measured something
    assert two["failed_repeats"] == 1 and two["repeats"] == [7_000.0]
    assert two["run_dirs"] == ["runs/x-2"]
    assert four["efficiency"] == pytest.approx((12_000.0 / 4) / (7_000.0 / 2))
    text = render_scaling(t)
    assert "1/2" in text and "–" in text and "relative to N0 = 2 ranks" in text


def test_nothing_measured():
    point = {"nodes": 1, "ranks": 1, "global_batch": 8, "repeats": []}
    t = build_table([point], job="j", mode="weak")
    assert t["base_ranks"] is None
    assert "nothing to compare" in render_scaling(t)


# -- files -----------------------------------------------------------------------------------


def study(tmp_path, mode: str = "weak"):
    points = [
        {
            "nodes": max(1, n // 2),
            "ranks": n,
            "global_batch": 32 * n,
            "repeats": [v, v * 0.98],
            "run_dirs": [str(tmp_path / f"r{n}a"), str(tmp_path / f"r{n}b")],
        }
        for n, v in [(1, 4_000.0), (2, 7_800.0), (4, 15_000.0), (8, 28_000.0)]
    ]
    return build_table(points, job="bert-ddp", mode=mode)


def test_write_scaling_files_and_valid_png(tmp_path):
    t = study(tmp_path)
    text = write_scaling(tmp_path, t)
    assert "bert-ddp: weak scaling" in text
    png = (tmp_path / "scaling.png").read_bytes()
    assert len(png) > 0 and png.startswith(PNG_SIGNATURE)
    assert png[12:16] == b"IHDR"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width > 400 and height > 200
    data = json.loads((tmp_path / "scaling.json").read_text())
    assert data == json.loads(json.dumps(t))
    assert load_scaling(tmp_path) == data
    rows = list(csv.DictReader(io.StringIO((tmp_path / "scaling.csv").read_text())))
    assert [int(r["ranks"]) for r in rows] == [1, 2, 4, 8]
    assert {
        "nodes",
        "ranks",
        "global_batch",
        "tokens_per_s",
        "tokens_per_s_min",
        "tokens_per_s_per_rank",
        "speedup",
        "efficiency",
    } <= set(rows[0])
    assert float(rows[3]["efficiency"]) == pytest.approx(28_000.0 / 8 / 4_000.0)


def test_the_plot_names_noisy_points_in_its_legend(tmp_path, monkeypatch):
    import matplotlib.axes

    t = study(tmp_path)
    t["points"][1]["noisy"] = "rank 1: p95 step 3.1x its p50"
    named: list[str] = []
    legend = matplotlib.axes.Axes.legend

    def spy(self, *args, **kwargs):
        named.extend(self.get_legend_handles_labels()[1])
        return legend(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "legend", spy)
    plot_scaling(t, tmp_path / "scaling.png")
    assert "noisy: repeat (--repeat)" in named and "ideal (100%)" in named


@pytest.mark.parametrize(
    ("mode", "repeats"),
    [
        # metrics.report(step=...) without tokens: 0 tokens/s, so no base and no efficiency
        ("weak", [[summary_with(0.0)], [summary_with(0.0)]]),
        ("strong", [[None], [10.0]]),  # an unmeasured point
    ],
)
def test_plot_of_a_study_with_points_it_cannot_compare(tmp_path, mode, repeats):
    points = [
        {"nodes": 1, "ranks": r, "global_batch": 8 * r, "repeats": rep}
        for r, rep in zip((1, 2), repeats, strict=True)
    ]
    table = build_table(points, job="j", mode=mode)
    if mode == "weak":
        assert table["base_ranks"] is None and all(p["efficiency"] is None for p in table["points"])
    write_scaling(tmp_path, table)
    assert (tmp_path / "scaling.png").read_bytes().startswith(PNG_SIGNATURE)


def test_report_command_renders_a_study(tmp_path, capsys):
    write_scaling(tmp_path, study(tmp_path, "strong"))
    assert report_command(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "strong scaling" in out and "efficiency %" in out and "27,720" in out
    assert report_command(str(tmp_path), fmt="csv") == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 5
    assert report_command(str(tmp_path), fmt="json") == 0
    assert json.loads(capsys.readouterr().out)["mode"] == "strong"


def test_report_draws_the_plot_a_study_lacks(tmp_path, monkeypatch, caplog, capsys):
    write_scaling(tmp_path, study(tmp_path))
    (tmp_path / "scaling.png").unlink()
    installed = sys.modules.get("matplotlib")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the plot extra not installed
    assert report_command(str(tmp_path)) == 0
    assert not (tmp_path / "scaling.png").exists()
    assert "pip install -e '.[plot]'" in caplog.text and f"launch report {tmp_path}" in caplog.text
    if installed is None:  # installed now: report draws it
        monkeypatch.delitem(sys.modules, "matplotlib")
    else:
        monkeypatch.setitem(sys.modules, "matplotlib", installed)
    assert report_command(str(tmp_path)) == 0
    assert (tmp_path / "scaling.png").read_bytes().startswith(PNG_SIGNATURE)
    assert "weak scaling" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[1, 2]", "expected a JSON object; the study directory is damaged"),
        ("{not json", "not valid JSON"),
        ('{"points": 3}', "not a scaling table"),
    ],
)
def test_damaged_scaling_json(tmp_path, text, error):
    (tmp_path / "scaling.json").write_text(text)
    with pytest.raises(UsageError, match=error):
        report_command(str(tmp_path))


def test_a_point_the_launcher_cannot_start_is_a_failed_repeat_and_the_study_goes_on(
    tmp_path, monkeypatch
):
    """Pure bookkeeping: Ray, the preflight and the runs are replaced; the second point's run
    raises as Launch.execute does when Ray cannot place its agents."""

    class FakeLaunch:
        def __init__(self, *, job, run_dir, **_):
            self.world = job.resources.nproc_per_node

        def execute(self):
            if self.world == 2:
                raise JobFailed("Ray could not place one agent per node")
            return types.SimpleNamespace(
                status=Status.SUCCEEDED, failure=None, summary=summary_with(1000.0)
            )

    monkeypatch.setattr(scale_study, "Launch", FakeLaunch)
    monkeypatch.setattr(scale_study, "open_session", lambda *a, **k: Session())
    monkeypatch.setattr(scale_study, "preflight_facts", lambda *a, **k: None)
    monkeypatch.setattr(scale_study, "plan_code", lambda *a, **k: None)
    cluster = ClusterSpec.model_validate({"nodes": [{"name": "local", "host": "localhost"}]})
    quick = JobSpec.model_validate(
        {"name": "q", "resources": {"device": "cpu"}, "precision": {"dtype": "fp32"}}
    )
    with pytest.raises(JobFailed, match="1 run"):
        scale_study.scale(
            quick, cluster, world=[1, 2, 4], nodes=None, out_dir=tmp_path, mode="weak"
        )
    points = json.loads((tmp_path / "scaling.json").read_text())["points"]
    assert [p["ranks"] for p in points] == [1, 2, 4]
    assert [p["tokens_per_s"] is None for p in points] == [False, True, False]


@pytest.mark.parametrize(
    ("spec", "world", "mode", "refusal"),
    [
        (
            {"train": {"micro_batch": 4, "grad_accum": 1}},
            "1,2,3",
            "strong",
            "does not split over 3 ranks",
        ),
        # bf16 weights with FSDP run on one rank (nothing to shard) but not on two
        (
            {"precision": {"dtype": "bf16", "weights": "bf16"}, "parallel": {"strategy": "fsdp"}},
            "1,2",
            "weak",
            r"scaling point of 2 rank\(s\).*FSDP shards the weights",
        ),
    ],
)
def test_a_point_the_job_cannot_run_at_is_refused_before_any_point_runs(
    tmp_path, monkeypatch, capsys, spec, world, mode, refusal
):
    """A point the job refuses is refused up front (exit 2, one paragraph naming it), before
    preflight or Ray, through the study and through the command."""

    def must_not_run(*args, **kwargs):
        raise AssertionError("the study started before every point was checked")

    monkeypatch.setattr(scale_study, "preflight_facts", must_not_run)
    monkeypatch.setattr(scale_study, "open_session", must_not_run)
    monkeypatch.setattr(scale_study, "Launch", must_not_run)
    cluster = ClusterSpec.model_validate({"nodes": [{"name": "local", "host": "localhost"}]})
    quick = {"name": "q", "resources": {"device": "cpu"}, "precision": {"dtype": "fp32"}, **spec}
    points, out = [int(w) for w in world.split(",")], tmp_path / "study"
    with pytest.raises(SpecError, match=refusal) as err:
        scale_study.scale(
            JobSpec.model_validate(quick), cluster, world=points, nodes=None, out_dir=out, mode=mode
        )
    assert err.value.exit_code == EXIT_INVALID_INPUT
    assert "\n" not in str(err.value)
    assert not out.exists()

    # Through the command: exit 2 and the one paragraph, no traceback.
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(quick))
    (tmp_path / "cluster.yaml").write_text("nodes: [{name: local, host: localhost}]\n")
    argv = ["--cluster", str(tmp_path / "cluster.yaml"), "--world", world, "--mode", mode]
    rc = cli.main(["scale", str(tmp_path / "job.yaml"), *argv, "--out", str(out)])
    stderr = capsys.readouterr().err
    assert rc == EXIT_INVALID_INPUT
    assert re.search(refusal, stderr) and "Traceback" not in stderr
    assert not out.exists()


def test_a_point_whose_step_times_spread_or_whose_repeats_disagree_is_flagged(tmp_path):
    def run(tokens: float, p50: float, p95: float) -> dict:
        return {
            "totals": {"tokens_per_s": tokens},
            "ranks": [{"step_time_ms_p50": p50, "step_time_ms_p95": p95}],
        }

    table = build_table(
        [
            {"nodes": 1, "ranks": 1, "repeats": [run(100.0, 10.0, 90.0)]},
            {"nodes": 1, "ranks": 2, "repeats": [run(190.0, 10.0, 11.0), run(240.0, 10.0, 11.0)]},
            {"nodes": 1, "ranks": 4, "repeats": [run(400.0, 10.0, 11.0), run(404.0, 10.0, 11.0)]},
        ],
        job="j",
        mode="weak",
    )
    noisy = [p["noisy"] for p in table["points"]]
    assert noisy == ["p95 step time 9.0x p50", "repeats differ by 23%", None]
    text = render_scaling(table)
    assert "* noise, not scaling: 1 rank(s): p95 step time 9.0x p50" in text
    assert "--repeat 3" in text
    write_scaling(tmp_path, table)
    assert json.loads((tmp_path / "scaling.json").read_text())["points"][0]["noisy"]
