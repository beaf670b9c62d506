"""The ``launch`` command: parse, build, run, report. No logic of its own.

Exit codes: 0 ok · 2 invalid input · 3 preflight failed · 4 job failed · 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Collection, Sequence
from pathlib import Path

from launcher import __version__, console, signals
from launcher.errors import EXIT_INTERRUPTED, EXIT_INVALID_INPUT, LauncherError, UsageError
from launcher.util import setup_logging

log = logging.getLogger("launcher")

# Commands that act: a reader of their output that goes away changes nothing of what they do
# (what they print from then on is dropped, ``console.ReaderMayGo``).
WORKING_COMMANDS = frozenset(
    {"run", "submit", "scale", "tokenize", "export", "fetch", "stop", "up", "down"}
)
CLUSTER_HELP = "cluster spec (default: ./cluster.yaml, else this machine)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code. A command that only shows something ends quietly when
    its stdout's reader goes (``launch list | head -1``); see ``WORKING_COMMANDS``."""
    console.open_closed_streams()
    command = None
    try:
        args = _parse(argv)
        if isinstance(args, int):  # --help, --version, a bad command line
            code = args
        else:
            command = args.command
            code = _run(args)
    except BrokenPipeError:
        if command in WORKING_COMMANDS or not console.stdout_reader_gone():
            raise  # not stdout's: not ours to hide
        console.to_devnull(sys.stdout)
        return 0
    try:
        if sys.stdout is not None:
            sys.stdout.flush()  # here, not at exit: a closed pipe is then still ours to handle
    except BrokenPipeError:  # the command has ended; the last of its output had no reader
        console.to_devnull(sys.stdout)
    return code


def _parse(argv: Sequence[str] | None) -> argparse.Namespace | int:
    """The command line's arguments, or the exit code of a command line that ends here."""
    try:
        parser, commands = _parser()
        args = list(sys.argv[1:] if argv is None else argv)
        return parser.parse_args(_with_command(args, commands))
    except SystemExit as exit_:
        return int(exit_.code or 0) and EXIT_INVALID_INPUT


def _run(args: argparse.Namespace) -> int:
    with console.reader_may_go() if args.command in WORKING_COMMANDS else contextlib.nullcontext():
        setup_logging(args.debug)  # its handler writes to the sys.stderr of this moment
        with signals.installed():
            try:
                return int(args.func(args) or 0)
            except LauncherError as err:
                if args.debug:
                    log.exception("%s", type(err).__name__)
                print(f"error: {err}", file=sys.stderr, flush=True)
                return err.exit_code
            except KeyboardInterrupt:
                print("error: interrupted", file=sys.stderr, flush=True)
                return EXIT_INTERRUPTED


# -- commands -------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from launcher.orchestrate.run import dry_run, run

    if args.detach:
        return cmd_submit(args)
    job, cluster = _load(args)
    with _allocated(job, cluster, args) as cluster:
        if args.dry_run:
            print(dry_run(job, cluster, skip_parity=args.skip_parity))
            return 0
        from launcher.jobs.head import attach_to_local_head

        cluster = attach_to_local_head(cluster, job)
        run(
            job, cluster, run_dir=args.run_dir, skip_parity=args.skip_parity, keep_ray=args.keep_ray
        )
    return 0


@contextlib.contextmanager
def _allocated(job, cluster, args: argparse.Namespace):  # noqa: ANN001, ANN202
    """A ``slurm:`` cluster with the nodes of its allocation (the launcher's own, released
    after); any other cluster as it is."""
    if cluster.slurm is None:
        yield cluster
        return
    from launcher.orchestrate.slurm import allocation
    from launcher.spec import check_fits

    with allocation(job, cluster) as allocated:
        check_fits(job, allocated, job_source=args.job)
        yield allocated


# -- detached jobs (launcher/jobs) --------------------------------------------------------------


