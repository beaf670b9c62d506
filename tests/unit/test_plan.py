"""The launch plan is pure: assert on it directly (torchx style), start nothing."""

from __future__ import annotations

import json
import socket

import pytest
from fixtures.fake_launch import cpu_job

from launcher.errors import PreflightError, SpecError
from launcher.orchestrate.code import plan_code
from launcher.orchestrate.plan import plan, render
from launcher.preflight import NodeFacts
from launcher.spec import ClusterSpec, JobSpec
from launcher.util import MASK


def two_nodes(**node_env) -> ClusterSpec:
    env = {"NCCL_SOCKET_IFNAME": "eth0", **node_env}
    a = {"name": "a", "host": "10.0.0.1", "gpus": 4, "python": "/venv/bin/python", "env": env}
    return ClusterSpec.model_validate({"nodes": [a, {"name": "b", "host": "10.0.0.2", "gpus": 4}]})


def gpu_job(**resources) -> JobSpec:
    launch = {"max_restarts": 2, "env": {"WANDB_API_KEY": "s3cret", "FOO": "bar"}}
    job = {"name": "t", "nccl": {"env": {"NCCL_DEBUG": "INFO"}}, "launch": launch}
    return JobSpec.model_validate({**job, "resources": {"device": "cuda", **resources}})


GPU_SHELL = {
    "NCCL_IB_HCA": "mlx5",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "HOME": "/root",
    "AWS_SECRET": "x",
}


def make(job: JobSpec, cluster: ClusterSpec, facts=None, env=None, code=None):
    fixed = {"run_id": "t-1", "master_port": 29400, "local_python": "/usr/bin/python3"}
    return plan(job, cluster, facts, code=code, launcher_env=env or GPU_SHELL, **fixed)


def test_two_node_ranks_master_and_argv():
    p = make(gpu_job(), two_nodes())
    assert p.world_size == 8 and p.master_addr == "10.0.0.1" and p.backend == "nccl"
    a, b = p.nodes
    assert (a.node_rank, a.ranks) == (0, [0, 1, 2, 3])
    assert (b.node_rank, b.ranks) == (1, [4, 5, 6, 7])
    assert a.argv[:3] == ["/venv/bin/python", "-m", "torch.distributed.run"]
    assert b.argv[0] == "python3"  # remote node without a python: python3 on its PATH
    flags = dict(zip(b.argv[3:21:2], b.argv[4:22:2], strict=True))
    assert flags == {
        "--nnodes": "2",
        "--node-rank": "1",
        "--nproc-per-node": "4",
        "--master-addr": "10.0.0.1",
        "--master-port": "29400",
        "--max-restarts": "0",
        "--rdzv-id": "t-1",
        "--redirects": "3",
        "--log-dir": "{node_dir}/torchrun",
    }
    assert b.argv[-4:] == ["-m", "launcher.train", "--job", "{node_dir}/job.yaml"]
    # the launcher restarts, not torchrun
    assert p.max_restarts == 2 and p.to_json()["max_restarts"] == 2
    assert [r["rank"] for r in p.ranks()] == list(range(8))
    five = {"rank": 5, "node": "b", "host": "10.0.0.2", "local_rank": 1, "device": "cuda:1"}
    assert p.ranks()[5] == five


def test_env_layers_and_sources():
    p = make(gpu_job(), two_nodes(NCCL_DEBUG="WARN"))
    a, b = p.nodes
    # another node gets the shell's variables that launch.env_forward matches, no others
    assert a.env["NCCL_IB_HCA"] == "mlx5"
    assert a.env_sources["NCCL_IB_HCA"] == "shell (launch.env_forward)"
    assert a.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert a.env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert "HOME" not in a.env and "AWS_SECRET" not in a.env
    # the node's env beats the job's, which beats the launcher's
    assert a.env["NCCL_DEBUG"] == "WARN" and a.env_sources["NCCL_DEBUG"] == "cluster nodes.a.env"
    assert b.env["NCCL_DEBUG"] == "INFO" and b.env_sources["NCCL_DEBUG"] == "job nccl.env"
    assert a.env["NCCL_SOCKET_IFNAME"] == "eth0" and "NCCL_SOCKET_IFNAME" not in b.env
    assert a.env["LAUNCHER_METRICS_FILE"] == "{node_dir}/metrics/rank{rank}.jsonl"
    assert a.env["FOO"] == "bar"
    assert "LAUNCHER_PROFILE_DIR" not in a.env  # only when train.profile records


