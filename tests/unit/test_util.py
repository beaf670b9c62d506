"""The shared small helpers: first_line, write_private, write_atomic, utc_stamp, percentile, free_port."""

from __future__ import annotations

import datetime as dt
import os
import socket
import stat

import pytest

from launcher.util import first_line, free_port, percentile, utc_stamp, write_atomic, write_private


@pytest.mark.parametrize(
    ("err", "expected"),
    [
        (RuntimeError("boom\nTraceback follows\n  more"), "boom"),
        (ConnectionError("\n\n  the head is down  \nsecond"), "the head is down"),
        (TimeoutError(), "TimeoutError"),
        (ValueError(""), "ValueError"),
        (OSError("  \n \t\n"), "OSError"),
    ],
)
def test_first_line(err, expected):
    assert first_line(err) == expected


def test_write_private_is_owner_only_also_over_a_wider_file(tmp_path):
    path = tmp_path / "job.yaml"
    write_private(path, "secret: 1\n")
    assert path.read_text() == "secret: 1\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    write_private(path, "short\n")
    assert path.read_text() == "short\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_write_private_is_whole_or_nothing(tmp_path):
    path = tmp_path / "head.json"
    write_private(path, '{"pid": 1}\n')
    with pytest.raises(UnicodeEncodeError):
        write_private(path, '{"pid": 2, "bad": "\ud800"}\n')  # fails mid-write
    assert path.read_text() == '{"pid": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["head.json"]


def test_utc_stamp_is_now_in_utc():
    before = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    stamp = utc_stamp()
    after = dt.datetime.now(dt.timezone.utc)
    parsed = dt.datetime.strptime(stamp, "%Y%m%d-%H%M%S").replace(tzinfo=dt.timezone.utc)
    assert len(stamp) == 15 and before <= parsed <= after


def test_percentile_interpolates_unsorted_values():
    assert percentile([], 50) is None
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile([10.0, 0.0], 25) == pytest.approx(2.5)
    assert percentile([7.0, 3.0, 5.0], 100) == 7.0 and percentile([7.0, 3.0, 5.0], 0) == 3.0
    assert percentile([5.0], 95) == 5.0
    assert percentile(list(range(1, 101)), 95) == pytest.approx(95.05)


def test_free_port_can_be_bound_on_every_interface():
    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", port))


def test_write_atomic_leaves_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    write_atomic(target, '{"status": "running"}\n')
    assert target.read_text() == '{"status": "running"}\n'
    umask = os.umask(0)
    os.umask(umask)
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~umask)  # as write_text makes it

    def full_disk(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        write_atomic(target, '{"status": "succeeded", "totals": ' + "x" * 10_000)
    assert target.read_text() == '{"status": "running"}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary file left