def cmd_submit(args: argparse.Namespace) -> int:
    from launcher.jobs import batch, commands

    if args.dry_run:
        return cmd_plan(args)
    job, cluster = _load(args)
    cluster_file = args.cluster or ("cluster.yaml" if Path("cluster.yaml").is_file() else None)
    common = {"run_dir": args.run_dir, "skip_parity": args.skip_parity, "as_json": args.json}
    if cluster.slurm is None:
        commands.submit(job, cluster, cluster_file=cluster_file, **common)
        return 0
    assert cluster_file is not None  # a slurm: cluster comes from a file
    overrides = list(args.set or [])
    batch.submit(
        job, cluster, job_file=args.job, cluster_file=cluster_file, overrides=overrides, **common
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from launcher.jobs import batch, commands

    cluster = _load_cluster(args)
    if cluster.slurm is not None:
        return batch.status(args.job_id, as_json=args.json)
    return commands.status(cluster, args.job_id, as_json=args.json)


def cmd_list(args: argparse.Namespace) -> int:
    from launcher.jobs import batch, commands

    cluster = _load_cluster(args)
    if cluster.slurm is not None:
        return batch.list_jobs(as_json=args.json)
    return commands.list_jobs(cluster, as_json=args.json)


def cmd_logs(args: argparse.Namespace) -> int:
    from launcher.jobs import batch, commands

    if args.rank is not None or args.node is not None or Path(args.job_id).is_dir():
        from launcher.results.logs import rank_logs

        if args.follow:
            raise UsageError("--follow streams a job's driver output; leave out --rank and --node")
        print(rank_logs(_run_dir_of(args), rank=args.rank, node=args.node), end="")
        return 0
    cluster = _load_cluster(args)
    if cluster.slurm is not None:
        return batch.logs(args.job_id, follow=args.follow)
    return commands.logs(cluster, args.job_id, follow=args.follow)


def cmd_doctor(args: argparse.Namespace) -> int:
    from launcher.results.doctor import doctor_command

    return doctor_command(str(_run_dir_of(args)), as_json=args.json)


def _run_dir_of(args: argparse.Namespace) -> Path:
    """``job_id`` as given: a run directory, else a detached job's, fetched from its head."""
    if Path(args.job_id).is_dir():
        return Path(args.job_id)
    from launcher.jobs.commands import fetch

    return fetch(_load_cluster(args), args.job_id, to=None)


def cmd_stop(args: argparse.Namespace) -> int:
    from launcher.jobs import batch, commands

    cluster = _load_cluster(args)
    if cluster.slurm is not None:
        return batch.stop(args.job_id)
    return commands.stop(cluster, args.job_id)


def cmd_fetch(args: argparse.Namespace) -> int:
    from launcher.jobs.commands import fetch

    fetch(_load_cluster(args), args.job_id, to=args.to)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from launcher.jobs.commands import up

    return up(_load_cluster(args))


def cmd_down(args: argparse.Namespace) -> int:
    from launcher.jobs.commands import down

    return down(_load_cluster(args), yes=args.yes)


def cmd_plan(args: argparse.Namespace) -> int:
    from launcher.orchestrate.run import dry_run

    job, cluster = _load(args)
    print(dry_run(job, cluster, skip_parity=args.skip_parity))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from launcher.preflight import check_command

    return check_command(args.cluster, args.job, fast=args.fast, as_json=args.json)


def cmd_scale(args: argparse.Namespace) -> int:
    from launcher.orchestrate.scale import scale

    if bool(args.world) == bool(args.nodes):
        raise UsageError("launch scale needs exactly one of --world 1,2,4 or --nodes 1,2")
    job, cluster = _load(args)
    scale(
        job,
        cluster,
        world=args.world,
        nodes=args.nodes,
        mode=args.mode,
        repeat=args.repeat,
        out_dir=args.out,
        skip_parity=args.skip_parity,
    )
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from launcher.results.summary import report_command

    code = report_command(args.run_dir, fmt=args.format)
    if args.plot:
        from launcher.results.runplot import plot_run

        print(f"Plot: {plot_run(Path(args.run_dir))}")
    return code


def cmd_export(args: argparse.Namespace) -> int:
    from launcher.export import export_run

    for path in export_run(args.run_dir, out=args.out, step=args.step):
        print(path)
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    from launcher.spec import load_job
    from launcher.train.text import tokenize_command

    return tokenize_command(load_job(args.job, args.set), source=args.job)


def cmd_schema(args: argparse.Namespace) -> int:
    from launcher.spec import ClusterSpec, JobSpec

    model = JobSpec if args.which == "job" else ClusterSpec
    print(json.dumps(model.model_json_schema(), indent=2))
    return 0


# -- parsing --------------------------------------------------------------------------------


def _load(args: argparse.Namespace):  # noqa: ANN202
    from launcher.spec import check_fits, load_cluster, load_job

    job = load_job(args.job, args.set)
    cluster = load_cluster(args.cluster)
    if cluster.slurm is None:  # a Slurm cluster's nodes are known once allocated
        check_fits(job, cluster, job_source=args.job)
    elif args.command not in ("run", "submit"):
        raise UsageError(
            f"launch {args.command} does not take a slurm: cluster; run the job "
            f"(launch JOB.yaml) or submit it (launch submit JOB.yaml)"
        )
    return job, cluster


def _load_cluster(args: argparse.Namespace):  # noqa: ANN202
    from launcher.spec import load_cluster

    return load_cluster(args.cluster)


def _with_command(args: list[str], commands: Collection[str]) -> list[str]:
    """``launch [--debug] JOB.yaml ...`` is ``launch [--debug] run JOB.yaml ...``: ``run`` goes
    before the first argument that is neither an option nor a command."""
    first = next((i for i, a in enumerate(args) if not a.startswith("-")), None)
    if first is not None and args[first] not in commands:
        return [*args[:first], "run", *args[first:]]
    return args


def _parser() -> tuple[argparse.ArgumentParser, Collection[str]]:
    """The parser, and its command names."""
    # --debug before or after the command; the command's copy has no default, so that it does
    # not overwrite a --debug given before the command
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show tracebacks and debug logs",
    )

    parser = argparse.ArgumentParser(
        prog="launch",
        description="Check environment parity on every node, then run torchrun everywhere "
        "through Ray and report per-rank throughput. `launch JOB.yaml` = `launch run JOB.yaml`.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument("--version", action="version", version=f"launch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def flag(p: argparse.ArgumentParser, name: str, help: str) -> None:
        p.add_argument(name, action="store_true", help=help)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        """A command's parser; ``cmd_<name>`` runs it (looked up now: tests replace it)."""
        p = sub.add_parser(name, parents=[common], help=help)
        p.set_defaults(func=globals()[f"cmd_{name}"])
        return p

    def sets(p: argparse.ArgumentParser, example: str) -> None:
        help = f"override a job field, e.g. --set {example} (repeatable)"
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=help)

    def job_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("job", help="job spec (YAML)")
        p.add_argument("--cluster", help=CLUSTER_HELP)
        sets(p, "train.steps=50")
        flag(p, "--skip-parity", "skip the preflight parity check (GPU counts from cluster.yaml)")

    p = command("run", "preflight, then launch the job (the default)")
    job_args(p)
    flag(p, "--dry-run", "print the plan and start nothing")
    p.add_argument("--run-dir", type=Path, help="put this run's directory exactly here")
    flag(p, "--keep-ray", "leave a Ray cluster the launcher started running")
    flag(p, "--detach", "submit it as a detached job (= launch submit)")
    flag(p, "--json", "with --detach: print {job_id, name, cluster, run_dir}")

    p = command("submit", "preflight here, then run the job detached on the cluster's Ray Jobs")
    job_args(p)
    flag(p, "--dry-run", "print the plan and submit nothing")
    p.add_argument(
        "--run-dir", type=Path, help="the run directory on the head (default runs/<job id>)"
    )
    flag(p, "--json", "print {job_id, name, cluster, run_dir}")

    def jobs_parser(name: str, help: str, *, job_id: str = "required") -> argparse.ArgumentParser:
        """A job command: the job id (``required``, ``optional`` or ``none``) and --cluster."""
        p = command(name, help)
        if job_id != "none":
            p.add_argument(
                "job_id",
                nargs="?" if job_id == "optional" else None,
                help="the job id `launch submit` printed",
            )
        p.add_argument("--cluster", help=CLUSTER_HELP)
        return p

    p = jobs_parser("status", "a detached job's state (all jobs without ID)", job_id="optional")
    flag(p, "--json", "print the state as JSON")
    p = jobs_parser("list", "the launcher's detached jobs, newest first", job_id="none")
    flag(p, "--json", "print the jobs as JSON")
    p = jobs_parser("logs", "a detached job's driver output")
    p.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="stream until the job ends (Ctrl-C stops following, not the job)",
    )
    p.add_argument("--rank", type=int, help="that rank's output (ID may be a run directory)")
    p.add_argument("--node", help="that node's ranks' output, each line marked with its rank")
    p = jobs_parser("doctor", "what made a run slow, most costly first (ID or a run directory)")
    flag(p, "--json", "print the findings as JSON")
    jobs_parser("stop", "stop a detached job as Ctrl-C stops a foreground run")
    p = jobs_parser("fetch", "copy a detached job's run directory from the head here")
    p.add_argument("--to", type=Path, help="where to put it (default runs/<job id>)")
    jobs_parser(
        "up",
        "start the launcher's Ray on this machine: detached jobs and runs attach",
        job_id="none",
    )
    p = jobs_parser("down", "stop the Ray the launcher started for detached jobs", job_id="none")
    flag(p, "--yes", "also stop jobs that still run")

    p = command("plan", "preflight and the exact per-node commands; starts nothing")
    job_args(p)

    p = command("check", "environment parity table of the cluster's nodes")
    p.add_argument("--cluster", help=CLUSTER_HELP)
    p.add_argument("--job", help="also check what this job needs (GPUs, interfaces)")
    flag(p, "--fast", "skip the torch/CUDA/cuDNN/NCCL checks")
    flag(p, "--json", "print the report as JSON")

    p = command("scale", "scaling study: one run per point")
    job_args(p)
    p.add_argument("--world", type=_int_list, help="total ranks per point, e.g. 1,2,4,8")
    p.add_argument("--nodes", type=_int_list, help="nodes per point, e.g. 1,2,4")
    p.add_argument(
        "--mode",
        choices=("weak", "strong"),
        default="weak",
        help="weak: keep the per-rank batch; strong: keep the global batch",
    )
    p.add_argument(
        "--repeat", type=int, default=1, help="runs per point (median and min are reported)"
    )
    p.add_argument("--out", type=Path, help="study directory (default runs/<job>-scale-<time>)")

    p = command("report", "re-render a finished run's (or study's) tables")
    p.add_argument("run_dir", help="a run directory or a scaling study directory")
    p.add_argument("--format", choices=("table", "json", "csv"), default="table")
    flag(p, "--plot", "a run: steps.png, loss and tokens/s per rank (plot extra)")

    p = command("export", "a run's checkpoint as a Hugging Face model folder")
    p.add_argument("run_dir", type=Path, help="the run directory (holds job.yaml)")
    p.add_argument(
        "--step", type=int, help="the checkpoint's step (default: the latest complete one)"
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="the folder to write config.json and model.safetensors to",
    )

    p = command("tokenize", "tokenize a job's text data into the cache, ahead of a run")
    p.add_argument("job", help="job spec (YAML) with data.source text")
    sets(p, "data.path=more.txt")

    p = command("schema", "JSON Schema of the job or cluster spec")
    p.add_argument("which", choices=("job", "cluster"))
    return parser, sub.choices


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,2,4")
    return values


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
