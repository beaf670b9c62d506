"""A run's directory: every path in it, and every write of a file that holds environment values.

Layout (DESIGN.md): ``job.yaml``, ``cluster.yaml``, ``plan.json`` (then ``plan.attempt<N>.json``
per restart), ``preflight/<node>.json``, ``preflight/parity.txt``, ``logs/<node>/rank<R>.log``
(+ ``torchrun.log``), ``metrics/rank<R>.jsonl``, ``summary.{json,csv,txt}``; ``profile/<node>/``
with ``train.profile``. The spec copies and plans are mode 0600 with secret-looking values
masked: workers get the real values from the plan's environment, never from these files.

One run per folder: ``--run-dir`` must be new or empty (``claim``). ``launch submit`` to a head
on this machine reserves the folder for its job at once (``reserve``: ``logs/`` and a
``.launcher-job`` file naming the job id and, for the launcher's local head, that head), so a
second submission given the same folder while the first waits in the queue is refused too; the
job's driver claims it with that job id and removes the file. A reservation whose job can no
longer take it is taken over by the next run or submission given the folder (``_take_over``):
its job has ended (STOPPED, FAILED, SUCCEEDED: stopped while it waited, a runtime_env that
failed, a driver that died), the local head it went to runs no more (``launch down``, a
crash, a reboot), or its submission was cut off before that head had the job (seen only by a
submission to the same head, under its lock). Whether it has ended is asked of the Jobs API the
submission has at hand (``lookup``), else, cheaply (its process in /proc, one HTTP request;
Ray is never started for it), of this user's own local head where the reservation, a file of
this user's, names that head (``launcher.jobs.head.reserved_job_status``: what the
reservation records is compared, never used to reach anything). A job nothing can say about
keeps its reservation: the refusal names it and the remedy.

``name`` is the folder's name (the workers' ``LAUNCHER_RUN_ID``); ``run_id`` adds a random
suffix, unique to the launch, and names each node's folder ``/tmp/launcher/<run_id>/<node>``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from launcher import metrics
from launcher.errors import UsageError
from launcher.orchestrate.plan import LaunchPlan, mask_env
from launcher.util import utc_stamp, write_atomic, write_private

log = logging.getLogger(__name__)

DEFAULT_BASE = Path("runs")
RESERVED = ".launcher-job"  # a submission's reservation of its run directory: the job id
ENDED = ("STOPPED", "SUCCEEDED", "FAILED")  # Ray's statuses of a job whose driver runs no more
GONE = "GONE"  # the job's status where the Ray it was submitted to runs no more
ABANDONED = "ABANDONED"  # its submission reserved the folder and never handed Ray the job
TAKEN_OVER = (GONE, ABANDONED, *ENDED)  # a reserved job's statuses that free its folder
# A job id -> Ray's status of that job (PENDING, RUNNING, STOPPED, ...), GONE, or None: unknown.
JobLookup = Callable[[str], "str | None"]


class RunDir:
    def __init__(self, root: Path | str):
        self.root = Path(root)
        # Unique to this launch (every attempt of it): names the nodes' /tmp/launcher/<run_id>.
        self.run_id = f"{self.name or 'run'}-{secrets.token_hex(3)}"

    @classmethod
    def new(cls, job_name: str, base: Path = DEFAULT_BASE) -> RunDir:
        """``runs/<job>-<UTC yyyymmdd-HHMMSS>``, with ``-2``, ``-3``, ... where that is taken.

        The folder is made here, atomically: two launches in the same second never share one.
        UsageError (exit 2) where ``base`` cannot be written.
        """
        stem = f"{job_name}-{utc_stamp()}"
        path, n = base / stem, 1
        while True:
            try:
                path.mkdir(parents=True)
                return cls(path)
            except FileExistsError:
                n += 1
                path = base / f"{stem}-{n}"
            except OSError as err:
                raise UsageError(
                    f"cannot make a run directory in {base}: {err.strerror or err}; run from "
                    f"a folder you can write, or pass --run-dir"
                ) from err

    @classmethod
    def claim(cls, path: Path | str, *, job_id: str | None = None) -> RunDir:
        """``--run-dir PATH``: a folder that is new, or empty, and this launch's alone.

        A folder that holds anything (an earlier run's logs, metrics and summary, or other
        files) is refused with UsageError (exit 2) before anything is made or started: this
        run's records would be mixed into it. The ``logs`` folder is made here, exclusively, so
        that of two launches given the same new folder at once only one gets it. A folder that
        holds only the reservation of a job that has ended before its driver took it is taken
        over (``_take_over``).

        ``job_id``: a detached job's driver, which also takes the folder its own submission
        reserved (``reserve``: an empty ``logs/`` and the reservation naming this job), and
        removes the reservation.
        """
        path = Path(path)
        if job_id is not None and _reserved_for(path) == job_id:
            _take(path, job_id)
            return cls(path)
        taken, status = _take_over(path, None)
        if not taken:
            cls.refuse_used(path, status)
            cls._make(path)
        return cls(path)

    @classmethod
    def check_free(cls, path: Path | str) -> None:
        """``launch submit``'s look before its preflight: UsageError (exit 2) where the folder
        is used, or reserved for a job known to wait or run still. A reservation whose job has
        ended, or that cannot be asked about from here, is left to ``reserve``, which asks the
        submission's Jobs API too."""
        path = Path(path)
        found = _reservation(path)
        if found is not None and _only_reserved(path):
            status = _job_status(found, None)
            if status is not None and status not in TAKEN_OVER:
                raise _taken(path, status)
            return
        cls.refuse_used(path)

    @classmethod
    def reserve(
        cls,
        path: Path | str,
        job_id: str,
        *,
        head: dict[str, Any] | None = None,
        lookup: JobLookup | None = None,
    ) -> Callable[[], None]:
        """``launch submit`` to a head on this machine: claim the folder for job ``job_id`` now,
        while the submission holds its lock, as ``claim`` does (exit 2 for a used one), and
        leave the reservation (``.launcher-job``: the job id, and ``head``, who the launcher's
        local head the job goes to is, where it does: ``reservation_head``) that the job's
        driver takes (``claim(path,
        job_id=...)``). An ended job's reservation is taken over, asking ``lookup`` (the
        submission's Jobs API) first. Returns the undo, for a submission that fails before Ray
        has the job: the reservation goes, and the folder where this made it, holding the
        reservation locked (``_holding``) and only while it is still this job's. A reservation
        cut off half-made (an error, Ctrl-C) is undone before the error goes on."""
        path = Path(path)
        mine = Reservation(job_id, head)
        made = [p for p in (path, *path.parents) if not p.exists()]

        def undo(ours: tuple[Path, ...]) -> None:  # a folder something else was put into stays
            for gone in (*ours, *made):  # innermost first
                with contextlib.suppress(OSError):
                    if gone.name == RESERVED:
                        gone.unlink()
                    else:
                        gone.rmdir()

        def release() -> None:
            with _holding(path, job_id) as held:  # not one taken over meanwhile
                if held:
                    undo((path / RESERVED, path / "logs"))

        taken, status = _take_over(path, lookup, mine)
        if taken:
            return release
        cls.refuse_used(path, status)
        made_logs = False
        try:
            cls._make(path)
            made_logs = True
            mine.write(path)
        except BaseException as err:  # also Ctrl-C: no logs/ left without its reservation
            undo((path / RESERVED, path / "logs") if made_logs else ())
            if isinstance(err, OSError):
                raise UsageError(
                    f"cannot write the run directory {path}: {err.strerror or err}; pass "
                    f"--run-dir a folder you can write"
                ) from err
            raise
        return release

    @staticmethod
    def _make(path: Path) -> None:
        """The folder and its ``logs/``, the latter exclusively (UsageError, exit 2, where it is
        there already or cannot be made). Folders this made are removed again (where still
        empty) when it fails or is interrupted."""
        made = [p for p in (path, *path.parents) if not p.exists()]
        try:
            path.mkdir(parents=True, exist_ok=True)
            (path / "logs").mkdir()
        except BaseException as err:
            for gone in made:  # innermost first
                with contextlib.suppress(OSError):
                    gone.rmdir()
            if isinstance(
                err, FileExistsError
            ):  # another launch made it between the look and the mkdir
                raise _taken(path) from err
            if isinstance(err, OSError):
                raise UsageError(
                    f"cannot make the run directory {path}: {err.strerror or err}; pass "
                    f"--run-dir a folder you can write"
                ) from err
            raise

    @staticmethod
    def refuse_used(path: Path, status: str | None = None) -> None:
        """UsageError (exit 2) where ``path`` is a file or a folder that holds anything
        (``status``: that of the job it is reserved for, where known)."""
        try:
            if path.exists() and not path.is_dir():
                raise UsageError(
                    f"--run-dir {path} is a file, not a folder; pass --run-dir a new folder "
                    f"(it is made) or an empty one"
                )
            used = path.is_dir() and any(path.iterdir())
        except OSError as err:
            raise UsageError(
                f"cannot read the run directory {path}: {err.strerror or err}; pass --run-dir "
                f"a folder you can write"
            ) from err
        if used:
            raise _taken(path, status)

    @property
    def name(self) -> str:
        """The run's name, the folder's (``LAUNCHER_RUN_ID``); ``run_id`` is unique to a launch."""
        return Path(os.path.abspath(self.root)).name

    def __str__(self) -> str:
        return str(self.root)

    # -- paths ------------------------------------------------------------------------------

    @property
    def preflight(self) -> Path:
        return self.root / "preflight"

    def plan_file(self, attempt: int) -> Path:
        return self.root / ("plan.json" if attempt == 0 else f"plan.attempt{attempt}.json")

    def rank_log(self, node: str, rank: int | None) -> Path:
        """A rank's log, or (``rank`` None) the node's torchrun lines."""
        return (
            self.root / "logs" / node / (f"rank{rank}.log" if rank is not None else "torchrun.log")
        )

    def metrics_file(self, rank: int) -> Path:
        return self.root / metrics.SUBDIR / metrics.file_name(rank)

    def node_files(self, subdir: str, node: str) -> Path:
        """Where files fetched from a node's ``<node dir>/<subdir>`` land (e.g. profile/<node>)."""
        return self.root / subdir / node

    # -- writes -----------------------------------------------------------------------------

    def prepare(self, job: Any, cluster: Any) -> None:
        """Make the folders and record the specs (masked, 0600). UsageError (exit 2) where the
        folder cannot be made or written (a file in the way, no permission, a full disk)."""
        try:
            for sub in ("logs", metrics.SUBDIR, "preflight"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
            write_private(self.root / "job.yaml", spec_yaml(job))
            write_private(self.root / "cluster.yaml", spec_yaml(cluster))
        except OSError as err:
            raise UsageError(
                f"cannot write the run directory {self.root}: {err.strerror or err} "
                f"({err.filename or self.root}); pass --run-dir a folder you can write"
            ) from err

    def write_plan(self, launch_plan: LaunchPlan) -> Path:
        path = self.plan_file(launch_plan.attempt)
        write_private(path, json.dumps(launch_plan.to_json(), indent=2) + "\n")
        return path


# -- reservations -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Reservation:
    """What ``.launcher-job`` holds: the job id (its first line) and, for a job submitted to the
    launcher's local head, that head (``launcher.jobs.head.reservation_head``), as JSON on the
    second. Readable by all (no secret in it): a job's driver may run as another user than its
    submitter (an attached Ray someone else started on this machine). ``owner`` and ``file``
    are not written: read back (``_reservation``), the uid owning the file (None where it has
    more than one link: maybe another's file linked in) and its (device, inode)."""

    job_id: str
    head: dict[str, Any] | None = None
    owner: int | None = field(default=None, compare=False)
    file: tuple[int, int] | None = field(default=None, compare=False)

    def write(self, path: Path) -> None:
        extra = json.dumps({"head": self.head}, separators=(",", ":")) + "\n" if self.head else ""
        write_atomic(path / RESERVED, self.job_id + "\n" + extra)

    @classmethod
    def parse(cls, text: str) -> Reservation | None:
        first, _, rest = text.partition("\n")
        if not first.strip():
            return None
        head = None
        with contextlib.suppress(ValueError, AttributeError):
            head = json.loads(rest).get("head") if rest.strip() else None
        return cls(first.strip(), head if isinstance(head, dict) else None)


MAX_RESERVATION = 64 * 1024


def _open_reservation(path: Path) -> int:
    """A read-only descriptor of ``path``'s reservation, a regular file (OSError otherwise: none,
    unreadable, a symlink, a FIFO, never waited on)."""
    fd = os.open(path / RESERVED, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path / RESERVED))
    return fd


