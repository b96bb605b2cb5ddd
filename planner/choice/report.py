"""A decision as data: the pydantic model behind ``chameleon plan --json`` and the
launcher's "plan chosen" events. Built once from a ``Decision``; renderers read only this.
"""

from __future__ import annotations

from pydantic import BaseModel

from planner.choice.policy import Candidate
from planner.choice.risk import restart_share
from planner.choice.selection import Decision
from planner.job.workload import Job
from planner.plans.migration import Migration
from planner.plans.plan import Plan


class StageOut(BaseModel):
    worker: int
    ranks: list[int]
    node: int
    first_layer: int
    end_layer: int  # exclusive


class PipelineOut(BaseModel):
    stages: list[StageOut]
    micro_batches: int


class RouteOut(BaseModel):
    """Micro-batches of a broken pipeline that go through other pipelines' workers."""

    home: int
    hops: list[int]
    micro_batches: int


class LayoutOut(BaseModel):
    num_workers: int
    pipelines: list[PipelineOut]
    rerouted: list[RouteOut]


class TransitionOut(BaseModel):
    search_s: float
    migration_s: float
    groups_s: float
    protocol_s: float
    restart_s: float
    lost_work_s: float


class MigrationOut(BaseModel):
    bytes: int
    transfers: int
    rounds: int
    est_time_s: float
    naive_est_time_s: float


class CandidateOut(BaseModel):
    policy: str
    feasible: bool
    reason: str | None
    label: str
    step_time_s: float | None
    throughput_vs_failure_free: float | None
    peak_memory_bytes: int | None
    memory_limit_bytes: int
    transition_s: float | None
    transition: TransitionOut | None
    # The next failure's expected cost beyond an in-place recovery (planner.choice.risk), and
    # the share of next failures that would force a restart with this layout (by
    # themselves, or by a failure inside their recovery).
    risk_s: float | None
    restart_share: float | None
    score: float | None
    migration: MigrationOut


class ChosenOut(BaseModel):
    policy: str
    label: str
    step_time_s: float
    transition_s: float
    score: float
    layout: LayoutOut


class DecisionReport(BaseModel):
    failed: list[int]  # device ranks
    failed_workers: list[int]
    failure_free_step_time_s: float
    mtbf_s: float
    mtbf_source: str
    chosen: ChosenOut | None
    candidates: list[CandidateOut]
    migration: MigrationOut  # of the chosen candidate (zero unless it moves weights)
    search_ms: float  # the reparallelize plan search
    decision_ms: float  # every policy evaluated and one chosen
    templates_ms: float  # templates and shape ranking, prepared at job start


def layout_of(job: Job, plan: Plan) -> LayoutOut:
    """Whole pipelines with their own micro-batches; routes through other pipelines'
    workers (rerouted shares of broken pipelines) listed apart."""
    stage_of = plan.stage_of
    whole = set(plan.pipelines)
    own = {r.hops: len(r.micro_batches) for r in plan.routes if r.hops in whole}
    pipelines = [
        PipelineOut(
            stages=[
                StageOut(
                    worker=w,
                    ranks=list(job.ranks_of(w)),
                    node=job.node_of(w),
                    first_layer=stage_of[w].first_layer,
                    end_layer=stage_of[w].end_layer,
                )
                for w in workers
            ],
            micro_batches=own.get(workers, 0),
        )
        for workers in plan.pipelines
    ]
    rerouted = [
        RouteOut(home=r.home, hops=list(r.hops), micro_batches=len(r.micro_batches))
        for r in plan.routes
        if r.micro_batches and r.hops not in whole
    ]
    return LayoutOut(num_workers=len(plan.stages), pipelines=pipelines, rerouted=rerouted)


def migration_out(migration: Migration) -> MigrationOut:
    return MigrationOut(
        bytes=migration.num_bytes,
        transfers=len(migration.transfers),
        rounds=migration.num_rounds,
        est_time_s=migration.est_time_s,
        naive_est_time_s=migration.naive_est_time_s,
    )


def _candidate_out(job: Job, decision: Decision, c: Candidate) -> CandidateOut:
    est = c.estimate
    feasible = c.feasible
    base = decision.baseline.step_s
    t = c.transition
    return CandidateOut(
        policy=c.policy.value,
        feasible=feasible,
        reason=c.reason,
        label=c.label,
        step_time_s=est.step_s if est else None,
        throughput_vs_failure_free=(base / est.step_s) if est else None,
        peak_memory_bytes=est.peak_memory_bytes if est else None,
        memory_limit_bytes=job.worker_memory_bytes,
        transition_s=t.total_s if feasible else None,
        transition=TransitionOut(
            search_s=t.search_s,
            migration_s=t.migration_s,
            groups_s=t.groups_s,
            protocol_s=t.protocol_s,
            restart_s=t.restart_s,
            lost_work_s=t.lost_work_s,
        )
        if feasible
        else None,
        risk_s=decision.risk_s(job, c) if feasible else None,
        restart_share=(
            restart_share(
                job, c.plan, mtbf_s=decision.outlook.mtbf_s, node_share=decision.outlook.node_share
            )
            if feasible and c.plan
            else None
        ),
        score=decision.score(job, c) if feasible else None,
        migration=migration_out(c.migration),
    )


def report(
    job: Job, decision: Decision, *, failed_ranks: list[int], templates_s: float = 0.0
) -> DecisionReport:
    chosen = decision.chosen
    chosen_out = None
    if chosen is not None and chosen.plan is not None and chosen.estimate is not None:
        chosen_out = ChosenOut(
            policy=chosen.policy.value,
            label=chosen.label,
            step_time_s=chosen.estimate.step_s,
            transition_s=chosen.transition.total_s,
            score=decision.score(job, chosen),
            layout=layout_of(job, chosen.plan),
        )
    return DecisionReport(
        failed=sorted(failed_ranks),
        failed_workers=list(decision.failed),
        failure_free_step_time_s=decision.baseline.step_s,
        mtbf_s=decision.mtbf_s,
        mtbf_source=decision.mtbf_source,
        chosen=chosen_out,
        candidates=[_candidate_out(job, decision, c) for c in decision.candidates],
        migration=migration_out(chosen.migration)
        if chosen is not None
        else migration_out(Migration((), (), 0.0, 0.0)),
        search_ms=decision.search_s * 1000,
        decision_ms=decision.decision_s * 1000,
        templates_ms=templates_s * 1000,
    )
