"""What a newcomer meets in examples/hf_finetune before its assets exist."""

from __future__ import annotations

import shutil
import sys

import pytest
from fixtures.hf_assets import ROOT, make_assets

from launcher.errors import SpecError
from launcher.spec import load_job

EXAMPLE = ROOT / "examples" / "hf_finetune"


def test_the_example_without_its_assets_says_to_run_make_assets(tmp_path):
    for name in ("job.yaml", "make_assets.py"):
        shutil.copy(EXAMPLE / name, tmp_path / name)
    with pytest.raises(SpecError) as err:
        load_job(tmp_path / "job.yaml")
    assert err.value.exit_code == 2
    assert f"python {tmp_path / 'make_assets.py'}" in str(err.value)
    assert "hf download" not in str(err.value)


def test_make_assets_without_the_hf_extra_names_the_install(monkeypatch, tmp_path):
    module = make_assets()
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    monkeypatch.setattr(sys, "argv", ["make_assets.py", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert "needs the hf extra (tokenizers is not installed)" in str(exit_.value.code)
    assert "pip install -e '.[hf]'" in str(exit_.value.code)
    assert not any(tmp_path.iterdir())
