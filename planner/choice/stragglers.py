"""Planning around slow workers (Job.slow): stay, deal them fewer micro-batches, leave
them out as spares, or give them fewer layers, whichever trains the most samples over
the time the slowdown is expected to last.

    samples(option) = B / t_step(option) * max(0, H - t_in - t_out)

B is the global batch, H the horizon (how long the slowdown is expected to last), t_in
the transition to the option's plan and t_out the one back to the even plan when the
worker has its speed again (staying pays neither). A move is taken only when it beats
staying by ``MARGIN``: a slowdown that comes and goes faster than a move pays for (H
short) moves nothing, so a flapping worker does not make the job oscillate. The options:

- **stay**: the current plan, every step waiting for the slow worker;
- **uneven deal**: the same layers on the same workers, each pipeline (a worker, in data
  parallel) dealt micro-batches in proportion to its speed; nothing moves, only the
  plan (what the drop-in and the Trainer run on the next generation);
- **leave out**: the slow workers as spares, their micro-batches taken over by their
  peers (``reroute_plan``: a failure's reroute, with nothing lost), available only
  where each of their stages has a replica;
- **re-partition**: each pipeline with a slow worker split again so that the slow
  stages take fewer layers (``resplit_plan``), then dealt by speed; its layers move
  there and back (``plan_migration``), besides the groups and protocol.

Every option's step is the estimator's, at each worker's own speed. Pure: a job, a plan
and a horizon in, the options out.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace

from planner.estimator.estimate import Estimate, estimate
from planner.estimator.transition import groups_s, protocol
from planner.job.cost import CostModel
from planner.job.workload import Job
from planner.plans.migration import holdings_of, plan_migration
from planner.plans.partition import Partitioner
from planner.plans.plan import Plan, PlanError, pipelines_plan
from planner.plans.reroute import RerouteInfeasible, reroute_plan

# A move must train this much more over the horizon than staying (as a growth must:
# planner.choice.selection.GROW_MARGIN, larger here because the speed it is judged on is
# measured over a few steps).
MARGIN = 0.05


@dataclass(frozen=True)
class SlowOption:
    name: str  # "stay", "uneven deal", "leave out", "re-partition"
    plan: Plan | None = None
    estimate: Estimate | None = None
    transition_s: float = 0.0  # to move there and, once the slowdown ends, back
    samples: float = 0.0  # trained over the horizon
    reason: str | None = None  # why it is not possible; None when it is
    label: str = ""
    back_s: float = 0.0  # of transition_s, the move back

    @property
    def feasible(self) -> bool:
        return self.reason is None and self.estimate is not None


@dataclass(frozen=True)
class SlowChoice:
    slow: tuple[tuple[int, float], ...]
    horizon_s: float
    # the current layout dealt evenly, without the slowdown: the failure-free step (the
    # running plan's own, where it is not whole pipelines). A deal made again is told
    # against this, not against the running uneven deal at full speed, which its most
    # loaded worker bounds (that read as "failure-free" and overstated each gain)
    even_step_s: float
    options: tuple[SlowOption, ...]
    chosen: SlowOption

    @property
    def stay(self) -> SlowOption:
        return self.options[0]


def deal(total: int, per_mb_s: Sequence[float], fill: Sequence[int] = ()) -> list[int]:
    """``total`` micro-batches over pipelines that take ``per_mb_s[j]`` a micro-batch at
    their slowest stage and ``fill[j]`` micro-batches' time to fill and drain (stages - 1):
    one to each (a pipeline with none is better left out, the other option, and a
    drop-in member with none would never run its loop body), then each in turn to the
    one that would finish it first, which makes the slowest finish as early as such a
    deal can (a pipeline's time grows by the same step with each one)."""
    if total < len(per_mb_s):
        raise PlanError(f"{total} micro-batches cannot give each of {len(per_mb_s)} pipelines one")
    fill = list(fill) or [0] * len(per_mb_s)
    counts = [1] * len(per_mb_s)
    total -= len(per_mb_s)
    heap = [((fill[j] + 2) * s, j) for j, s in enumerate(per_mb_s)]
    heapq.heapify(heap)
    for _ in range(total):
        _, j = heapq.heappop(heap)
        counts[j] += 1
        heapq.heappush(heap, ((fill[j] + counts[j] + 1) * per_mb_s[j], j))
    return counts


# How far from the even deal toward ``deal``'s the uneven plan is tried: on devices the
# whole way pays; on hosts whose workers share cores the others may have no core to spare
# for what the slow one gives up, and part of the way is best (the estimator says which).
STEPS_TOWARD_DEAL = (0.25, 0.5, 0.75, 1.0)


def uneven_plan(job: Job, current: Plan) -> Plan:
    """``current``'s layers on its workers, micro-batches dealt by speed: ``deal``'s
    counts, or part of the way there from the even ones, whichever the estimator times
    fastest. Raises PlanError where the plan is not whole pipelines (a reroute's shares)
    or its groups run turns (a sharded model's members run as many micro-batches each)."""
    if job.training.shards > 1:
        raise PlanError("a sharded model's replica groups run whole turns: dealt evenly")
    even = even_plan(current)
    costs = CostModel(job)
    stage_of = current.stage_of
    per_mb = [
        max(
            costs.forward_s(stage_of[w].first_layer, stage_of[w].end_layer, w)
            + costs.backward_s(stage_of[w].first_layer, stage_of[w].end_layer, w)
            for w in pipeline
        )
        for pipeline in current.pipelines
    ]
    target = deal(current.num_micro_batches, per_mb, [len(p) - 1 for p in current.pipelines])
    start = [len(r.micro_batches) for r in even.routes]
    tried: dict[tuple[int, ...], Plan] = {}
    for t in STEPS_TOWARD_DEAL:
        counts = _between(start, target, t)
        if tuple(counts) != tuple(start) and tuple(counts) not in tried:
            tried[tuple(counts)] = _dealt(current, counts)
    if not tried:
        return even
    return min(tried.values(), key=lambda plan: estimate(job, plan).step_s)


def resplit_plan(job: Job, current: Plan) -> Plan:
    """``current``'s workers in their places, each pipeline with a slow worker split
    again so that its slow stages take fewer layers (``Partitioner.fastest_at_speeds``),
    then dealt micro-batches by speed (``uneven_plan``). Raises PlanError where that
    changes no split (one stage per pipeline: data parallel, or nothing faster fits),
    where the plan is not whole pipelines, or where a sharded model's groups run turns."""
    _whole_pipelines(current)
    slowdown = job.slowdown
    partitioner = Partitioner(CostModel(job), replicated=len(current.pipelines) > 1)
    stage_of = current.stage_of
    bounds, moved = [], False
    for pipeline in current.pipelines:
        now = (*(stage_of[w].first_layer for w in pipeline), current.num_layers)
        factors = [slowdown(w) for w in pipeline]
        split = (
            partitioner.fastest_at_speeds(factors)
            if len(pipeline) > 1 and max(factors) > 1.0
            else None
        )
        if split is not None and _slowest(split.boundaries, factors, partitioner) < (
            _slowest(now, factors, partitioner) - 1e-12
        ):
            bounds.append(split.boundaries)
            moved = True
        else:
            bounds.append(now)
    if not moved:
        raise PlanError(
            "no pipeline's split is faster at these speeds (one stage each, or no faster "
            "split fits)"
        )
    even = even_plan(current)
    resplit = pipelines_plan(
        num_layers=current.num_layers,
        num_micro_batches=current.num_micro_batches,
        pipelines=current.pipelines,
        boundaries=bounds,
        micro_batch_counts=[len(r.micro_batches) for r in even.routes],
    )
    return uneven_plan(job, resplit)


def _slowest(bounds: Sequence[int], factors: Sequence[float], partitioner: Partitioner) -> float:
    """A split's slowest stage at the stages' speeds (what ``fastest_at_speeds`` minimises):
    a split no faster than the current one is not worth its layers' move."""
    return max(
        f * partitioner.stage_time(a, b)
        for f, a, b in zip(factors, bounds, bounds[1:], strict=False)
    )


def _layers(first: int, end: int) -> str:
    return f"layer {first}" if end - first == 1 else f"layers {first}-{end - 1}"


def _between(start: Sequence[int], end: Sequence[int], t: float) -> list[int]:
    """Counts a fraction ``t`` of the way from ``start`` to ``end`` (same total; the
    largest remainders rounded up)."""
    exact = [a + t * (b - a) for a, b in zip(start, end, strict=True)]
    counts = [int(x) for x in exact]
    order = sorted(range(len(exact)), key=lambda j: (counts[j] - exact[j], j))
    for j in order[: sum(start) - sum(counts)]:
        counts[j] += 1
    return counts


def _dealt(current: Plan, counts: Sequence[int]) -> Plan:
    stage_of = current.stage_of
    return pipelines_plan(
        num_layers=current.num_layers,
        num_micro_batches=current.num_micro_batches,
        pipelines=current.pipelines,
        boundaries=[
            [stage_of[w].first_layer for w in p] + [current.num_layers] for p in current.pipelines
        ],
        micro_batch_counts=counts,
    )


def _whole_pipelines(plan: Plan) -> None:
    if len(plan.routes) != len(plan.pipelines) or any(
        r.hops != p for r, p in zip(plan.routes, plan.pipelines, strict=True)
    ):
        raise PlanError("the plan is not whole pipelines (peers took a lost worker's share)")


def even_plan(current: Plan) -> Plan:
    """``current``'s layers on its workers, micro-batches dealt evenly again (the first
    ``M mod n`` pipelines one more, as the drop-in's sampler deals them): the way back
    from ``uneven_plan`` once the slow workers have their speed back. Raises PlanError
    where the plan is not whole pipelines."""
    _whole_pipelines(current)
    n, total = len(current.pipelines), current.num_micro_batches
    return _dealt(current, [total // n + (j < total % n) for j in range(n)])


def _evened(current: Plan) -> Plan:
    try:
        return even_plan(current)
    except PlanError:
        return current


def break_even_s(choice: SlowChoice, margin: float = MARGIN) -> float | None:
    """The shortest horizon over which the best move beats staying by ``margin``, read
    off a choice made over any horizon (samples are linear in it: a move trains
    B / t_new * (H - t_move), staying B / t_stay * H); None when no move ever does."""
    stay = choice.stay.estimate
    if stay is None:
        return None
    best = None
    for option in choice.options[1:]:
        if not option.feasible:
            continue
        new = option.estimate.step_s  # type: ignore[union-attr]
        gain = 1.0 - (1.0 + margin) * new / stay.step_s
        if gain > 0:
            h = option.transition_s / gain
            best = h if best is None else min(best, h)
    return best


def dealt_unevenly(plan: Plan) -> bool:
    """Whether ``plan`` is whole pipelines some of which take two or more micro-batches
    fewer than others: a plan made around slow workers. A balanced deal is not, whoever
    takes the odd ones (a failure's reroute deals a lost worker's share so)."""
    try:
        _whole_pipelines(plan)
    except PlanError:
        return False
    counts = [len(r.micro_batches) for r in plan.routes]
    return bool(counts) and max(counts) - min(counts) > 1


def straggler_choice(
    job: Job,
    current: Plan,
    horizon_s: float,
    *,
    margin: float = MARGIN,
    leave_out: bool = True,
    repartition: bool = True,
) -> SlowChoice:
    """The options for ``job.slow`` on ``current`` over ``horizon_s`` (module doc).
    ``leave_out=False``: not that option (a live run cannot yet see a spare's speed come
    back, so it could not tell when to take the worker in again). ``repartition=False``:
    not that one (a live run does not yet move layers around a slow worker)."""
    even = replace(job, slow=())
    batch = job.training.global_batch_size
    factor = job.cluster.transition_factor
    slow_workers = [w for w, f in job.slow if f > 1.0 and w in current.stage_of]

    def option(
        name: str, plan: Plan, moves: tuple[float, float] = (0.0, 0.0), label: str = ""
    ) -> SlowOption:
        est = estimate(job, plan)
        if not est.feasible:
            return SlowOption(name, plan, est, reason="does not fit in memory", label=label)
        moved = sum(moves)
        left = max(0.0, horizon_s - moved)
        return SlowOption(
            name, plan, est, moved, batch / est.step_s * left, label=label, back_s=moves[1]
        )

    def move_s(
        plan: Plan, left_out: Sequence[int] = (), *, layers: bool = False
    ) -> tuple[float, float]:
        """There and back: groups and protocol each way, and with ``layers`` the
        migration of the layers that change hands (otherwise nothing moves: every worker
        keeps its layers)."""
        costs, every = CostModel(job), set(current.workers)

        def one_way(start: Plan, end: Plan, out: Sequence[int]) -> float:
            moving = (
                plan_migration(costs, holdings=holdings_of(start, every), target=end).est_time_s
                if layers
                else 0.0
            )
            return (
                moving
                + groups_s(job, start, end, out)
                + protocol(job, end, survivors=every, current=start, moved=layers).total_s
            )

        return factor * one_way(current, plan, left_out), factor * one_way(plan, current, ())

    options = [option("stay", current, label="every step waits for it")]
    try:
        plan = uneven_plan(job, current)
        counts = {w: c for w, c in plan.load().items() if w in slow_workers}
        label = ", ".join(f"worker {w}: {c} of {plan.num_micro_batches}" for w, c in counts.items())
        options.append(option("uneven deal", plan, move_s(plan), label))
    except PlanError as exc:
        options.append(SlowOption("uneven deal", reason=str(exc)))
    try:
        if not leave_out:
            raise RerouteInfeasible("not taken by a live run (a spare's speed is not measured)")
        if not slow_workers:
            raise RerouteInfeasible("no slow worker in the plan")
        plan = reroute_plan(current, slow_workers)
        label = f"{', '.join(map(str, slow_workers))} as spare(s), peers take over"
        options.append(option("leave out", plan, move_s(plan, slow_workers), label))
    except RerouteInfeasible as exc:
        options.append(SlowOption("leave out", reason=str(exc)))
    try:
        if not repartition:
            raise PlanError("not taken by a live run (it does not move layers around one yet)")
        plan = resplit_plan(job, current)
        changed = [
            f"worker {w}: " + _layers(s.first_layer, s.end_layer)
            for w in slow_workers
            if (s := plan.stage_of[w]) != current.stage_of[w]
        ]
        label = ", ".join(changed) or "its peers' layers split again"
        options.append(option("re-partition", plan, move_s(plan, layers=True), label))
    except PlanError as exc:
        options.append(SlowOption("re-partition", reason=str(exc)))
    stay = options[0]
    best = max((o for o in options if o.feasible), key=lambda o: o.samples, default=stay)
    chosen = best if best.samples > stay.samples * (1 + margin) else stay
    return SlowChoice(
        slow=job.slow,
        horizon_s=horizon_s,
        even_step_s=estimate(even, _evened(current)).step_s,
        options=tuple(options),
        chosen=chosen,
    )