def test_profiling_gives_each_node_a_profile_folder():
    a, b = make(cpu_job(profile={"start_step": 5}), two_nodes()).nodes
    assert a.env["LAUNCHER_PROFILE_DIR"] == "{node_dir}/profile"
    assert b.env_sources["LAUNCHER_PROFILE_DIR"] == "launcher (train.profile)"


def test_facts_override_declared_gpus_and_nproc_limits():
    p = make(gpu_job(), two_nodes(), facts={"a": NodeFacts(gpus=8), "b": NodeFacts(gpus=8)})
    assert p.world_size == 16
    p = make(gpu_job(), two_nodes(), facts={"a": NodeFacts(gpus=2), "b": NodeFacts(gpus=3)})
    assert [n.ranks for n in p.nodes] == [[0, 1], [2, 3, 4]]  # uneven counts: contiguous ranks
    p = make(gpu_job(nproc_per_node=2), two_nodes())
    assert [n.ranks for n in p.nodes] == [[0, 1], [2, 3]]
    with pytest.raises(PreflightError, match="needs 6 GPU worker"):
        make(gpu_job(nproc_per_node=6), two_nodes())


def test_auto_gpus_without_preflight_is_an_input_error():
    cluster = ClusterSpec.model_validate({"nodes": [{"name": "a", "host": "10.0.0.1"}]})
    with pytest.raises(SpecError, match="gpus: auto") as info:
        make(gpu_job(), cluster)
    assert info.value.exit_code == 2


def test_node_subset_and_cpu_workers():
    resources = {"device": "cpu", "nodes": 1, "nproc_per_node": 3}
    job = JobSpec.model_validate(
        {"name": "c", "resources": resources, "precision": {"dtype": "fp32"}}
    )
    p = make(job, two_nodes())
    assert len(p.nodes) == 1 and p.world_size == 3 and p.backend == "gloo"
    assert p.ranks()[2]["device"] == "cpu"


