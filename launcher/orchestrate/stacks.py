"""Workers' Python stacks as their fault handler dumps them (``launcher/hooks/sitecustomize.py``),
read, and ``blame``: the rank a hang waits for, the one outside the others' collective.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

HEADER = re.compile(r"^pid (\d+) signal (\d+) main (0x[0-9a-f]+)")
THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
FRAME = re.compile(r'^\s+File "(.+)", line (\d+) in (\S+)')
# Where a rank waits for its peers: c10d's collectives, DDP and FSDP, and the backward pass
# (DDP's gradient all-reduce completes inside it).
WAIT_FILES = ("torch/distributed/", "torch/nn/parallel/", "torch/autograd/")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{self.func} ({self.file.rsplit('/', 1)[-1]}:{self.line})"


def header(text: str) -> tuple[int, int, str] | None:
    """(pid, dump signal, main thread id) of a dump file's first line, or None."""
    m = HEADER.match(text)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def main_frames(text: str) -> list[Frame]:
    """The main thread's frames in the last dump of ``text``, innermost first."""
    head = header(text)
    main = head[2] if head else None
    threads: list[tuple[str, list[Frame]]] = []
    for line in text.splitlines():
        if m := THREAD.match(line):
            threads.append((m.group(1), []))
        elif threads and (f := FRAME.match(line)):
            threads[-1][1].append(Frame(f.group(1), int(f.group(2)), f.group(3)))
    mains = [frames for ident, frames in threads if ident == main]
    if mains:
        return mains[-1]
    return threads[-1][1] if threads else []


def collective(frames: list[Frame]) -> str | None:
    """The collective these frames wait in (c10d's call, else the outermost torch frame that
    waits for peers), or None."""
    c10d = [f for f in frames if f.file.endswith("distributed_c10d.py")]
    if c10d:
        return c10d[0].func
    inside = [f for f in frames if any(part in f.file for part in WAIT_FILES)]
    return inside[-1].func if inside else None


def user_frames(frames: list[Frame], n: int = 3) -> list[Frame]:
    """The ``n`` innermost frames outside the standard library's threading and torch."""
    own = [f for f in frames if "/torch/" not in f.file and "/threading.py" not in f.file]
    return (own or frames)[:n]


def blame(stacks: dict[int, str]) -> tuple[int, str, list[Frame]] | None:
    """(rank, the collective the others wait in, that rank's top frames) where some ranks wait
    inside a collective and others are outside any; the lowest such rank. None otherwise."""
    frames = {rank: main_frames(text) for rank, text in stacks.items()}
    frames = {rank: f for rank, f in frames.items() if f}
    waiting = {rank: c for rank, f in frames.items() if (c := collective(f)) is not None}
    outside = sorted(rank for rank in frames if rank not in waiting)
    if not waiting or not outside:
        return None
    names = sorted(set(waiting.values()))
    rank = outside[0]
    return rank, "/".join(names), user_frames(frames[rank])


def describe(frames: list[Frame]) -> str:
    """``func (file:line) ← caller (file:line)``."""
    return " ← ".join(str(f) for f in frames)
