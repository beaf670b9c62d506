"""NodeAgent: the Ray actor on each node that runs that node's torchrun and reports back.

It reads each rank's output from torchrun's per-rank files, tails the metrics files, and stops
torchrun and every worker on ``stop()`` or when the agent itself dies (with ``reaper.py``).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher import metrics, telemetry
from launcher.orchestrate import reaper
from launcher.orchestrate.plan import NODE_DIR, NODE_PASSTHROUGH, STACKS_SUBDIR
from launcher.orchestrate.reach import Listener, reach
from launcher.orchestrate.reaper import descendants, end_noted, kill_after, signal_all, started
from launcher.orchestrate.records import AgentUpdate, ExitStatus, RankError
from launcher.orchestrate.stacks import header
from launcher.preflight.probe import interfaces, route_to
from launcher.util import free_port, make_private_dir, write_private

# torchrun --log-dir D --redirects 3: each worker's output in D/<id>_<random>/attempt_<n>/<local rank>/
RANK_FILES = ("*/attempt_*/*/stdout.log", "*/attempt_*/*/stderr.log")
STREAMS = {"stdout.log": "out", "stderr.log": "err"}
RANK_TAIL_LINES = 40  # per local rank: a failure's log tail
TORCHRUN_TAIL_LINES = 200  # torchrun's own lines: its failure report can be long
REAPER_GRACE_S = 10.0  # after the agent's death: torchrun's own SIGTERM handling, then SIGKILL
WORKER_SCAN_S = 2.0  # how often the agent notes torchrun's workers (a /proc scan)
ORPHAN_GRACE_S = 5.0  # workers left by a torchrun that died: SIGTERM, then SIGKILL after this
# Bounds on what waits for the driver's next poll (ranks' output waits in its files).
LINE_MAX_BYTES = 64 << 10
PENDING_LINES_MAX = 20_000
PENDING_BYTES_MAX = 16 << 20
RANK_READ_BYTES = 1 << 20  # per file and pass
PENDING_RECORDS_MAX = 20_000
METRICS_READ_BYTES = 4 << 20  # per file and pass
HOOKS = Path(__file__).resolve().parents[1] / "hooks"  # the workers' sitecustomize (stack dumps)


class NodeAgent:
    """One per node, created by the driver inside that node's placement-group bundle."""

    def __init__(self, node: str):
        self.node = node
        self._home = os.getcwd()  # with a runtime_env working_dir: Ray's copy of it on this node
        self._proc: subprocess.Popen[bytes] | None = None
        self._reaper: subprocess.Popen[bytes] | None = None
        self._plan: dict[str, Any] | None = None
        self._node_dir: Path | None = None  # this run's private folder here, for every attempt
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # new output, a record, or a thread ended
        self._lines: list[tuple[int | None, str, str]] = []  # (local rank, stream, text)
        self._pending_bytes = 0  # of the ranks' lines waiting for the next poll
        self._log_dirs: set[Path] = set()  # torchrun's log folders of earlier attempts
        self._records: list[tuple[int, dict[str, Any]]] = []
        self._dropped = 0  # output lines dropped since the last poll (PENDING_LINES_MAX)
        self._telemetry: list[dict[str, Any]] = []
        # per local rank (None: torchrun's own lines), the last lines of this attempt
        self._tails: dict[int | None, collections.deque[str]] = {}
        self._offsets: dict[Path, int] = {}
        self._stopping = False
        self._started_at = 0.0
        self._workers: dict[int, int] = {}  # torchrun's descendants seen: pid → start time
        self._threads: list[threading.Thread] = []
        self._listener: Listener | None = None

    # -- facts ---------------------------------------------------------------------------

    def hostname(self) -> str:
        return socket.gethostname()

    def node_dir(self) -> str | None:
        """This run's private folder on the node (None before the first start, after cleanup)."""
        return None if self._node_dir is None else str(self._node_dir)

    def free_port(self) -> int:
        """A TCP port free on this node now (the rendezvous port when this is node 0)."""
        return free_port()

    def route(self, host: str) -> dict[str, Any]:
        """The route from this node to ``host`` and its interfaces, as the probe reports them."""
        try:
            found: dict[str, Any] = route_to(host)
        except OSError as err:
            found = {"to": host, "error": f"{type(err).__name__}: {err}"}
        return {"route": found, "interfaces": interfaces()}

    # -- the rendezvous check (reach.py) ----------------------------------------------------

    def listen(self, port: int) -> None:
        """Listen on ``port`` until ``unlisten``: the head's side of the rendezvous check."""
        self.unlisten()
        self._listener = Listener(port)

    def unlisten(self) -> None:
        if self._listener is not None:
            listener, self._listener = self._listener, None
            listener.close()

    def reach(
        self, master_addr: str, port: int, ifname: str | None, timeout_s: float
    ) -> str | None:
        """None when this node connects to the rendezvous port from ``ifname``, else why not."""
        return reach(master_addr, port, ifname, timeout_s)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, node_plan: dict[str, Any], files: dict[str, str]) -> int:
        """Write the node's files (0600) into its private node dir and start torchrun; returns
        its pid. ``NODE_DIR`` in ``node_plan``'s argv and env stands for that dir."""
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(
                f"torchrun already runs on node {self.node} (pid {self._proc.pid}); stop it first"
            )
        for thread in self._threads:  # a restart: the previous attempt's readers are done
            thread.join(timeout=5)
        self._threads = []
        self._stopping = False
        self._workers = {}
        with self._lock:  # a failure's tail is this attempt's, not the previous one's
            self._tails = {None: collections.deque(maxlen=TORCHRUN_TAIL_LINES)}
        if self._node_dir is None:
            self._node_dir = make_private_dir(f"launcher-{node_plan['run_id']}-{self.node}-")
        node_plan = _with_node_dir(node_plan, str(self._node_dir))
        self._plan = node_plan
        self._started_at = time.time()
        self._log_dirs = set((self._node_dir / "torchrun").glob("*"))  # earlier attempts
        (self._node_dir / metrics.SUBDIR).mkdir(exist_ok=True)
        for name, text in files.items():
            write_private(self._node_dir / name, text)
        env = {k: os.environ[k] for k in NODE_PASSTHROUGH if k in os.environ}
        env.update(node_plan["env"])
        if "LAUNCHER_STACKS_DIR" in env:  # the stack-dump hook, found first on the workers' path
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HOOKS), env.get("PYTHONPATH")]))
        self._proc = subprocess.Popen(  # its own lines only; the ranks' go to their files
            node_plan["argv"],
            env=env,
            cwd=node_plan["cwd"] or self._home,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_prepare_child,
        )
        self._start_reaper(self._proc.pid)
        for target in (self._read_output, self._read_ranks, self._tail_metrics, self._sample_gpus):
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self._proc.pid

    def poll(self, wait_s: float = 0.0) -> AgentUpdate:
        """New log lines and metrics records since the last poll, and the exit status if done;
        a long poll of up to ``wait_s`` while there is nothing to report."""
        deadline = time.monotonic() + wait_s
        with self._changed:
            while not (self._lines or self._records or self._drained()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                # short slices: a thread that just ended is seen within 50 ms
                self._changed.wait(min(remaining, 0.05))
            lines, self._lines = self._lines, []
            self._pending_bytes = 0
            records, self._records = self._records, []
            if self._dropped:
                note = (
                    f"[launcher: {self._dropped} line(s) of output dropped on node {self.node}: "
                    f"torchrun wrote faster than they could be passed on]"
                )
                lines.append((None, "out", note))
                self._dropped = 0
            samples, self._telemetry = self._telemetry, []
        # exited, but output still being drained: report the exit on a later poll
        return AgentUpdate(
            lines=lines,
            records=records,
            exit=self._status() if self._drained() else None,
            telemetry=samples,
        )

    def _drained(self) -> bool:
        return self._status() is not None and not any(t.is_alive() for t in self._threads)

    def stop(self, grace_s: float = 5.0, first: int = signal.SIGTERM) -> ExitStatus | None:
        """Stop torchrun and its workers, each signal ``grace_s`` after the one before: ``first``
        (SIGINT goes to torchrun alone, which passes it on), then SIGTERM to all, then SIGKILL."""
        self._stopping = True
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None and first == signal.SIGINT:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
        if proc.poll() is None:
            family = [proc.pid, *descendants(proc.pid)]
            signal_all(family, signal.SIGTERM)
            kill_after(proc.pid, grace_s, family)
            proc.wait(timeout=10)
        for thread in self._threads:
            thread.join(timeout=5)
        return self._status()

    def stacks(self, wait_s: float = 5.0) -> dict[str, bytes]:
        """Every worker's Python stacks now, and any collective trace: the files of
        ``<node dir>/stacks`` after signalling each live worker whose fault handler is installed
        (its header names the signal), once their dumps have stopped growing."""
        if self._proc is None or self._node_dir is None:
            return {}
        folder = self._node_dir / STACKS_SUBDIR
        family = set(descendants(self._proc.pid)) if self._proc.poll() is None else set()
        sizes: dict[Path, int] = {}
        for path in folder.glob("rank*.txt"):
            with contextlib.suppress(OSError, UnicodeDecodeError):
                with open(path, encoding="utf-8") as fh:
                    head = header(fh.readline())
                if head is not None and head[0] in family:
                    sizes[path] = path.stat().st_size
                    os.kill(head[0], head[1])
        deadline = time.monotonic() + wait_s
        while sizes and time.monotonic() < deadline:
            time.sleep(0.2)
            now = {p: p.stat().st_size for p in sizes}
            if all(now[p] > sizes[p] for p in sizes):  # every one began; let them finish
                time.sleep(0.3)
                if all(p.stat().st_size == now[p] for p in sizes):
                    break
        out = {}
        for path in sorted(folder.glob("*")) if folder.is_dir() else []:
            with contextlib.suppress(OSError):
                out[path.name] = path.read_bytes()[-(4 << 20) :]
        return out

    def tail(self, local_rank: int | None, n: int = RANK_TAIL_LINES) -> list[str]:
        """The last lines of one local rank's output (None: torchrun's own lines)."""
        with self._lock:
            return list(self._tails.get(local_rank, ()))[-n:]

    def errors(self) -> list[RankError]:
        """This attempt's per-rank error files (``@record``), earliest first."""
        if self._node_dir is None:
            return []
        found = []
        for path in (self._node_dir / "torchrun").rglob("error.json"):
            with contextlib.suppress(OSError, ValueError):
                if path.stat().st_mtime >= self._started_at - 1 and path.parent.name.isdigit():
                    found.append(_rank_error(int(path.parent.name), json.loads(path.read_text())))
        return sorted(found, key=lambda e: e.timestamp)

    def collect(self, subdir: str, max_bytes: int = 256 << 20) -> dict[str, bytes]:
        """The files under ``<node dir>/<subdir>`` (e.g. profiler traces), by relative path, before
        ``cleanup`` removes them; files past ``max_bytes`` in total are left out."""
        if self._node_dir is None:
            return {}
        root = self._node_dir / subdir
        out: dict[str, bytes] = {}
        total = 0
        for path in sorted(p for p in root.rglob("*") if p.is_file()):  # none if root is missing
            size = path.stat().st_size
            if total + size > max_bytes:
                continue
            out[str(path.relative_to(root))] = path.read_bytes()
            total += size
        return out

    def cleanup(self) -> None:
        """Remove the node dir (the driver holds copies of logs and metrics)."""
        if self._node_dir is not None:
            shutil.rmtree(self._node_dir, ignore_errors=True)
            self._node_dir = None

    # -- internals -----------------------------------------------------------------------

    def _start_reaper(self, pid: int) -> None:
        if self._reaper is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._reaper.wait(timeout=5)  # the last attempt's: gone with its torchrun
        args = (pid, REAPER_GRACE_S, os.getpid(), self._node_dir)
        self._reaper = subprocess.Popen(
            [sys.executable, reaper.__file__, *map(str, args)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_prepare_reaper,
        )

    def _status(self) -> ExitStatus | None:
        if self._proc is None or self._proc.poll() is None:
            return None
        code = self._proc.returncode
        return ExitStatus(
            exit_code=code,
            signal=signal.Signals(-code).name if code < 0 else None,
            stopped=self._stopping,
        )

    def _read_output(self) -> None:
        """torchrun's own lines (its workers write to their files, ``_read_ranks``)."""
        assert self._proc is not None and self._proc.stdout is not None
        cut = False  # the rest of a line cut at LINE_MAX_BYTES is skipped
        while raw := self._proc.stdout.readline(LINE_MAX_BYTES):
            was_cut, cut = cut, not raw.endswith(b"\n")
            if was_cut:
                continue
            text = raw.decode("utf-8", "replace").rstrip("\n")
            if cut:
                text += f" [line cut at {LINE_MAX_BYTES} bytes]"
            with self._changed:
                if len(self._lines) < PENDING_LINES_MAX:
                    self._lines.append((None, "out", text))
                else:
                    self._dropped += 1
                self._tails[None].append(text)
                self._changed.notify_all()

    def _read_ranks(self) -> None:
        """Each rank's stdout and stderr, line by line, from torchrun's per-rank files, until
        torchrun has exited and every file is read to its end."""
        assert self._proc is not None and self._node_dir is not None
        root = self._node_dir / "torchrun"
        files: dict[Path, _RankFile] = {}
        while True:
            done = self._proc.poll() is not None
            for pattern in RANK_FILES:
                for path in root.glob(pattern):
                    run_dir, local_rank = path.parents[2], path.parent.name
                    if path not in files and run_dir not in self._log_dirs and local_rank.isdigit():
                        files[path] = _RankFile(path, int(local_rank), STREAMS[path.name])
            busy = False
            for rank_file in sorted(files.values(), key=lambda f: (f.local_rank, f.stream)):
                busy |= self._read_rank_file(rank_file)
            if done and not busy:
                for rank_file in files.values():
                    if rank_file.partial and not rank_file.cut:
                        self._emit(rank_file, rank_file.partial)
                    rank_file.partial = b""
                return
            if not busy:
                time.sleep(0.1)

    def _read_rank_file(self, f: _RankFile) -> bool:
        """Pass on the complete lines added to ``f``; True if it read or waits for room."""
        with self._lock:
            full = (
                len(self._lines) >= PENDING_LINES_MAX // 2
                or self._pending_bytes >= PENDING_BYTES_MAX
            )
        if full:
            time.sleep(0.05)
            return True
        try:
            with open(f.path, "rb") as fh:
                fh.seek(f.offset)
                chunk = fh.read(RANK_READ_BYTES)
        except OSError:
            return False
        if not chunk:
            return False
        f.offset += len(chunk)
        *lines, f.partial = (f.partial + chunk).split(b"\n")
        for raw in lines:
            if f.cut:  # the rest of a line already cut
                f.cut = False
                continue
            self._emit(f, raw)
        if len(f.partial) > LINE_MAX_BYTES:
            if not f.cut:
                self._emit(f, f.partial[:LINE_MAX_BYTES], cut=True)
            f.cut, f.partial = True, b""
        return True

    def _emit(self, f: _RankFile, raw: bytes, *, cut: bool = False) -> None:
        text = raw.decode("utf-8", "replace")
        if cut:
            text += f" [line cut at {LINE_MAX_BYTES} bytes]"
        with self._changed:
            self._lines.append((f.local_rank, f.stream, text))
            self._pending_bytes += len(raw)
            tail = self._tails.setdefault(f.local_rank, collections.deque(maxlen=RANK_TAIL_LINES))
            tail.append(text)
            self._changed.notify_all()

    def _tail_metrics(self) -> None:
        assert self._proc is not None and self._node_dir is not None
        folder = self._node_dir / metrics.SUBDIR
        scanned = 0.0
        while True:
            done = self._proc.poll() is not None
            if not done and time.monotonic() - scanned > WORKER_SCAN_S:
                self._note_workers()
                scanned = time.monotonic()
            self._drain_metrics(folder)
            if done:
                # torchrun has exited: end the workers it left
                end_noted(self._workers, ORPHAN_GRACE_S)
                return
            time.sleep(0.25)

    def _sample_gpus(self) -> None:
        """This node's GPUs every ``telemetry.INTERVAL_S`` (``$LAUNCHER_TELEMETRY_S`` in the
        plan's environment; 0 turns it off) while torchrun runs, nothing without NVML; samples
        go out with the next poll, not on their own."""
        assert self._proc is not None and self._plan is not None
        every_s = float(self._plan["env"].get(telemetry.ENV_VAR) or telemetry.INTERVAL_S)
        if every_s <= 0:  # turned off
            return
        sampler = telemetry.GpuSampler()
        try:
            due = 0.0
            while sampler.available and self._proc.poll() is None:
                if time.monotonic() >= due:
                    due = time.monotonic() + every_s
                    samples = sampler.sample()
                    with self._lock:
                        self._telemetry.extend(samples)
                time.sleep(0.25)
        finally:
            sampler.close()

    def _note_workers(self) -> None:
        assert self._proc is not None
        for pid in descendants(self._proc.pid):
            if pid not in self._workers and (start := started(pid)) is not None:
                self._workers[pid] = start

    def _drain_metrics(self, folder: Path) -> None:
        for path in sorted(folder.glob(metrics.FILE_PATTERN)):
            rank = metrics.rank_of(path.name)
            if rank is None:
                continue
            with self._lock:
                if len(self._records) >= PENDING_RECORDS_MAX:
                    return  # the driver has not taken what is here yet: the rest waits in the files
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as fh:
                fh.seek(offset)
                chunk = fh.read(METRICS_READ_BYTES)
            end = chunk.rfind(b"\n") + 1  # only complete lines; a torn tail waits
            if not end:
                if len(chunk) == METRICS_READ_BYTES:  # one record past the bound: skipped
                    self._offsets[path] = offset + len(chunk)
                continue
            self._offsets[path] = offset + end
            parsed = []
            for line in chunk[:end].splitlines():
                try:
                    parsed.append((rank, json.loads(line)))
                except ValueError:
                    continue
            with self._changed:
                self._records.extend(parsed)
                self._changed.notify_all()


@dataclass
class _RankFile:
    """One of torchrun's per-rank files and how far it has been read."""

    path: Path
    local_rank: int
    stream: str  # "out" or "err"
    offset: int = 0
    partial: bytes = b""  # the start of a line whose end has not been written yet
    cut: bool = False  # a line past LINE_MAX_BYTES is being skipped to its end


def _with_node_dir(node_plan: dict[str, Any], node_dir: str) -> dict[str, Any]:
    """The plan with ``NODE_DIR`` replaced by this node's folder in its argv, env and cwd."""

    def put(text: str) -> str:
        return text.replace(NODE_DIR, node_dir)

    return {
        **node_plan,
        "cwd": put(node_plan["cwd"]) if node_plan.get("cwd") else None,
        "argv": [put(a) for a in node_plan["argv"]],
        "env": {k: put(v) for k, v in node_plan["env"].items()},
    }


def _rank_error(local_rank: int, data: dict[str, Any]) -> RankError:
    """torchelastic's error file: ``{"message": {"message", "extraInfo": {"py_callstack", "timestamp"}}}``."""
    message = data.get("message")
    if not isinstance(message, dict):
        return RankError(local_rank=local_rank, message=str(message or "unknown error"))
    extra = message.get("extraInfo") or {}
    try:
        timestamp = float(extra.get("timestamp") or 0)
    except (TypeError, ValueError):
        timestamp = 0.0
    return RankError(
        local_rank=local_rank,
        message=str(message.get("message") or "unknown error"),
        traceback=str(extra.get("py_callstack") or ""),
        timestamp=timestamp,
    )


def _prepare_reaper() -> None:
    """In the reaper's process before exec: ``_prepare_child``, and SIGTERM ignored until the
    reaper sets its handler (an ignored signal stays ignored across exec)."""
    _prepare_child()
    with contextlib.suppress(OSError):  # SIG_IGN
        ctypes.CDLL("libc.so.6", use_errno=True).signal(signal.SIGTERM, ctypes.c_void_p(1))


def _prepare_child() -> None:
    """In torchrun's process (and its reaper's) before exec: SIGTERM when the agent dies
    (``PR_SET_PDEATHSIG``), SIGINT at its default, and Ray's worker niceness undone where
    allowed (a niced trainer starves the GPUs' kernel launches)."""
    with contextlib.suppress(OSError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        libc.signal(signal.SIGINT, ctypes.c_void_p(0))  # SIG_DFL: Ray's may ignore or block it
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
