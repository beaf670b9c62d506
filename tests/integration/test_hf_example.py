"""examples/hf_finetune end to end as a user runs it: make_assets.py, `launch job.yaml` (2 CPU
workers, embedded Ray), `launch export`, and transformers loads the result."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.launching import Launcher

from launcher.metrics import read_records

pytest.importorskip("tokenizers", reason="the example tokenizes text (hf extra)")
pytest.importorskip("safetensors", reason="the example's model is a safetensors folder (hf extra)")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_finetune"


def run(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_the_example_fine_tunes_a_local_bert_folder_and_exports_it(tmp_path):
    shutil.copy(EXAMPLE / "job.yaml", tmp_path / "job.yaml")
    run(str(EXAMPLE / "make_assets.py"), "--out", str(tmp_path / "assets"), cwd=tmp_path)
    run_dir = tmp_path / f"run-{tmp_path.name}"
    began = time.monotonic()
    with Launcher(str(tmp_path / "job.yaml"), run_dir=run_dir, cwd=tmp_path) as launch:
        code = launch.wait(timeout=240)
        took = time.monotonic() - began
        assert code == 0, launch.output[-3000:]
        launch.assert_nothing_left()
    assert took < 60, f"the example took {took:.0f} s"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["world_size"] == 2
    assert all(r["data_wait_pct"] is not None and r["steps"] == 40 for r in summary["ranks"])
    losses = [
        r["loss"] for r in read_records(run_dir / "metrics" / "rank0.jsonl") if r["type"] == "step"
    ]
    assert losses[-1] < losses[0] - 0.5, losses
    assert (tmp_path / "assets" / "cache").is_dir()  # tokenized once, next to the assets

    out = tmp_path / "exported"
    run("-m", "launcher", "export", str(run_dir), "--out", str(out), cwd=tmp_path)
    assert {p.name for p in out.iterdir()} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    pytest.importorskip("transformers", reason="checks the export with transformers (test extra)")
    check = (
        "from transformers import AutoModelForMaskedLM, AutoTokenizer; import sys; "
        "m = AutoModelForMaskedLM.from_pretrained(sys.argv[1]); t = AutoTokenizer.from_pretrained(sys.argv[1]); "
        "ids = t('the cat sees a red house', return_tensors='pt'); "
        "print(type(m).__name__, tuple(m(**ids).logits.shape))"
    )
    done = run("-c", check, str(out), cwd=tmp_path)
    assert done.stdout.split()[0] == "BertForMaskedLM"
