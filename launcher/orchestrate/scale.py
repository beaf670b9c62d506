"""``launch scale``: one run per point through the normal launch path, then the study table.

One preflight (over the largest point's nodes) and one Ray session serve every point and
repeat; each run gets its own run directory inside the study directory.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any

from launcher.errors import Interrupted, JobFailed, LauncherError, SpecError, UsageError
from launcher.orchestrate.code import plan_code
from launcher.orchestrate.ray_cluster import open_session
from launcher.orchestrate.records import Status
from launcher.orchestrate.run import Launch
from launcher.orchestrate.rundir import RunDir
from launcher.preflight import preflight_facts
from launcher.results.scaling import build_table, scale_job, write_scaling
from launcher.spec import ClusterSpec, JobSpec
from launcher.spec.fit import declared_workers
from launcher.spec.job import refusal_at
from launcher.util import utc_stamp

log = logging.getLogger(__name__)


def scale(
    job: JobSpec,
    cluster: ClusterSpec,
    *,
    world: list[int] | None,
    nodes: list[int] | None,
    mode: str,
    repeat: int = 1,
    out_dir: Path | None = None,
    skip_parity: bool = False,
) -> dict:
    """Run the study; returns the scaling table. JobFailed (exit 4) if any run failed;
    Interrupted (130) on SIGINT or SIGTERM, with the points measured so far written."""
    if repeat < 1:
        raise UsageError(f"--repeat {repeat}: give 1 or more")
    points = _points(job, cluster, world=world, nodes=nodes)
    base_world = points[0][0] * points[0][1]
    # Every point's job first: a point the job refuses is exit 2 before any point runs.
    jobs = [_point_job(job, n_nodes, nproc, base_world, mode) for n_nodes, nproc in points]
    out_dir = out_dir or Path("runs") / f"{job.name}-scale-{utc_stamp()}"
    out_dir.mkdir(parents=True, exist_ok=True)
    used = cluster.nodes[: max(n for n, _ in points)]
    code = plan_code(job, list(used))
    probe_job = job.model_copy(
        update={"resources": job.resources.model_copy(update={"nodes": len(used)})}
    )
    measured: list[dict] = []
    try:
        facts = preflight_facts(
            probe_job, cluster, skip=skip_parity, save_to=RunDir(out_dir).preflight, show=False
        )
        session = open_session(cluster, list(used), code)
        try:
            launch = partial(
                Launch,
                cluster=cluster,
                session=session,
                code=code,
                facts=facts,
                skip_parity=skip_parity,
                quiet=True,
            )
            for point_job in jobs:
                measured.append(_point(point_job, out_dir, repeat, launch))
        finally:
            session.close()
    except KeyboardInterrupt:
        write_scaling(out_dir, build_table(measured, job=job.name, mode=mode))
        raise Interrupted(
            f"scaling study interrupted; the points measured so far are in {out_dir}"
        ) from None
    table = build_table(measured, job=job.name, mode=mode)
    print(write_scaling(out_dir, table), flush=True)
    print(f"Study directory: {out_dir}", flush=True)
    failed = sum(r is None for entry in measured for r in entry["repeats"])
    if failed:
        raise JobFailed(
            f"{failed} run(s) of the study failed; their run directories under {out_dir} "
            f"hold the logs and summaries"
        )
    return table


def _point_job(job: JobSpec, n_nodes: int, nproc: int, base_world: int, mode: str) -> JobSpec:
    """The job of the point with ``n_nodes`` x ``nproc`` ranks (SpecError where it cannot be:
    the batch does not split over its ranks, or the job refuses that world size)."""
    world = n_nodes * nproc
    point_job = scale_job(job, world, base_world, mode)
    resources = point_job.resources.model_copy(update={"nodes": n_nodes, "nproc_per_node": nproc})
    point_job = point_job.model_copy(update={"resources": resources})
    # model_copy skipped the job's checks; refusal_at runs them again, with the world size.
    refusal = refusal_at(point_job, world)
    if refusal is not None:
        raise SpecError(
            f"the scaling point of {world} rank(s) ({n_nodes} node(s) x {nproc}) cannot run this job "
            f"({mode} scaling): {refusal.rstrip('.')}. Leave that point out of --world / --nodes or "
            f"change the job; no point was run",
            source="launch scale",
        )
    return point_job


def _point(point_job: JobSpec, out_dir: Path, repeat: int, launch: partial[Launch]) -> dict:
    """Every repeat of one point, each a ``launch`` (``Launch`` given all but the job and the
    run directory); a failed repeat is None in ``repeats`` (a run that failed, or one the launcher
    could not start: its run directory says why), and the study goes on."""
    n_nodes, nproc = point_job.resources.nodes, point_job.resources.nproc_per_node
    assert isinstance(n_nodes, int) and isinstance(nproc, int)
    world_size = n_nodes * nproc
    train = point_job.train
    entry: dict[str, Any] = {
        "nodes": n_nodes,
        "ranks": world_size,
        "global_batch": train.micro_batch * train.grad_accum * world_size,
        "repeats": [],
        "run_dirs": [],
    }
    for i in range(repeat):
        run_dir = out_dir / f"w{world_size}-n{n_nodes}" / f"r{i}"
        log.info(
            "Scaling point: %d node(s) x %d = %d rank(s), repeat %d/%d",
            n_nodes,
            nproc,
            world_size,
            i + 1,
            repeat,
        )
        entry["run_dirs"].append(str(run_dir))
        try:
            outcome = launch(job=point_job, run_dir=RunDir(run_dir)).execute()
        except Interrupted:
            raise KeyboardInterrupt from None
        except LauncherError as err:  # e.g. Ray could not place this point's agents
            log.error("point %d ranks, repeat %d failed: %s", world_size, i, err)
            entry["repeats"].append(None)
            continue
        if outcome.status is Status.INTERRUPTED:
            raise KeyboardInterrupt
        succeeded = outcome.status is Status.SUCCEEDED
        if not succeeded:
            reason = outcome.failure.reason if outcome.failure else "unknown"
            log.error("point %d ranks, repeat %d failed: %s", world_size, i, reason)
        entry["repeats"].append(outcome.summary if succeeded else None)
    return entry


def _points(
    job: JobSpec, cluster: ClusterSpec, *, world: list[int] | None, nodes: list[int] | None
) -> list[tuple[int, int]]:
    """(nodes, workers per node) for each point, smallest first."""
    if nodes:
        for n in nodes:
            if n > len(cluster.nodes):
                raise UsageError(f"--nodes {n}: the cluster has {len(cluster.nodes)} node(s)")
        counts = {declared_workers(job, node) for node in cluster.nodes}
        if len(counts) != 1 or None in counts:
            raise UsageError(
                "--nodes with nproc_per_node auto needs every node's gpus declared "
                "and equal in cluster.yaml; or set resources.nproc_per_node"
            )
        count = counts.pop()
        assert count is not None
        return [(n, count) for n in sorted(set(nodes))]
    assert world is not None
    if len(cluster.nodes) == 1:
        return [(1, w) for w in sorted(set(world))]
    cap = declared_workers(job, cluster.nodes[0])
    if cap is None:
        raise UsageError(
            "--world on several nodes needs resources.nproc_per_node or the nodes' gpus "
            "declared in cluster.yaml"
        )
    out = []
    for w in sorted(set(world)):
        if w <= cap:
            out.append((1, w))
        elif w % cap == 0 and w // cap <= len(cluster.nodes):
            out.append((w // cap, cap))
        else:
            raise UsageError(
                f"--world {w}: does not fit {len(cluster.nodes)} node(s) of {cap} "
                f"worker(s); use multiples of {cap} up to {cap * len(cluster.nodes)}"
            )
    return out