def test_script_entrypoint_argv(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    entry = {"script": str(script), "args": ["--lr", "3e-4"], "workdir": str(tmp_path)}
    cpu = {"resources": {"device": "cpu"}, "precision": {"dtype": "fp32"}}
    job = JobSpec.model_validate({"name": "s", "entrypoint": entry, **cpu})
    cluster = ClusterSpec.this_machine()
    p = make(job, cluster, code=plan_code(job, cluster.nodes))
    assert p.nodes[0].argv[-3:] == [str(script), "--lr", "3e-4"]
    assert p.nodes[0].argv[0] == "/usr/bin/python3"  # a local node runs the launcher's interpreter


SHELL = {
    "MY_OWN": "1",
    "HF_HOME": "/data/hf",
    "WANDB_MODE": "offline",
    "OMP_NUM_THREADS": "2",
    "TORCHINDUCTOR_CACHE_DIR": "/c",
    "HTTPS_PROXY": "http://user:pw@proxy:3128",
    "no_proxy": "localhost",
    "SSL_CERT_FILE": "/etc/ca.pem",
    "PYTHONHASHSEED": "0",
    "HF_TOKEN": "hf_secret",
    "CUDA_HOME": "/usr/local/cuda",
    "CUDA_VISIBLE_DEVICES": "3",
    "RANK": "7",
    "MASTER_PORT": "1",
    "RAY_ADDRESS": "auto",
    "LAUNCHER_RUN_ID": "x",
    "LAUNCHER_COMPILE_CACHE": "/shared/compile",
    "PWD": "/somewhere",
    "PATH": "/my/bin:/usr/bin",
}


def local_and_remote() -> ClusterSpec:
    return ClusterSpec.model_validate(
        {"nodes": [{"name": "a", "host": "10.0.0.1"}, {"name": "there", "host": "10.0.0.2"}]}
    )


def this_machine() -> ClusterSpec:
    return ClusterSpec.model_validate({"nodes": [{"name": "here", "host": socket.gethostname()}]})


def test_this_machines_node_gets_the_whole_shell_less_what_the_launcher_owns():
    here = make(cpu_job(), this_machine(), env=SHELL).nodes[0]
    for name in ("MY_OWN", "HF_HOME", "WANDB_MODE", "PATH", "CUDA_HOME", "HF_TOKEN"):
        assert here.env[name] == SHELL[name] and here.env_sources[name] == "shell"
    assert here.env["LAUNCHER_COMPILE_CACHE"] == "/shared/compile"  # the user's, not owned
    assert here.env["OMP_NUM_THREADS"] == "2"  # torchrun's default of 1 only where unset
    for name in ("CUDA_VISIBLE_DEVICES", "RANK", "MASTER_PORT", "RAY_ADDRESS", "PWD"):
        assert name not in here.env
    assert here.env["LAUNCHER_RUN_ID"] == "t-1"
    assert here.env_sources["LAUNCHER_RUN_ID"] == "launcher"


def test_other_nodes_get_what_env_forward_matches():
    there = make(cpu_job(), local_and_remote(), env=SHELL).nodes[1]
    forwarded = {k for k, s in there.env_sources.items() if s.startswith("shell")}
    assert forwarded == {
        "HF_HOME",
        "WANDB_MODE",
        "OMP_NUM_THREADS",
        "TORCHINDUCTOR_CACHE_DIR",
        "HTTPS_PROXY",
        "no_proxy",
        "SSL_CERT_FILE",
        "PYTHONHASHSEED",
        "HF_TOKEN",
        "LAUNCHER_COMPILE_CACHE",
    }  # not MY_OWN, PATH, CUDA_HOME (the node's own) nor anything the launcher owns


def test_env_forward_patterns_last_match_wins_and_spec_beats_shell():
    job = cpu_job({"env_forward": ["MY_*", "HF_*", "!HF_TOKEN"], "env": {"HF_HOME": "/spec/hf"}})
    there = make(job, local_and_remote(), env=SHELL).nodes[1]
    assert there.env["MY_OWN"] == "1" and "HF_TOKEN" not in there.env
    assert there.env["HF_HOME"] == "/spec/hf" and there.env_sources["HF_HOME"] == "job launch.env"
    assert "WANDB_MODE" not in there.env


def test_a_default_nccl_env_yields_to_the_shell_but_a_written_one_does_not():
    shell = {"NCCL_DEBUG": "INFO"}
    assert make(cpu_job(), local_and_remote(), env=shell).nodes[1].env["NCCL_DEBUG"] == "INFO"
    written = JobSpec.model_validate(
        {"name": "t", "resources": {"device": "cpu"}, "nccl": {"env": {"NCCL_DEBUG": "TRACE"}}}
    )
    assert make(written, local_and_remote(), env=shell).nodes[1].env["NCCL_DEBUG"] == "TRACE"


def test_render_shows_every_node_and_masks_secrets_like_json_not_the_plan():
    """The job's secrets and the forwarded shell's: masked for people, real for the workers."""
    p = make(gpu_job(), two_nodes(), env=SHELL)
    a, b = p.nodes
    assert a.env["WANDB_API_KEY"] == "s3cret" and b.env["HF_TOKEN"] == "hf_secret"
    text = render(p)
    assert "--node-rank 0" in text and "--node-rank 1" in text and "world size 8" in text
    assert "(the node's own)" in text  # PATH, HOME, ... on the other nodes: their own
    for shown in (text, json.dumps(p.to_json())):
        assert MASK in shown and not any(s in shown for s in ("s3cret", "hf_secret", "pw@"))


def test_env_forward_refuses_what_is_no_name_pattern():
    with pytest.raises(ValueError, match="env_forward pattern"):
        cpu_job({"env_forward": ["HF_*", "A=B"]})
