"""`launch submit` staging the user's code for a remote head: an OSError there (a file that
cannot be read, a full disk) is the launcher's one paragraph with exit 3, nothing submitted and
nothing left behind. Ray is faked: nothing is started."""

from __future__ import annotations

import contextlib
import errno
import json
import tempfile
import types

import pytest
from fixtures.launching import write_job

from launcher import cli
from launcher.jobs import commands
from launcher.orchestrate import code as code_mod


@pytest.fixture
def submission(tmp_path, monkeypatch):
    """A script job whose workdir travels (two remote nodes), a fake Jobs API with a remote head,
    temporary folders under tmp_path/tmp; returns the fake client."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text("print('hi')\n")
    (work / "helper.py").write_text("V = 1\n")
    nodes = "[{name: a, host: 198.18.0.10}, {name: b, host: 198.18.0.11}]"
    (tmp_path / "cluster.yaml").write_text(f"nodes: {nodes}\n")
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setenv("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0")  # submit sets it: restored after
    monkeypatch.setattr("launcher.preflight.preflight_facts", lambda *a, **k: None)
    client = types.SimpleNamespace(submitted=[])
    client.submit_job = lambda **kw: client.submitted.append(kw)

    @contextlib.contextmanager
    def connect(spec, *, start=False):
        yield types.SimpleNamespace(
            head_is_local=False, cluster=spec, client=client, head=spec.nodes[0]
        )

    monkeypatch.setattr(commands, "connect", connect)
    job = write_job(work, {"script": "train.py"})
    return types.SimpleNamespace(
        job=job, cluster=tmp_path / "cluster.yaml", temp=temp, client=client
    )


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        PermissionError(errno.EACCES, "Permission denied", "/work/helper.py"),
    ],
)
def test_an_oserror_while_staging_the_code_is_exit_3_in_one_paragraph(
    submission, monkeypatch, capsys, error
):
    copied = []

    def copy2(src, dst, **kw):
        if copied:
            raise error
        copied.append(src)
        return dst

    monkeypatch.setattr(code_mod.shutil, "copy2", copy2)
    rc = cli.main(["submit", str(submission.job), "--cluster", str(submission.cluster)])
    err = capsys.readouterr().err
    assert rc == 3, err
    assert err.startswith("error: could not stage the job's files for submission: ")
    assert error.strerror in err and "Nothing was submitted" in err and "Traceback" not in err
    assert err.count("\n") == 1
    assert submission.client.submitted == []
    # neither the snapshot nor the upload folder is left
    assert list(submission.temp.iterdir()) == []


def test_staging_that_works_submits(submission, capsys):
    argv = ["submit", str(submission.job), "--cluster", str(submission.cluster), "--json"]
    assert cli.main(argv) == 0
    assert len(submission.client.submitted) == 1
    assert json.loads(capsys.readouterr().out)["name"] == "test"
    assert list(submission.temp.iterdir()) == []
