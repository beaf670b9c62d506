"""``launch scale``: one run per point through the normal launch path, then the study table.

One preflight (over the largest point's nodes) and one Ray session serve every point and
repeat; each run gets its own run directory inside the study directory.
"""

from __future__ import annotations

import datetime as dt
import logging
from pathlib import Path

from launcher.errors import Interrupted, JobFailed, UsageError
from launcher.orchestrate.code import plan_code
from launcher.orchestrate.ray_cluster import open_session
from launcher.orchestrate.run import Launch
from launcher.report.scaling import build_table, scale_job, write_scaling
from launcher.spec import ClusterSpec, JobSpec

log = logging.getLogger(__name__)


def scale(job: JobSpec, cluster: ClusterSpec, *, world: list[int] | None, nodes: list[int] | None,
          mode: str, repeat: int = 1, out_dir: Path | None = None, skip_parity: bool = False) -> dict:
    """Run the study; returns the scaling table. Raises JobFailed (exit 4) if any run failed."""
    if repeat < 1:
        raise UsageError(f"--repeat {repeat}: give 1 or more")
    points = _points(job, cluster, world=world, nodes=nodes)
    out_dir = out_dir or Path("runs") / f"{job.name}-scale-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M%S}"
    out_dir.mkdir(parents=True, exist_ok=True)
    widest = max(n for n, _ in points)
    used = cluster.nodes[:widest]
    base_world = points[0][0] * points[0][1]
    code = plan_code(job, list(used))

    facts = None
    probe_job = job.model_copy(update={"resources": job.resources.model_copy(update={"nodes": widest})})
    if not skip_parity:
        facts = Launch(job=probe_job, cluster=cluster, run_dir=out_dir, quiet=True).preflight()
    session = open_session(cluster, list(used), code)
    measured: list[dict] = []
    failed = 0
    try:
        for n_nodes, nproc in points:
            world_size = n_nodes * nproc
            point_job = scale_job(job, world_size, base_world, mode)
            resources = point_job.resources.model_copy(update={"nodes": n_nodes, "nproc_per_node": nproc})
            point_job = point_job.model_copy(update={"resources": resources})
            train = point_job.train
            entry = {"nodes": n_nodes, "ranks": world_size,
                     "global_batch": train.micro_batch * train.grad_accum * world_size,
                     "repeats": [], "run_dirs": []}
            for i in range(repeat):
                run_dir = out_dir / f"w{world_size}-n{n_nodes}" / f"r{i}"
                log.info("Scaling point: %d node(s) x %d = %d rank(s), repeat %d/%d",
                         n_nodes, nproc, world_size, i + 1, repeat)
                outcome = Launch(job=point_job, cluster=cluster, run_dir=run_dir, session=session,
                                 code=code, facts=facts, skip_parity=skip_parity, quiet=True).execute()
                if outcome.status == "interrupted":
                    raise KeyboardInterrupt
                if outcome.status != "succeeded":
                    failed += 1
                    log.error("point %d ranks, repeat %d failed: %s", world_size, i,
                              (outcome.failure or {}).get("reason"))
                entry["repeats"].append(outcome.summary if outcome.status == "succeeded" else None)
                entry["run_dirs"].append(str(run_dir))
            measured.append(entry)
    except KeyboardInterrupt:
        table = build_table(measured, job=job.name, mode=mode)
        write_scaling(out_dir, table)
        raise Interrupted(f"scaling study interrupted; the points measured so far are in {out_dir}") from None
    finally:
        session.close()
    table = build_table(measured, job=job.name, mode=mode)
    print(write_scaling(out_dir, table), flush=True)
    print(f"Study directory: {out_dir}", flush=True)
    if failed:
        raise JobFailed(f"{failed} run(s) of the study failed; their run directories under {out_dir} "
                        f"hold the logs and summaries")
    return table


def _points(job: JobSpec, cluster: ClusterSpec, *, world: list[int] | None,
            nodes: list[int] | None) -> list[tuple[int, int]]:
    """(nodes, workers per node) for each point, smallest first."""
    per_node = job.resources.nproc_per_node
    if nodes:
        for n in nodes:
            if n > len(cluster.nodes):
                raise UsageError(f"--nodes {n}: the cluster has {len(cluster.nodes)} node(s)")
        if per_node == "auto" and job.resources.device == "cuda":
            gpus = {node.gpus for node in cluster.nodes}
            if len(gpus) != 1 or "auto" in gpus:
                raise UsageError("--nodes with nproc_per_node auto needs every node's gpus declared "
                                 "and equal in cluster.yaml; or set resources.nproc_per_node")
            per_node = gpus.pop()
        count = 1 if per_node == "auto" else int(per_node)
        return [(n, count) for n in sorted(set(nodes))]
    assert world is not None
    out = []
    for w in sorted(set(world)):
        if len(cluster.nodes) == 1:
            out.append((1, w))
            continue
        cap = _capacity(job, cluster)
        if w <= cap:
            out.append((1, w))
        elif w % cap == 0 and w // cap <= len(cluster.nodes):
            out.append((w // cap, cap))
        else:
            raise UsageError(f"--world {w}: does not fit {len(cluster.nodes)} node(s) of {cap} "
                             f"worker(s); use multiples of {cap} up to {cap * len(cluster.nodes)}")
    return out


def _capacity(job: JobSpec, cluster: ClusterSpec) -> int:
    if isinstance(job.resources.nproc_per_node, int):
        return job.resources.nproc_per_node
    gpus = cluster.nodes[0].gpus
    if job.resources.device == "cuda" and isinstance(gpus, int):
        return gpus
    if job.resources.device == "cpu":
        return 1
    raise UsageError("--world on several nodes needs resources.nproc_per_node or the nodes' gpus "
                     "declared in cluster.yaml")
