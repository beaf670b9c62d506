"""What the launcher makes or trusts on a shared host: private folders, folders checked for owner
and mode before they are trusted, secret-looking values masked wherever they are shown."""

from __future__ import annotations

import os

import pytest

from launcher.cli import main
from launcher.errors import UnsafePath
from launcher.jobs import head as heads
from launcher.jobs import records
from launcher.orchestrate.ray_cluster import remove_ray_temp
from launcher.util import (
    MASK,
    is_secret,
    make_private_dir,
    mask_env,
    mask_urls,
    private_dir,
    unsafe_path,
    unsafe_reason,
)


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        *[(n, True) for n in ["MY_API_TOKEN", "DB_PASSWORD", "DB_PASSWD", "DB_PASS", "DB_PWD"]],
        *[(n, True) for n in ["AWS_CREDENTIALS", "GCP_CREDENTIAL_FILE", "HF_AUTH", "SSH_PRIVATE"]],
        *[(n, True) for n in ["AWS_SECRET_ACCESS_KEY", "api_key"]],
        *[(n, False) for n in ["PWD", "OLDPWD", "NCCL_DEBUG", "PATH", "LAUNCHER_RUN_ID"]],
    ],
)
def test_secret_looking_names(name, secret):
    assert is_secret(name) is secret


def test_url_passwords_are_masked_in_any_value():
    assert mask_urls("postgres://user:pw@db/x") == f"postgres://user:{MASK}@db/x"
    assert mask_urls("redis://:p@ss@h:6379/0") == f"redis://:{MASK}@h:6379/0"  # an @ in it
    both = mask_urls("a http://u:p@h and s3://k:s@b/p")
    assert both == f"a http://u:{MASK}@h and s3://k:{MASK}@b/p"
    for kept in ("https://host:8443/a@b", "https://user@host/x", "plain:text@x", "/a/b:c@d"):
        assert mask_urls(kept) == kept
    env = {"DATABASE_URL": "mysql://u:pw@h/db", "DB_PASSWD": "x", "N": "1"}
    assert mask_env(env) == {"DATABASE_URL": f"mysql://u:{MASK}@h/db", "DB_PASSWD": MASK, "N": "1"}


def test_private_folders(tmp_path):
    made = make_private_dir("launcher-x-", str(tmp_path))
    assert made.parent == tmp_path and made.name.startswith("launcher-x-")
    assert made.stat().st_mode & 0o777 == 0o700 and unsafe_reason(made) is None
    fresh, reason = private_dir(tmp_path / "a" / "b")
    assert reason is None and fresh.stat().st_mode & 0o777 == 0o700
    wide = tmp_path / "wide"
    wide.mkdir()
    wide.chmod(0o777)
    assert private_dir(wide)[1] == "other users may write it (mode 0777)"
    link = tmp_path / "link"
    link.symlink_to(made)
    assert unsafe_reason(link) == "it is a symbolic link"
    (made / "sub").mkdir()
    (made / "sub" / "f").write_text("x")
    assert unsafe_path(made) is None
    (made / "sub" / "f").chmod(0o666)
    assert unsafe_path(made) == (made / "sub" / "f", "other users may write it (mode 0666)")


@pytest.mark.skipif(os.getuid() != 0, reason="making a folder another user owns needs root")
def test_a_folder_of_another_user_is_not_trusted(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    assert unsafe_reason(theirs) == "it belongs to uid 65534, not to this user (uid 0)"


def test_a_state_folder_others_may_write_is_refused(tmp_path, monkeypatch, capsys):
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o777)
    monkeypatch.setenv(records.STATE_ENV, str(state))
    with pytest.raises(UnsafePath) as err:
        records.state_dir()
    assert str(state) in str(err.value) and "mode 0777" in str(err.value)
    assert main(["status"]) == 2
    assert "launcher's state folder" in capsys.readouterr().err


def test_the_local_heads_temp_dir_is_new_private_and_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv(records.STATE_ENV, str(tmp_path / "state"))
    folder = records.local_folder()
    assert heads._temp_dir(folder) == ""  # none known yet: nothing is signalled by it
    first = heads._new_temp_dir(folder)
    try:
        second = heads._new_temp_dir(folder)
        assert first != second and heads._temp_dir(folder) == second
        for made in (first, second):  # Ray makes its temp dir 0777: in a private parent
            parent = os.stat(os.path.dirname(made))
            assert parent.st_mode & 0o777 == 0o700 and parent.st_uid == os.getuid()
        assert heads._processes_under("") == []
    finally:
        for made in (first, second):
            remove_ray_temp(made)
            assert not os.path.exists(os.path.dirname(made))
