"""Parity policies, checks, table and verdict, from recorded probe documents."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from launcher.errors import EXIT_PREFLIGHT, PreflightError, SpecError
from launcher.preflight import parity_packages
from launcher.preflight.parity import (
    FAIL_MARK,
    LEGEND,
    WARN_MARK,
    error_record,
    evaluate,
    min_driver,
    nccl_ifname_matches,
    resolve_policies,
    version_key,
)
from launcher.spec import ClusterSpec, JobSpec
from launcher.spec.job import KERNEL_PACKAGES

FIXTURES = Path(__file__).parent.parent / "fixtures" / "probes"
ALL_FIXTURES = sorted(FIXTURES.glob("*.json"))


def load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def cluster_of(
    base: dict[str, Any], n: int = 3, **per_node: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """n copies of ``base`` named node0..; ``per_node`` maps a name to dotted-path edits."""
    probes = {}
    for i in range(n):
        name = f"node{i}"
        probe = copy.deepcopy(base)
        probe["node"], probe["hostname"] = name, name
        for path, value in per_node.get(name, {}).items():
            target = probe
            *parents, last = path.split(".")
            for part in parents:
                target = target[part]
            target[last] = value
        probes[name] = probe
    return probes


@pytest.fixture
def cpu() -> dict[str, Any]:
    return load("cpu-vm.json")


@pytest.fixture
def gpu() -> dict[str, Any]:
    return load("gpu-synthetic.json")


# -- policies on version strings ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "policy", "equal"),
    [
        ("2.13.0+cpu", "2.13.0+cpu", "exact", True),
        ("2.13.0+cpu", "2.13.0+cu128", "exact", False),
        ("3.11.7", "3.11.9", "minor", True),
        ("3.11.7", "3.12.0", "minor", False),
        ("550.54.15", "550.90.07", "major", True),
        ("550.54.15", "535.129.03", "major", False),
        ("2.13.0+cpu", "2.13.1+cu128", "minor", True),
    ],
)
def test_version_key(a: str, b: str, policy: str, equal: bool) -> None:
    assert (version_key(a, policy) == version_key(b, policy)) is equal


def test_identical_nodes_agree(cpu) -> None:
    report = evaluate(cluster_of(cpu))
    assert report.ok
    assert report.verdict == "parity OK: 3 nodes agree"
    assert FAIL_MARK not in report.table().replace(LEGEND, "")  # no cell marked
    assert report.gpus("node1") == 0


def test_exact_mismatch_marks_the_odd_cell_and_names_it(cpu) -> None:
    report = evaluate(cluster_of(cpu, node2={"packages.torch": "2.12.0"}))
    assert not report.ok
    assert report.verdict == "parity FAILED: node2 differs in torch (2.12.0 vs 2.13.0+cpu)"
    torch_line = next(line for line in report.table().splitlines() if line.startswith("torch "))
    assert f"2.12.0 {FAIL_MARK}" in torch_line
    assert torch_line.count(FAIL_MARK) == 1
    cells = next(f for f in report.to_json()["fields"] if f["field"] == "torch")["cells"]
    assert cells["node2"] == {"value": "2.12.0", "mark": "fail"}
    assert cells["node0"]["mark"] is None


def test_the_majority_is_the_reference_and_a_tie_goes_to_the_head(cpu) -> None:
    report = evaluate(cluster_of(cpu, node0={"packages.ray": "2.50.0"}))
    assert [p.node for p in report.failures] == ["node0"]
    assert "ray (2.50.0 vs 2.60.0)" in report.verdict
    tie = evaluate(cluster_of(cpu, 2, node1={"packages.ray": "2.50.0"}))
    assert [p.node for p in tie.failures] == ["node1"]


@pytest.mark.parametrize(
    ("probe", "edits", "ok", "said"),
    [  # node1 of three edited ("gpu1": node0 of one); ok or not, and what the verdict says
        ("cpu", {"python.version": "3.11.9"}, True, ""),  # python: minor
        ("cpu", {"python.version": "3.12.1"}, False, "node1 differs in python (3.12.1 vs 3.11.7)"),
        ("gpu", {"nvidia.driver": "570.172.08"}, True, ""),  # driver: major
        ("gpu", {"nvidia.driver": "575.51.03"}, False, "driver (575.51.03 vs 570.124.06)"),
        (  # the probe's ``_safe`` gives {"error": ...} where torch has no NCCL: no crash
            "gpu",
            {"deep.nccl": {"error": "AttributeError: no nccl"}},
            False,
            "node1 differs in nccl (error: AttributeError: no nccl vs 2.27.3)",
        ),
        (
            "cpu",
            {"launcher.hash": "0" * 64},
            False,
            "node1 differs in launcher code (000000000000 vs ",
        ),
        ("cpu", {"disk.home.free_gib": 3.0, "os.kernel": "5.15.0", "clock_skew_s": 1.5}, True, ""),
        ("cpu", {"clock_skew_s": -8.25}, True, "node1: clock is -8.2 s off the launcher's"),
        ("cpu", {"bytecode": {"site": "/s", "cached": False, "writable": True}}, True, ""),
        (
            "cpu",
            {"bytecode": {"site": "/s", "cached": False, "writable": False}},
            True,
            "node1: torch has no compiled bytecode and Python may not write it",
        ),
        # checks that are not comparisons
        (
            "gpu1",
            {"nvidia.driver": "470.82.01"},
            False,
            "driver 470.82.01 is below 525.60.13, the minimum for torch's CUDA 12.8",
        ),
        (
            "gpu1",
            {"deep.conv.speedup": 1.01},
            False,
            "cuDNN gives no speed-up (1.01x over native kernels)",
        ),
        ("gpu1", {"deep.loaded_libs.libcudnn": []}, False, "no libcudnn was loaded"),
        ("gpu1", {"deep.cudnn.available": False}, False, "cuDNN is not available"),
        ("cpu1", {}, True, ""),  # the cuDNN checks skip CPU nodes
        ("gpu1", {"deep.device_count": 4, "request.gpus_needed": 8}, False, "needs 8 GPUs, has 4"),
        ("cpu1", {"request.gpus_needed": 1}, False, "needs 1 GPU, has 0"),
        (
            "cpu1",
            {"deep": {"error": "timed out after 120 s during import torch"}},
            False,
            "deep probe failed: timed out after 120 s during import torch",
        ),
        ("gpu1", {"request.nccl_socket_ifname": "ib"}, True, ""),
        (
            "gpu1",
            {"request.nccl_socket_ifname": "enp"},
            False,
            "NCCL_SOCKET_IFNAME=enp names no interface here (has docker0, eth0, ib0, lo)",
        ),
    ],
)
def test_the_verdict_on_one_edited_node(probe, edits, ok, said, cpu, gpu) -> None:
    base = {"cpu": cpu, "gpu": gpu}[probe[:3]]
    probes = cluster_of(base, 1, node0=edits) if probe[3:] else cluster_of(base, node1=edits)
    report = evaluate(probes)
    assert report.ok is ok and said in report.verdict, report.verdict


def test_a_policy_or_a_shallow_check_decides_what_fails(cpu, gpu) -> None:
    skew = cluster_of(cpu, node2={"clock_skew_s": -8.25})
    assert evaluate(skew).ok and not evaluate(skew, policies={"clock_skew": "exact"}).ok
    bare = {"bytecode": {"site": "/s", "cached": False, "writable": False}}
    uncompiled = cluster_of(cpu, node1=bare)
    assert evaluate(uncompiled).ok and not evaluate(uncompiled, policies={"bytecode": "exact"}).ok
    slow = cluster_of(gpu, 1, node0={"deep.conv.speedup": 1.01})
    assert evaluate(slow, policies={"cudnn_speedup": "warn"}).ok
    assert evaluate(cluster_of(cpu, 1, node0={"deep": None}), deep=False).ok


def test_warn_policy_reports_but_passes_and_ignore_never_compares(cpu) -> None:
    probes = cluster_of(cpu, node1={"packages.torch": "2.12.0"})
    warned = evaluate(probes, policies={"torch": "warn"})
    assert warned.ok
    assert "warnings: node1 differs in torch (2.12.0 vs 2.13.0+cpu)" in warned.verdict
    assert f"2.12.0 {WARN_MARK}" in warned.table()
    ignored = evaluate(probes, policies={"torch": "ignore"})
    assert ignored.ok and not ignored.warnings
    assert f"2.12.0 {FAIL_MARK}" not in ignored.table()


def test_listed_packages_are_exact_and_missing_ones_show(cpu) -> None:
    probes = cluster_of(cpu)
    for i, version in enumerate(["1.0", "1.0", None]):
        probes[f"node{i}"]["packages"]["parity-fixture"] = version
    report = evaluate(probes, packages=["parity-fixture"])
    assert report.verdict == "parity FAILED: node2 differs in parity-fixture (not installed vs 1.0)"


def test_unknown_policy_key_is_a_spec_error_with_a_suggestion() -> None:
    with pytest.raises(SpecError, match="Did you mean 'torch'"):
        resolve_policies({"torhc": "warn"})
    policies = resolve_policies({"parity-fixture": "warn"}, ["parity-fixture"])
    assert policies["parity-fixture"] == "warn"


def test_a_kernel_package_policy_is_known_even_where_this_run_does_not_check_it() -> None:
    # the policy a user sets after a triton mismatch, then `launch check` without a job
    assert "triton" not in resolve_policies({"triton": "warn"})
    assert resolve_policies({"triton": "warn"}, ["triton"])["triton"] == "warn"
    with pytest.raises(SpecError, match="not a policy"):
        resolve_policies({"torchao": "loose"})
    fp8 = JobSpec.model_validate(
        {"name": "j", "resources": {"device": "cuda"}, "precision": {"dtype": "fp8"}}
    )
    # every package a run may check is listed
    assert set(fp8.kernel_packages) == set(KERNEL_PACKAGES)


# -- unreachable nodes ---------------------------------------------------------------------------


def test_error_record_fills_its_column_and_others_are_still_judged(cpu) -> None:
    probes = cluster_of(cpu, node1={"packages.torch": "2.12.0"})
    probes["node3"] = error_record("node3", "10.0.0.9", "unreachable", "no route to 10.0.0.9:22")
    report = evaluate(probes)
    assert report.bad_nodes == ["node1", "node3"]
    assert report.verdict == (
        "parity FAILED: node1 differs in torch (2.12.0 vs 2.13.0+cpu); node3 unreachable: no route to 10.0.0.9:22"
    )
    status = report.table().splitlines()[2]
    assert status.startswith("status") and status.rstrip().endswith(
        f"{FAIL_MARK} unreachable: no route to"
    )
    assert report.gpus("node3") == 0
    assert report.to_json()["errors"]["node3"]["kind"] == "unreachable"


def test_raise_for_failure_names_every_bad_node(cpu) -> None:
    probes = cluster_of(cpu, node2={"packages.torch": "2.12.0"})
    probes["node3"] = error_record(
        "node3", "h", "authentication failed", "root@h:22 did not accept key k"
    )
    with pytest.raises(PreflightError) as info:
        evaluate(probes).raise_for_failure()
    assert info.value.exit_code == EXIT_PREFLIGHT == 3
    message = str(info.value)
    assert "on 2 of 4 nodes (node2, node3)" in message
    assert "torch (2.12.0 vs 2.13.0+cpu)" in message and "authentication failed" in message
    assert "\n" not in message
    evaluate(cluster_of(cpu)).raise_for_failure()


def test_the_hints_fit_the_failure(cpu) -> None:
    """A node short of GPUs is told how to ask for fewer, not to relax a policy or skip the
    check (neither gives it GPUs); a version mismatch may be relaxed or skipped."""
    with pytest.raises(PreflightError) as short:
        evaluate(cluster_of(cpu, 1, node0={"request.gpus_needed": 2})).raise_for_failure()
    assert "needs 2 GPUs, has 0. Lower resources.nproc_per_node" in str(short.value)
    assert "--set resources.device=cpu" in str(short.value)
    assert "--skip-parity" not in str(short.value) and "policy" not in str(short.value)
    with pytest.raises(PreflightError) as mismatch:
        evaluate(cluster_of(cpu, node2={"packages.torch": "2.12.0"})).raise_for_failure()
    assert ". Relax a field's policy" in str(mismatch.value)
    assert "--skip-parity" in str(mismatch.value)


def test_save_writes_probes_and_table(cpu, tmp_path) -> None:
    report = evaluate(cluster_of(cpu, 2))
    report.save(tmp_path / "preflight")
    assert json.loads((tmp_path / "preflight" / "node1.json").read_text())["node"] == "node1"
    table = (tmp_path / "preflight" / "parity.txt").read_text()
    assert table.rstrip().endswith("parity OK: 2 nodes agree")


# -- checks that are not comparisons ---------------------------------------------------------


def test_gpu_node_passes_its_checks(gpu) -> None:
    report = evaluate(cluster_of(gpu, 2))
    assert report.ok, report.verdict
    assert report.gpus("node0") == 8
    table = report.table()
    assert "NVIDIA H100 80GB HBM3" in table and "9.10.2" in table and "2.27.3" in table


@pytest.mark.parametrize(
    ("cuda", "minimum"),
    [
        ("11.8", "450.80.02"),
        ("11.0", "450.36.06"),
        ("12.1", "525.60.13"),
        ("12.8", "525.60.13"),
        ("13.0", "580.65.06"),
        (None, None),
        ("10.2", None),
    ],
)
def test_min_driver(cuda, minimum) -> None:
    assert min_driver(cuda) == minimum


@pytest.mark.parametrize(
    ("spec", "matches"),
    [
        ("eth", True),
        ("=eth", False),
        ("=eth0", True),
        ("ib0,eth0", True),
        ("^docker,lo", True),
        ("^eth,lo,docker", False),
        ("en", False),
    ],
)
def test_nccl_ifname_semantics(spec, matches) -> None:
    assert nccl_ifname_matches(spec, {"lo": [], "eth0": [], "docker0": []}) is matches


# -- every recorded fixture ----------------------------------------------------------------------


@pytest.mark.parametrize("path", ALL_FIXTURES, ids=[p.stem for p in ALL_FIXTURES])
def test_every_recorded_probe_renders_and_agrees_with_itself(path: Path) -> None:
    probe = json.loads(path.read_text())
    wanted = {"hostname", "python", "packages", "launcher", "nvidia", "interfaces", "deep", "time"}
    assert wanted <= set(probe), f"{path.name} lacks {wanted - set(probe)}"
    report = evaluate(cluster_of(probe, 2), deep=probe.get("deep") is not None)
    assert "parity FAILED" not in report.verdict or "deep probe failed" in report.verdict
    table = report.table()
    assert probe["packages"]["torch"] in table
    json.dumps(report.to_json())


def test_all_fixtures_side_by_side_differ_where_they_should() -> None:
    probes = {p.stem: json.loads(p.read_text()) for p in ALL_FIXTURES}
    report = evaluate(probes)
    if len(probes) > 1:
        assert not report.ok
    assert len(report.table().splitlines()[0].split()) == 2 + len(probes)


def test_kernel_packages_join_the_parity_check(gpu) -> None:
    """A GPU job whose attention may pick FlashAttention-4, whose kernels or weights may need
    Triton (and an fp8 one, torchao) has those packages compared on every node without
    cluster.yaml listing them; a CPU job does not."""
    cluster = ClusterSpec.model_validate(
        {"nodes": [{"name": "a", "host": "localhost"}], "parity": {"packages": ["numpy"]}}
    )
    base = {"name": "j", "model": {"arch": "gpt"}, "resources": {"device": "cuda"}}
    gpu_job = JobSpec.model_validate(base)
    assert parity_packages(cluster, gpu_job) == ["numpy", "flash-attn-4", "triton"]
    fp8 = JobSpec.model_validate(
        {**base, "precision": {"dtype": "fp8"}, "train": {"attention": "cudnn"}}
    )
    assert parity_packages(cluster, fp8) == ["numpy", "triton", "torchao"]
    train = {"attention": "cudnn", "kernels": "torch"}
    plain = JobSpec.model_validate({**base, "precision": {"weights": "fp32"}, "train": train})
    assert parity_packages(cluster, plain) == ["numpy"]
    cpu_job = JobSpec.model_validate({**base, "resources": {"device": "cpu"}})
    assert parity_packages(cluster, cpu_job) == ["numpy"]
    assert parity_packages(cluster, None) == ["numpy"]

    probes = cluster_of(gpu, n=2)
    probes["node0"]["packages"]["flash-attn-4"] = "4.0.0b36"
    probes["node1"]["packages"]["flash-attn-4"] = None
    report = evaluate(probes, packages=parity_packages(cluster, gpu_job))
    assert not report.ok and "flash-attn-4" in report.verdict
