"""The three recovery policies as candidates with a time, a memory and a transition cost.

- ``reroute``: keep the layout; same-stage peers take the failed workers' micro-batches.
  Transition: the groups that contained a failed worker, where the backend needs them
  (``planner.estimator.transition``: none on the gloo runtime, which keeps its group).
- ``reparallelize``: a new plan over the survivors from the search. Transition: plan
  search + weight and optimizer-state migration (matching + colouring schedule) + the
  groups the new plan lacks.
- ``restart``: the torchrun answer. Relaunch from the last checkpoint, on spares at the
  old size when there are enough, else on the survivors with the fastest plan the search
  finds. Transition: restart time + the work done since the checkpoint, which is redone.

Every candidate says why when it is infeasible: a stage with no surviving replica, or the
worker over its memory and by how much.

Both in-place policies also pay the recovery protocol's messages (``planner.estimator.transition.
protocol``: the survivors' reports, the plan's publication, the agreements), which on a
large job is seconds of store round trips and on a busy host milliseconds of wake-ups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from planner.estimator.estimate import Estimate
from planner.estimator.transition import groups_s, protocol
from planner.job.cost import CostModel
from planner.job.workload import Job
from planner.plans.matching import LostLayers
from planner.plans.migration import NO_MIGRATION, Migration, holdings_of, plan_migration
from planner.plans.plan import Plan, rename_workers
from planner.plans.reroute import RerouteInfeasible, reroute_plan
from planner.search.layouts import Proposal, Search


class Policy(StrEnum):
    REROUTE = "reroute"
    REPARALLELIZE = "reparallelize"
    RESTART = "restart"


@dataclass(frozen=True)
class Transition:
    search_s: float = 0.0
    migration_s: float = 0.0
    groups_s: float = 0.0  # communicators built (planner.estimator.transition)
    protocol_s: float = 0.0  # the recovery protocol's messages (planner.estimator.transition)
    restart_s: float = 0.0
    lost_work_s: float = 0.0

    @property
    def total_s(self) -> float:
        return (
            self.search_s
            + self.migration_s
            + self.groups_s
            + self.protocol_s
            + self.restart_s
            + self.lost_work_s
        )


@dataclass(frozen=True)
class Candidate:
    policy: Policy
    reason: str | None = None  # None when feasible
    plan: Plan | None = None
    estimate: Estimate | None = None
    transition: Transition = field(default_factory=Transition)
    migration: Migration = NO_MIGRATION
    label: str = ""

    @property
    def feasible(self) -> bool:
        return self.reason is None and self.estimate is not None


def overflow_reason(est: Estimate, job: Job) -> str:
    over = est.overflow
    assert over is not None
    ranks = job.ranks_of(over.worker)
    where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
    return (
        f"out of memory on worker {over.worker} ({where}): needs {over.need_bytes / 2**30:.2f} GiB, "
        f"{over.over_bytes / 2**30:.2f} GiB over its {over.limit_bytes / 2**30:.2f} GiB"
    )


def reroute_candidate(
    search: Search, current: Plan, failed: Sequence[int], *, validate: bool = True
) -> Candidate:
    """``validate``: as ``reroute_plan``'s (False only where thousands are made from
    plans known valid: the simulator)."""
    job = search.job
    try:
        plan = reroute_plan(current, failed, validate=validate)
    except RerouteInfeasible as exc:
        return Candidate(Policy.REROUTE, reason=str(exc))
    est = search.estimate(plan)
    f = job.cluster.transition_factor
    transition = Transition(
        groups_s=f * groups_s(job, current, plan, failed),
        protocol_s=f * protocol(job, plan, survivors=plan.workers, current=current).total_s,
    )
    if not est.feasible:
        return Candidate(Policy.REROUTE, reason=overflow_reason(est, job), plan=plan, estimate=est)
    return Candidate(
        Policy.REROUTE, plan=plan, estimate=est, transition=transition, label="peers take over"
    )


def reparallelize_candidates(
    search: Search,
    proposals: Sequence[Proposal],
    current: Plan,
    survivors: Sequence[int],
    *,
    failed: Sequence[int],
    search_s: float,
    migrations: tuple[Migration, ...] | str | None = None,
) -> list[Candidate]:
    """One candidate per proposal; the caller keeps the best by score. ``migrations``:
    ``migrations_for`` these proposals, where the caller has them already."""
    job = search.job
    if migrations is None:
        migrations = migrations_for(job, proposals, current, survivors)
    if isinstance(migrations, str):
        return [Candidate(Policy.REPARALLELIZE, reason=migrations)]
    out = []
    for proposal, migration in zip(proposals, migrations, strict=True):
        sources = {t.src for t in migration.transfers}
        f = job.cluster.transition_factor  # what this job's recoveries measured
        transition = Transition(
            search_s=search_s,
            migration_s=f * migration.est_time_s,
            groups_s=f * groups_s(job, current, proposal.plan, failed, members=sources),
            protocol_s=f
            * protocol(
                job,
                proposal.plan,
                survivors=survivors,
                members=sources,
                current=current,
                moved=bool(migration.transfers),
            ).total_s,
        )
        out.append(
            Candidate(
                Policy.REPARALLELIZE,
                plan=proposal.plan,
                estimate=proposal.estimate,
                transition=transition,
                migration=migration,
                label=proposal.label,
            )
        )
    if not out:
        return [Candidate(Policy.REPARALLELIZE, reason="no plan over the survivors fits in memory")]
    return out


def migrations_for(
    job: Job, proposals: Sequence[Proposal], current: Plan, survivors: Sequence[int]
) -> tuple[Migration, ...] | str:
    """Each proposal's migration from what the survivors of ``current`` hold, or why no
    re-partition can move the layers (some have no surviving holder)."""
    costs = CostModel(job)
    holdings = holdings_of(current, set(survivors))
    try:
        return tuple(plan_migration(costs, holdings=holdings, target=p.plan) for p in proposals)
    except LostLayers as exc:
        return str(exc)


def restart_candidate(
    search: Search,
    current: Plan,
    failed: Sequence[int],
    survivors: Sequence[int],
    *,
    best_over_survivors: Proposal | None,
    since_checkpoint_s: float,
    spares: Sequence[int],
) -> Candidate:
    """Every worker starts again from the last checkpoint, on the faster of two layouts:
    the current plan with spares in the failed workers' places (when there are enough),
    and ``best_over_survivors``, the fastest plan over every live worker. A restart moves
    everything anyway, so it need not keep a layout an earlier failure shrank: with only
    the first, a run that had fallen to one pipeline restarted into one pipeline at every
    later failure while the repaired workers stood idle."""
    job = search.job
    transition = Transition(restart_s=job.cluster.restart_s, lost_work_s=since_checkpoint_s)
    lost_in_plan = [w for w in failed if w in current.stage_of]
    best = best_over_survivors
    if len(spares) >= len(lost_in_plan):
        plan = rename_workers(current, dict(zip(lost_in_plan, spares, strict=False)))
        est = search.estimate(plan)
        if not lost_in_plan or all(a == b for a, b in zip(lost_in_plan, spares, strict=False)):
            label = "same workers"  # nothing lost, or the failed workers come back
        else:
            label = f"{len(lost_in_plan)} spare worker(s) replace the failed ones"
        if best is not None and (not est.feasible or best.estimate.step_s < est.step_s):
            plan, est = best.plan, best.estimate
            label = f"{len(survivors)} live workers: {best.label}"
    elif best is not None:
        plan, est = best.plan, best.estimate
        label = f"{len(survivors)} survivors: {best.label}"
    else:
        return Candidate(Policy.RESTART, reason="no plan over the survivors fits in memory")
    if not est.feasible:
        return Candidate(Policy.RESTART, reason=overflow_reason(est, job), plan=plan, estimate=est)
    return Candidate(Policy.RESTART, plan=plan, estimate=est, transition=transition, label=label)