def _read_reservation(path: Path) -> tuple[bytes, os.stat_result]:
    """The reservation file's bytes and its stat (of the file read, not of the name)."""
    with os.fdopen(_open_reservation(path), "rb") as fh:
        return fh.read(MAX_RESERVATION), os.fstat(fh.fileno())


def _reservation(path: Path) -> Reservation | None:
    """The reservation a submission left in ``path``, if any (None also where it cannot be read),
    with the file's owner and identity."""
    try:
        data, st = _read_reservation(path)
        found = Reservation.parse(data.decode())
    except (OSError, UnicodeDecodeError):
        return None
    if found is None:
        return None
    return replace(
        found, owner=st.st_uid if st.st_nlink == 1 else None, file=(st.st_dev, st.st_ino)
    )


def _reserved_for(path: Path) -> str | None:
    """The job id a submission reserved ``path`` for, if any."""
    found = _reservation(path)
    return found.job_id if found is not None else None


def _only_reserved(path: Path) -> bool:
    """``path`` holds a reservation and nothing else: the file and an empty ``logs/``."""
    try:
        names = {p.name for p in path.iterdir()}
        logs = path / "logs"
        return (
            RESERVED in names
            and names <= {RESERVED, "logs"}
            and ("logs" not in names or (logs.is_dir() and not any(logs.iterdir())))
        )
    except OSError:
        return False


