"""HF folder -> model.init_from under DDP and FSDP (torchrun, 2 gloo ranks) -> DCP checkpoint ->
``launch export`` -> the same tensors, bit for bit; only rank 0 reads the folder. (FSDP's CPU
offload needs a GPU: tests/integration/test_gpu_hf_parity.py.)"""

from __future__ import annotations

import pytest
import yaml

pytest.importorskip("transformers", reason="builds Hugging Face models (test extra)")
pytest.importorskip("safetensors", reason="Hugging Face folders hold model.safetensors (hf extra)")

from fixtures.hf_assets import save_bert, save_gpt2  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_train_distributed import launch, ok  # noqa: E402

from launcher.cli import main as cli_main  # noqa: E402
from launcher.spec import load_job  # noqa: E402


@pytest.mark.parametrize("arch,strategy", [("bert", "fsdp"), ("gpt", "ddp")])
def test_init_from_then_export_gives_back_the_same_tensors(tmp_path, arch, strategy):
    folder = tmp_path / "hf"
    (save_bert if arch == "bert" else save_gpt2)(folder)
    spec = {
        "name": "roundtrip",
        "model": {"init_from": str(folder)},
        "data": {"seq_len": 16},
        "train": {"checkpoint": {"dir": str(tmp_path / "ckpt")}, "steps": 2, "warmup_steps": 1},
        "parallel": {"strategy": strategy},
        "precision": {"dtype": "fp32"},
        "resources": {"device": "cpu", "nproc_per_node": 2},
    }
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    run = ok(launch(tmp_path / "run", ["--job", str(job), "--save-untouched"]))
    assert "rank 0 read the folder" in run.output and "rank 1 read the folder" not in run.output
    assert "parameters on meta after loading: True" not in run.output
    # A run directory as the launcher writes it: the resolved job.
    run_dir = tmp_path / "run-dir"
    run_dir.mkdir()
    (run_dir / "job.yaml").write_text(yaml.safe_dump(load_job(job).model_dump(mode="json")))
    out = tmp_path / "exported"
    assert cli_main(["export", str(run_dir), "--out", str(out)]) == 0
    want, got = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(want) == sorted(got)
    for name, tensor in want.items():
        assert tensor.equal(got[name]), name
