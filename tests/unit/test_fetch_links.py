"""``launch fetch`` copies a run directory; a symlink out of it is skipped with a warning, over
SSH (a tar stream) and on this machine (a copy) alike, never a traceback."""

from __future__ import annotations

import io
import logging
import tarfile

from launcher.jobs.ssh import copy_dir, extract
from launcher.spec.cluster import NodeSpec, SSHSpec


def run_dir(tmp_path):
    root = tmp_path / "run"
    (root / "logs").mkdir(parents=True)
    (root / "summary.json").write_text("{}")
    (tmp_path / "secret").write_text("not the run's")
    (root / "logs" / "out").symlink_to(tmp_path / "secret")
    (root / "inside").symlink_to("summary.json")
    return root


def test_a_tar_with_a_link_out_of_the_folder_is_unpacked_without_it(tmp_path, caplog):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(run_dir(tmp_path), arcname=".")
    dest = tmp_path / "fetched"
    dest.mkdir()
    with caplog.at_level(logging.WARNING):
        extract(buf.getvalue(), dest, "head:/runs/x")
    assert (dest / "summary.json").read_text() == "{}" and (dest / "inside").is_symlink()
    assert not (dest / "logs" / "out").exists()
    assert "skipped ./logs/out of head:/runs/x" in caplog.text


def test_a_local_copy_leaves_a_link_out_of_the_folder_out(tmp_path, caplog):
    root = run_dir(tmp_path)
    dest = tmp_path / "fetched"
    with caplog.at_level(logging.WARNING):
        copy_dir(NodeSpec(name="local", host="localhost"), SSHSpec(), str(root), dest)
    assert (dest / "summary.json").read_text() == "{}"
    assert not (dest / "logs" / "out").exists() and "a symlink out of" in caplog.text