def _job_status(found: Reservation, lookup: JobLookup | None) -> str | None:
    """Where the reservation's job stands: ``lookup``'s answer (the Jobs API at hand), else that
    of the local head the reservation names, where it is this user's own
    (``launcher.jobs.head.reserved_job_status``: ``GONE`` where it runs no more, ``ABANDONED``
    where the submission never handed it the job); None where neither can say."""
    status = lookup(found.job_id) if lookup is not None else None
    if status is None and found.head is not None:
        from launcher.jobs.head import reserved_job_status

        status = reserved_job_status(found.head, found.job_id, owner=found.owner)
    return status


@contextlib.contextmanager
def _holding(path: Path, job_id: str, file: tuple[int, int] | None = None) -> Iterator[bool]:
    """The reservation of ``path`` for ``job_id``, locked (flock on the file): True while it is
    still that one (the same file, naming that job; with ``file``, the file of that (device,
    inode), the one read before). Of the job's driver, a later run taking over the reservation
    of the job, ended, and its submission releasing it, only one acts on it: the others find it
    gone or replaced."""
    with contextlib.ExitStack() as stack:
        try:  # read-only: the job's driver may not own the file
            fh = stack.enter_context(os.fdopen(_open_reservation(path), "rb"))
        except OSError:
            yield False
            return
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            here, now = os.fstat(fh.fileno()), os.lstat(path / RESERVED)
            found = Reservation.parse(fh.read(MAX_RESERVATION).decode())
            same = (
                (here.st_dev, here.st_ino) == (now.st_dev, now.st_ino)
                and (file is None or file == (here.st_dev, here.st_ino))
                and found is not None
                and found.job_id == job_id
            )
        except (OSError, UnicodeDecodeError):
            same = False
        yield same  # the lock goes with the file's closing


