"""Reading workers' faulthandler dumps and naming the rank a hang waits for."""

from __future__ import annotations

from fixtures.stacks import STUCK, WAITING

from launcher.orchestrate.stacks import blame, collective, header, main_frames


def test_the_header_names_pid_signal_and_main_thread():
    assert header(WAITING) == (101, 41, "0x00007f0000000001")
    assert header("Thread 0x1 (most recent call first):") is None


def test_the_main_threads_frames_innermost_first_and_the_collective_they_wait_in():
    frames = main_frames(WAITING)
    assert [f.func for f in frames] == ["all_reduce", "wrapper", "main", "<module>"]
    assert collective(frames) == "all_reduce"
    assert collective(main_frames(STUCK)) is None


def test_the_latest_dump_of_a_file_counts():
    second = STUCK.split("\n", 1)[1].replace("line 18 in load_batch", "line 20 in decode")
    assert main_frames(STUCK + "\n" + second)[0].func == "decode"


def test_the_rank_outside_the_collective_is_blamed_with_its_own_frames():
    rank, where, frames = blame({0: WAITING, 1: STUCK, 2: WAITING})
    assert (rank, where) == (1, "all_reduce")
    assert [str(f) for f in frames] == [
        "load_batch (train.py:18)",
        "main (train.py:29)",
        "<module> (train.py:34)",
    ]


def test_no_blame_when_all_wait_or_none_do():
    assert blame({0: WAITING, 1: WAITING}) is None
    assert blame({0: STUCK, 1: STUCK}) is None
    assert blame({}) is None
