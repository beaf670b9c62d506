"""Elastic restarts: which nodes the next attempt runs on, and the batch it runs with (pure)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from launcher.errors import SpecError
from launcher.results.rankstats import RankStats
from launcher.spec import JobSpec, NodeSpec
from launcher.spec.job import refusal_at

NODE_LOCAL_ROOTS = ("/tmp", "/dev/shm", "/run", "/var/run")  # private to each machine


class RestartRefused(Exception):
    """The next attempt cannot run; the message says why (the job ends with exit 4)."""


@dataclass(frozen=True)
class Restart:
    """One restart, as ``summary.json``'s ``restarts`` records it (the step fields filled later)."""

    attempt: int
    reason: str
    failed_node: str | None
    nodes: list[str]
    world_size: int
    resumed_from_step: int | None = None
    lost_steps: int | None = None

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def check_shared_checkpoints(job: JobSpec, nodes: list[NodeSpec]) -> None:
    """An elastic built-in job on other machines resumes from checkpoints every node must read:
    refuse (exit 2) a checkpoint folder that is private to each machine by nature."""
    ckpt = job.train.checkpoint.dir
    if not job.elastic or not job.uses_builtin or ckpt is None or all(n.is_local for n in nodes):
        return
    if any(str(ckpt) == root or str(ckpt).startswith(root + "/") for root in NODE_LOCAL_ROOTS):
        raise SpecError(
            f"train.checkpoint.dir {ckpt} is private to each machine, but an elastic job resumes on "
            f"other nodes from its last checkpoint: put it on a filesystem every node sees (NFS, "
            f"Lustre, a shared home)",
            source="job",
            field="train.checkpoint.dir",
        )


def check_enough(job: JobSpec, nodes: list[NodeSpec], reason: str) -> None:
    minimum = job.resources.min_nodes or 0
    if len(nodes) < minimum:
        raise RestartRefused(
            f"{reason}; {len(nodes)} node(s) left ({', '.join(n.name for n in nodes) or 'none'}), fewer than "
            f"resources.min_nodes={minimum}: the job cannot go on"
        )


def job_for_world(job: JobSpec, first_world: int, world: int) -> JobSpec:
    """``job`` (first run on ``first_world`` ranks) with the grad_accum that keeps its global
    batch at ``world`` ranks; a script job unchanged. RestartRefused where it does not divide."""
    if not job.uses_builtin or job.train.elastic_batch == "scale":
        return job
    micro = job.train.micro_batch
    global_batch = micro * job.train.grad_accum * first_world
    if global_batch % (micro * world):
        raise RestartRefused(
            f"the global batch of {global_batch} samples (micro_batch {micro} x grad_accum "
            f"{job.train.grad_accum} x {first_world} ranks) does not divide over {world} ranks of "
            f"micro-batch {micro}; set train.elastic_batch: scale to let it change, or choose a "
            f"micro_batch that divides it"
        )
    accum = global_batch // (micro * world)
    if accum == job.train.grad_accum:
        return job
    # Checked again: the spec's cross-checks may refuse the new grad_accum (bf16 weights need 1).
    resized = job.model_copy(update={"train": job.train.model_copy(update={"grad_accum": accum})})
    if (problem := refusal_at(resized, world)) is not None:
        raise RestartRefused(
            f"keeping the global batch of {global_batch} samples on {world} ranks needs train.grad_accum "
            f"{accum}, which the job cannot run with: {problem.rstrip('.')}. Set train.elastic_batch: scale to keep "
            f"grad_accum instead"
        )
    return resized


def with_steps(
    restarts: list[Restart], by_attempt: dict[int, dict[int, RankStats]]
) -> list[Restart]:
    """Each restart with the step it resumed from (the new attempt's ``meta`` record) and the
    steps it lost (the failed attempt's furthest step past that), where the records tell."""
    out = []
    for restart in restarts:
        resumed = _start_step(by_attempt.get(restart.attempt, {}))
        reached = _last_step(by_attempt.get(restart.attempt - 1, {}))
        lost = max(reached - resumed, 0) if resumed is not None and reached is not None else None
        out.append(replace(restart, resumed_from_step=resumed, lost_steps=lost))
    return out


def _start_step(ranks: dict[int, RankStats]) -> int | None:
    return min((s for stats in ranks.values() for s in stats.start_steps), default=None)


def _last_step(ranks: dict[int, RankStats]) -> int | None:
    steps = [s.last_int_step for s in ranks.values() if s.last_int_step is not None]
    return max(steps) if steps else None