def _take(path: Path, job_id: str) -> None:
    """The job's driver takes the folder its submission reserved: the reservation goes."""
    try:
        with _holding(path, job_id) as held:
            if not held:  # taken over meanwhile (this job was taken for ended)
                raise _taken(path)
            rest = {p.name for p in path.iterdir()} - {RESERVED, "logs"}
            logs = path / "logs"
            if rest or (logs.is_dir() and any(logs.iterdir())):
                raise UsageError(
                    f"--run-dir {path} was reserved for this job when it was submitted, and files "
                    f"have been put into it since ({', '.join(sorted(rest)) or 'logs/'}): a run "
                    f"directory holds one run. Submit again with a new folder for --run-dir; "
                    f"nothing was started"
                )
            (path / RESERVED).unlink()
            logs.mkdir(exist_ok=True)
    except OSError as err:
        raise UsageError(
            f"cannot take the run directory {path}: {err.strerror or err}; pass "
            f"--run-dir a folder you can write"
        ) from err


def _take_over(
    path: Path, lookup: JobLookup | None, mine: Reservation | None = None
) -> tuple[bool, str | None]:
    """Take ``path`` where it holds only the reservation of a job that can no longer take it:
    the job has ended (its driver never took the folder: stopped while it waited, a runtime_env
    that failed), the local head it was submitted to runs no more, or its submission never
    handed that head the job (``ABANDONED``). The reservation goes
    (``mine`` None: a run of this process's own) or becomes ``mine`` (a submission). (taken,
    the reserved job's status where it was asked); not taken where the folder is not such a
    one, its job may still take it, or another process took it first."""
    found = _reservation(path)
    if found is None or not _only_reserved(path):
        return False, None
    status = _job_status(found, lookup)
    if status not in TAKEN_OVER:
        return False, status
    try:
        with _holding(path, found.job_id, found.file) as held:
            if not held or not _only_reserved(path):
                return False, None
            (path / "logs").mkdir(exist_ok=True)
            if mine is None:
                (path / RESERVED).unlink()
            else:
                mine.write(path)
    except OSError as err:
        raise UsageError(
            f"cannot take the run directory {path}: {err.strerror or err}; pass "
            f"--run-dir a folder you can write"
        ) from err
    why = (
        "whose Ray runs no more"
        if status == GONE
        else "whose submission was cut off before Ray had the job"
        if status == ABANDONED
        else f"which ended ({status}) before its driver took it"
    )
    log.info(
        "--run-dir %s was reserved for job %s, %s: this %s takes the folder",
        path,
        found.job_id,
        why,
        "run" if mine is None else "submission",
    )
    return True, status


