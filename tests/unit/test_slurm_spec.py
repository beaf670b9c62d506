"""Slurm clusters: the cluster file's slurm: section, host lists, what salloc is asked for."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from launcher.orchestrate.slurm import request_options
from launcher.remote import expand_nodelist
from launcher.spec.cluster import ClusterSpec
from launcher.spec.job import JobSpec


@pytest.mark.parametrize(
    ("nodelist", "names"),
    [
        ("n0", ["n0"]),
        ("n[0-2]", ["n0", "n1", "n2"]),
        ("gpu[08-10],login1", ["gpu08", "gpu09", "gpu10", "login1"]),
        ("r[1-2]n[3,5]", ["r1n3", "r1n5", "r2n3", "r2n5"]),
        ("a[1,3-4]-ib", ["a1-ib", "a3-ib", "a4-ib"]),
        ("", []),
    ],
)
def test_nodelists_expand_as_slurm_does(nodelist: str, names: list[str]) -> None:
    assert expand_nodelist(nodelist) == names


def test_slurm_alone_is_a_cluster_and_with_nodes_is_refused() -> None:
    assert ClusterSpec.model_validate({"slurm": {"partition": "main"}}).nodes == []
    assert ClusterSpec.model_validate({"slurm": {}}).slurm is not None
    with pytest.raises(ValidationError, match="slurm: and nodes: are given together"):
        ClusterSpec.model_validate({"slurm": {}, "nodes": [{"name": "a", "host": "h"}]})
    with pytest.raises(ValidationError, match="'~' and relative paths are not expanded"):
        ClusterSpec.model_validate({"slurm": {"python": "venv/bin/python"}})


def test_salloc_gets_the_jobs_nodes_and_the_specs_options() -> None:
    job = JobSpec.model_validate({"name": "q", "resources": {"nodes": 2}})
    slurm = {"partition": "gpu", "time": "1:00:00", "gpus_per_node": 8, "qos": "high"}
    spec = ClusterSpec.model_validate({"slurm": {**slurm, "sbatch_options": ["--exclusive"]}}).slurm
    assert spec is not None
    assert request_options(job, spec, 2) == [
        "--nodes=2",
        "--ntasks-per-node=1",
        "--job-name=launch-q",
        "--partition=gpu",
        "--time=1:00:00",
        "--qos=high",
        "--gpus-per-node=8",
        "--exclusive",
    ]
