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


def test_write_private_is_owner_only_even_over_a_wider_file_write_atomic_uses_the_umask(tmp_path):
    path = tmp_path / "job.yaml"
    write_private(path, "secret: 1\n")
    assert path.read_text() == "secret: 1\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    write_private(path, "short\n")
    assert path.read_text() == "short\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    write_atomic(tmp_path / "summary.json", "{}\n")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "summary.json").stat().st_mode) == 0o666 & ~umask


@pytest.mark.parametrize("write", [write_private, write_atomic])
def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch, write):
    path = tmp_path / "summary.json"
    write(path, '{"status": "running"}\n')
    with pytest.raises(UnicodeEncodeError):
        write(path, '{"status": 2, "bad": "\ud800"}\n')  # fails mid-write
    assert path.read_text() == '{"status": "running"}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]

    def full_disk(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        write(path, '{"status": "succeeded", "totals": ' + "x" * 10_000)
    assert path.read_text() == '{"status": "running"}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


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