def _taken(path: Path, status: str | None = None) -> UsageError:
    job_id = _reserved_for(path)
    if job_id is not None:
        where = (
            f"and still {status.lower()} (`launch status {job_id}`)"
            if status is not None
            else f"(waiting, running, or it ended on a Ray this command cannot ask; `launch status {job_id}`)"
        )
        return UsageError(
            f"--run-dir {path} is reserved for job {job_id}, submitted before with the same --run-dir "
            f"{where}: a run directory holds one run. Pick a new folder for --run-dir (or leave it "
            f"out), or remove {path} first if that job has ended and you no longer need it; nothing "
            f"was started"
        )
    try:
        _read_reservation(path)
    except FileNotFoundError:
        pass
    except OSError as err:  # there, and not readable by this user (or not a plain file)
        return UsageError(
            f"--run-dir {path} is reserved by a submission, and user {_user()} cannot read "
            f"{path / RESERVED} to tell for which job ({err.strerror or err}; a job's driver runs "
            f"as the user that started the cluster's Ray): a run directory holds one run. Pick a "
            f"new folder for --run-dir, one that user can write, or remove {path} first if that "
            f"job has ended; nothing was started"
        )
    try:
        entries = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    except OSError:
        entries = []
    shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
    return UsageError(
        f"--run-dir {path} is not empty ({shown or 'another launch took it'}): a run directory holds "
        f"one run, and this launch's logs, metrics and summary would be mixed into what is there. Pick "
        f"a new folder for --run-dir (or leave it out: runs/<job>-<time> is made), or remove {path} "
        f"first if you no longer need it; nothing was started"
    )


def _user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def spec_yaml(model: Any) -> str:
    """A spec as YAML for run records, every ``env`` mapping's secret-looking values masked."""
    return yaml.safe_dump(_mask_envs(model.model_dump(mode="json")), sort_keys=False)


def _mask_envs(data: Any) -> Any:
    if isinstance(data, dict):
        return {
            k: (mask_env(v) if k == "env" and isinstance(v, dict) else _mask_envs(v))
            for k, v in data.items()
        }
    if isinstance(data, list):
        return [_mask_envs(v) for v in data]
    return data
