"""Policy selection by expected throughput until the next failure.

    score(p) = (B / t_step(p)) * exp(-t_transition(p) / D)

B is the global batch (samples per step), D the mean time between failures. With failures
arriving at random (a Poisson process, so the time T to the next one is exponential with
mean D), a policy trains for T - t_transition if T outlasts its transition and not at all
otherwise, so it expects B / t_step * E[max(0, T - t_transition)] = B / t_step * D *
exp(-t_transition / D) samples before the next failure; over E[T] = D that is the score.
PAPER.md's (D - t_transition) / D is its first-order form, which goes negative when the
transition outlasts D and then prefers the slower step; this one never does. As D -> 0
the cheapest transition wins, as D -> infinity the fastest step (docs/planner.md).

That alone sees one failure ahead. A candidate also leaves a layout for the failure after
it: one that keeps a single holder of some layer turns the next loss of that worker (or
its node) into a checkpoint restart. ``planner.choice.risk`` prices that as the next failure's
expected cost beyond an in-place recovery, ``risk_s``, charged as a transition is:

    score(p) = (B / t_step(p)) * exp(-(t_transition(p) + risk_s(p)) / D)

so a faster layout that a single loss would wreck wins only when failures are rare enough
for its speed to pay for the restart it risks. The highest score wins; ties go to the least disruptive policy (reroute, then reparallelize,
then restart). ``decide`` is the planner's single entry point: pure but for the clock it
is handed, which times the search because search time is part of the transition.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import astuple as dataclass_astuple
from dataclasses import dataclass, replace

from planner.choice.policy import (
    Candidate,
    Policy,
    migrations_for,
    reparallelize_candidates,
    reroute_candidate,
    restart_candidate,
)
from planner.choice.risk import risk_s
from planner.choice.sharded import (
    lost_rows_reason,
    plan_groups,
    ranks_text,
    regrow,
    reshard,
    turns_reason,
    uneven_reason,
)
from planner.estimator.estimate import Estimate
from planner.job.workload import Job
from planner.plans.migration import Migration
from planner.plans.plan import Plan, data_parallel, turn_counts
from planner.search.layouts import Proposal, Search
from planner.search.reference import exhaustive

_PREFERENCE = {Policy.REROUTE: 0, Policy.REPARALLELIZE: 1, Policy.RESTART: 2}


def score(
    *,
    global_batch: float,
    step_s: float,
    transition_s: float,
    mtbf_s: float,
    risk_s: float = 0.0,
) -> float:
    """Expected samples per second until the next failure, less the next failure's risk
    (module doc)."""
    return (global_batch / step_s) * math.exp(-(transition_s + risk_s) / mtbf_s)


# Grow only when the expected throughput until the next failure improves by this much.
GROW_MARGIN = 0.01


def worth_growing(
    *,
    current_s: float,
    grown_s: float,
    transition_s: float,
    mtbf_s: float,
    current_risk_s: float = 0.0,
    grown_risk_s: float = 0.0,
) -> bool:
    """Whether to take workers back in (replacements that rejoined, repaired nodes):
    samples per second until the next failure, staying versus moving, where moving costs
    the transition once, then runs at the grown step time; each side also pays the risk
    its layout takes at the next failure (planner.choice.risk), so a growth never trades a
    third replica for a faster step the next failure would make a restart. ``chameleon
    run`` judges a growth so (launcher/calibration.py), and ``chameleon simulate`` at a
    repair."""
    if grown_s <= 0 or current_s <= 0:
        return False
    stay = score(
        global_batch=1.0, step_s=current_s, transition_s=0.0, mtbf_s=mtbf_s, risk_s=current_risk_s
    )
    grow = score(
        global_batch=1.0,
        step_s=grown_s,
        transition_s=transition_s,
        mtbf_s=mtbf_s,
        risk_s=grown_risk_s,
    )
    return grow > stay * (1 + GROW_MARGIN)


def growth_choice(
    job: Job,
    current: Plan,
    current_s: float,
    candidates: Sequence[Candidate],
    outlook: Outlook,
    *,
    risk: bool = True,
) -> Candidate | None:
    """The layout to grow into, of ``candidates`` (re-partitions over every live worker):
    the best-scoring one, risk included, when moving there beats staying on ``current``
    (its step ``current_s``; ``worth_growing``); None to stay. ``risk=False``: scored on
    speed and transition alone (Oobleck's growth, in the simulator)."""
    feasible = [c for c in candidates if c.feasible and c.estimate is not None and c.plan]
    if risk:
        best = max(feasible, key=lambda c: log_score(job, c, outlook), default=None)
    else:
        best = min(feasible, key=lambda c: c.estimate.step_s, default=None)  # type: ignore[union-attr]
    if best is None:
        return None
    assert best.estimate is not None
    grown = worth_growing(
        current_s=current_s,
        grown_s=best.estimate.step_s,
        transition_s=best.transition.total_s,
        mtbf_s=outlook.mtbf_s,
        current_risk_s=layout_risk_s(job, current, outlook) if risk else 0.0,
        grown_risk_s=candidate_risk_s(job, best, outlook) if risk else 0.0,
    )
    return best if grown else None


# Up to this many workers the launch times every shape (63 on 8 workers: 0.04 s; 8,348 on
# 32: 27 s, too long to keep a job waiting).
EXHAUSTIVE_LAUNCH_WORKERS = 12


def launch_choice(job: Job, workers: Sequence[int], outlook: Outlook) -> Proposal | None:
    """The layout to start on (``Trainer(pipeline_stages="auto")``): of the layouts the
    search proposes over every worker, the best score with no transition (nothing
    moves: each worker builds its own layers, or loads them from the checkpoint) and the
    risk the layout takes at the first failure, as a restart picks its layout
    (``restart_variants``). None when no layout fits. On a small cluster every shape is
    timed, not only those the search's ranking keeps (on the 2-core test bed the ranking
    left out the fastest, two pipelines of three stages: 0.2937 s against 0.2981 s)."""
    search = Search(job)
    proposals = search.propose(None, workers)
    if len(workers) <= EXHAUSTIVE_LAUNCH_WORKERS:  # once per job: time every shape
        proposals += exhaustive(search, None, workers)
    batch = job.training.global_batch_size

    def launch_score(p: Proposal) -> float:  # log_score's, with no transition
        risk = layout_risk_s(job, p.plan, outlook, restarted=True)
        return math.log(batch / p.estimate.step_s) - risk / outlook.mtbf_s

    return max(proposals, key=launch_score, default=None)


@dataclass(frozen=True)
class Outlook:
    """What the planner expects of the failures to come: D; the work since the last
    checkpoint now (None: half the interval); the share of failures that take a whole
    node (None: Llama 3's mix; planner.job.failures.FailureRate.node_share learns it)."""

    mtbf_s: float
    since_checkpoint_s: float | None = None
    node_share: float | None = None


def layout_risk_s(job: Job, plan: Plan, outlook: Outlook, *, restarted: bool = False) -> float:
    """``planner.choice.risk.risk_s`` of ``plan`` as ``outlook`` sees the failures to come;
    ``restarted``: it starts from a checkpoint, so the checkpoint interval starts again."""
    if restarted:
        since = 0.0
    elif outlook.since_checkpoint_s is None:
        since = job.training.checkpoint_interval_s / 2
    else:
        since = outlook.since_checkpoint_s
    return risk_s(
        job, plan, mtbf_s=outlook.mtbf_s, since_checkpoint_s=since, node_share=outlook.node_share
    )


def candidate_risk_s(job: Job, candidate: Candidate, outlook: Outlook) -> float:
    """``layout_risk_s`` of the layout ``candidate`` leaves (a restart starts the
    checkpoint interval again)."""
    if not candidate.feasible or candidate.plan is None:
        return 0.0
    return layout_risk_s(job, candidate.plan, outlook, restarted=candidate.policy is Policy.RESTART)


def candidate_score(job: Job, candidate: Candidate, outlook: Outlook) -> float:
    if not candidate.feasible:
        return float("-inf")
    assert candidate.estimate is not None
    return score(
        global_batch=job.training.global_batch_size,
        step_s=candidate.estimate.step_s,
        transition_s=candidate.transition.total_s,
        mtbf_s=outlook.mtbf_s,
        risk_s=candidate_risk_s(job, candidate, outlook),
    )


def log_score(job: Job, candidate: Candidate, outlook: Outlook) -> float:
    """The log of ``candidate_score``, which orders candidates the same way: at a D far
    below every transition the scores themselves underflow to 0 and would all tie."""
    if not candidate.feasible:
        return float("-inf")
    assert candidate.estimate is not None
    rate = job.training.global_batch_size / candidate.estimate.step_s
    risk = candidate_risk_s(job, candidate, outlook)
    return math.log(rate) - (candidate.transition.total_s + risk) / outlook.mtbf_s


def choose(job: Job, candidates: Sequence[Candidate], outlook: Outlook) -> Candidate | None:
    feasible = [c for c in candidates if c.feasible]
    if not feasible:
        return None
    return max(feasible, key=lambda c: (log_score(job, c, outlook), -_PREFERENCE[c.policy]))


def best_bounded(
    bounded: Iterable[tuple[float, Callable[[], Candidate | None]]],
    key: Callable[[Candidate], float],
    *,
    above: float = -math.inf,
) -> Candidate | None:
    """``max(made, key=key)`` (the first of the highest key) over the candidates that
    ``bounded`` would make, in order, each given with an upper bound on its key; but one
    is made only when its bound reaches the best key so far, so a candidate that could
    not be that first is never made (a re-partition's migration costs far more than its
    bound). ``above``: a key the caller already has elsewhere; the best is returned only
    if it reaches it (None otherwise), and no candidate whose bound is below it is made.
    The answer is ``max``'s over them all whenever that reaches ``above``."""
    best, best_key = None, -math.inf
    for bound, make in bounded:
        if bound < best_key or bound < above:
            continue
        c = make()
        if c is None:
            continue
        k = key(c)
        if best is None or k > best_key:
            best, best_key = c, k
    return best if best is not None and best_key >= above else None


def restart_variant(restart: Candidate, layout: Proposal) -> Candidate | None:
    """``restart`` on ``layout`` instead (``restart_variants``); None where that is the
    restart's own layout."""
    if layout.plan == restart.plan:
        return None
    return Candidate(
        Policy.RESTART,
        plan=layout.plan,
        estimate=layout.estimate,
        transition=restart.transition,
        migration=restart.migration,
        label=f"{len(layout.plan.workers)} live workers: {layout.label}",
    )


def restart_variants(restart: Candidate, repartitions: Sequence[Candidate]) -> list[Candidate]:
    """A restart may start on any layout the search proposed over the live workers, not
    only the fastest (``planner.choice.policy.restart_candidate``): restarting into a layout
    that one more loss would wreck can score below a slightly slower one that keeps a
    copy of every layer (planner.choice.risk). Each costs the restart's transition."""
    if not restart.feasible:  # no restarts left, or no layout fits
        return [restart]
    variants = [restart]
    for c in repartitions:
        if c.feasible and c.plan is not None and c.estimate is not None:
            variant = restart_variant(restart, Proposal(c.plan, c.estimate, c.label))
            if variant is not None:
                variants.append(variant)
    return variants


@dataclass(frozen=True)
class Options:
    """Every candidate for one failure, before D picks among them."""

    reroute: Candidate
    reparallelize: tuple[Candidate, ...]  # one per proposal of the search
    restart: Candidate
    search_s: float


@dataclass(frozen=True)
class Searched:
    """The search over the survivors: its proposals, its time, and each proposal's
    migration (or why none can move): all of a re-partition's cost but its protocol's."""

    proposals: tuple[Proposal, ...]
    search_s: float
    migrations: tuple[Migration, ...] | str


def search_repartitions(
    search: Search,
    current: Plan,
    survivors: Sequence[int],
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> Searched:
    # A re-partition charges its search, which only it needs (rerouting's plan takes a
    # few milliseconds and is made whatever is chosen, so it charges none).
    t0 = clock()
    proposals = tuple(search.propose(current, survivors)) if survivors else ()
    search_s = clock() - t0
    return Searched(proposals, search_s, migrations_for(search.job, proposals, current, survivors))


def reparallelize_options(
    search: Search,
    current: Plan,
    failed: Sequence[int],
    survivors: Sequence[int],
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[tuple[Candidate, ...], Proposal | None, float]:
    """A re-partition candidate per proposal of the search over ``survivors``, the
    fastest proposal (what a restart over the survivors would run) and the search's
    time. (The simulator asks for these one layout at a time, only those that could be
    chosen: planner.simulation.answers.)"""
    searched = search_repartitions(search, current, survivors, clock=clock)
    options = reparallelize_candidates(
        search, searched.proposals, current, survivors, failed=failed,
        search_s=searched.search_s, migrations=searched.migrations,
    )  # fmt: skip
    return tuple(options), fastest_proposal(searched.proposals), searched.search_s


def fastest_proposal(proposals: Sequence[Proposal]) -> Proposal | None:
    """The proposal a restart over the survivors runs, and Oobleck moves to: the fastest
    (the first of equal ones)."""
    return min(proposals, key=lambda p: p.estimate.step_s, default=None)


def gather(
    search: Search,
    current: Plan,
    failed: Sequence[int],
    survivors: Sequence[int],
    *,
    since_checkpoint_s: float,
    spares: Sequence[int],
    clock: Callable[[], float] = time.perf_counter,
) -> Options:
    """Every policy's candidates for the loss of ``failed`` (``decide`` chooses among
    them; the simulator asks for the parts it needs, the same way)."""
    lost = set(failed)
    reparallelize, fastest, search_s = reparallelize_options(
        search, current, failed, survivors, clock=clock
    )
    restart = restart_candidate(
        search,
        current,
        failed,
        survivors,
        best_over_survivors=fastest,
        since_checkpoint_s=since_checkpoint_s,
        spares=[s for s in spares if s not in lost],
    )
    return Options(reroute_candidate(search, current, failed), reparallelize, restart, search_s)


def sharded_options(
    search: Search, current: Plan, failed: Sequence[int], survivors: Sequence[int], options: Options
) -> Options:
    """A sharded model (HSDP, planner.choice.sharded): rerouting drops every replica group
    that lost a member (its survivors wait, idle) and deals the step to the groups left,
    as many micro-batches to each member of a group (its members step in lockstep);
    re-parallelizing either re-shards each broken group over its survivors or takes back
    the whole groups out of the plan whose members all live, healed shard by shard (the
    better of the two by score, as a pipeline's re-partition variants)."""
    job = search.job
    shards, m = job.training.shards, job.training.num_micro_batches
    lost = set(failed)
    groups = plan_groups(current, shards)
    kept_groups = [g for g in groups if not lost & set(g)]
    dropped = sorted(w for g in groups if lost & set(g) for w in g)
    kept = [w for g in kept_groups for w in g]
    sizes = [len(g) for g in kept_groups]
    layers = current.num_layers
    reason = lost_rows_reason(current, shards, failed)
    if reason is None and not kept:
        reason = uneven_reason(0, m, shards)
    if reason is None and all(k == shards for k in sizes):
        reason = uneven_reason(len(kept), m, shards)
    if reason is None and turn_counts(m, sizes) is None:
        reason = turns_reason(m, sizes)
    if reason is not None:
        reroute = Candidate(Policy.REROUTE, reason=reason)
    else:
        # the groups left take the step as the runtime deals it (planner.choice.sharded)
        whole = data_parallel(current.workers, m, shards, layers, [len(g) for g in groups])
        reroute = reroute_candidate(search, whole, dropped)
        if reroute.feasible:
            plan = data_parallel(kept, m, shards, layers, sizes)
            reroute = replace(reroute, plan=plan, estimate=search.estimate(plan))
            broken = len(groups) - len(kept_groups)
            label = (
                f"drop {broken} replica group(s) of {ranks_text(dropped)}"
                if dropped
                else "keep groups"
            )
            reroute = replace(reroute, label=label)
    variants = [reshard(search, current, failed)]
    if kept:
        base = data_parallel(kept, m, shards, layers, sizes) if turn_counts(m, sizes) else None
        alive = sorted(set(kept) | (set(survivors) - lost))
        if base is not None:
            variants.append(regrow(search, base, alive))
    return replace(options, reroute=reroute, reparallelize=tuple(variants))


@dataclass(frozen=True)
class Decision:
    failed: tuple[int, ...]  # workers
    baseline: Estimate  # the current plan before the failure
    candidates: tuple[Candidate, ...]  # best of each policy, in policy order
    chosen: Candidate | None
    mtbf_s: float
    mtbf_source: str
    search_s: float  # the reparallelize plan search
    decision_s: float  # every policy evaluated and one chosen
    outlook: Outlook  # D and what else the scores saw of the failures to come

    def score(self, job: Job, candidate: Candidate) -> float:
        return candidate_score(job, candidate, self.outlook)

    def risk_s(self, job: Job, candidate: Candidate) -> float:
        """What the layout ``candidate`` leaves risks at the next failure (planner.choice.risk)."""
        return candidate_risk_s(job, candidate, self.outlook)


def decide(
    job: Job,
    current: Plan,
    failed: Sequence[int],
    *,
    policy: Policy | None = None,
    mtbf_s: float | None = None,
    mtbf_source: str = "--mtbf",
    since_checkpoint_s: float | None = None,
    spares: Sequence[int] | None = None,
    idle: Sequence[int] = (),
    search: Search | None = None,
    clock: Callable[[], float] = time.perf_counter,
    restarts_left: int | None = None,
    node_share: float | None = None,
) -> Decision:
    """Evaluate every policy for the loss of ``failed`` workers and pick one.

    ``policy`` forces a policy (its candidate is chosen if feasible). ``mtbf_s`` is D,
    from ``mtbf_source`` (default: the job's, over the survivors' devices). ``spares`` are idle
    workers a restart may use (default: the cluster's spare nodes). ``since_checkpoint_s``
    is the work a restart would redo (default: half the checkpoint interval). ``search``
    may be one kept from earlier decisions of the same job (its templates are reused).
    ``restarts_left``: how many restarts the launcher may still make (None: unbounded);
    with none left a restart is not a candidate. ``node_share``: of failures, the share
    that take a whole node (default: Llama 3's mix; the run's posterior where it has one).
    ``idle`` are live workers the current plan leaves unused (left over by an earlier
    re-partition, or replacements that rejoined): they hold no state, and a re-partition
    or restart may use them.
    """
    started = clock()
    lost = set(failed)
    survivors = [w for w in current.workers if w not in lost]
    survivors += [w for w in idle if w not in lost and w not in survivors]
    if mtbf_s is None:
        mtbf_s, mtbf_source = dataclass_astuple(job.mtbf(len(survivors)))
    mtbf = mtbf_s
    if spares is None:
        spares = range(job.num_workers, job.num_workers + job.num_spare_workers)
    since = (
        job.training.checkpoint_interval_s / 2 if since_checkpoint_s is None else since_checkpoint_s
    )
    search = search if search is not None else Search(job)
    baseline = search.estimate(current)
    options = gather(
        search, current, failed, survivors, since_checkpoint_s=since, spares=spares, clock=clock
    )
    if job.training.shards > 1:
        options = sharded_options(search, current, failed, survivors, options)
    reroute, restart = options.reroute, options.restart
    if restarts_left is not None and restarts_left <= 0:
        restart = Candidate(Policy.RESTART, reason="no restarts left (--max-restarts)")
    outlook = Outlook(mtbf, since, node_share)
    restart = max(
        restart_variants(restart, options.reparallelize), key=lambda c: log_score(job, c, outlook)
    )
    reparallelize = max(options.reparallelize, key=lambda c: log_score(job, c, outlook))
    search_s = options.search_s
    candidates = (reroute, reparallelize, restart)
    if policy is None:
        chosen = choose(job, candidates, outlook)
    else:
        forced = next(c for c in candidates if c.policy is policy)
        chosen = forced if forced.feasible else None
    return Decision(
        failed=tuple(sorted(lost)),
        baseline=baseline,
        candidates=candidates,
        chosen=chosen,
        mtbf_s=mtbf,
        mtbf_source=mtbf_source,
        search_s=search_s,
        decision_s=clock() - started,
        outlook=outlook,
    )
