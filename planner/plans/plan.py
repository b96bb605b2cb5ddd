"""A plan: which worker holds which layers, and which path each micro-batch takes.

This is the contract between the planner and the runtime. A plan is two lists:

- ``stages``: every worker that takes part, with the contiguous layer range it holds;
- ``routes``: groups of micro-batches with the workers they visit, in layer order.

A symmetric 1F1B job is one route per pipeline. An asymmetric plan (pipelines of different
lengths or micro-batch counts) is the same thing with other numbers. Data rerouting keeps
the stages and sends a broken pipeline's micro-batches through same-stage peers of other
pipelines: just other routes. ``home`` names the pipeline whose share a micro-batch is, so
that a worker serving several pipelines can interleave them fairly. ``pipelines`` lists
the whole pipelines (for display, and for keeping them whole when re-planning).

Micro-batches are numbered 0..M-1 within a step; micro-batch k of step s always covers the
same global samples, so every layout computes the same step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from operator import itemgetter
from typing import NamedTuple


class PlanError(ValueError):
    """A plan that breaks the invariants above (a bug in whoever built it)."""


# Stages and routes are tuples: a 16k-worker plan has thousands of each, made, hashed and
# compared whenever the planner builds or caches a plan (a frozen dataclass costs several
# times more at each).
class Stage(NamedTuple):
    worker: int
    first_layer: int
    end_layer: int  # exclusive

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.first_layer


class Route(NamedTuple):
    home: int  # index of the pipeline this share belongs to
    hops: tuple[int, ...]  # workers in layer order
    micro_batches: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    num_layers: int
    num_micro_batches: int
    stages: tuple[Stage, ...]  # sorted by worker
    routes: tuple[Route, ...]
    # Whole pipelines: disjoint worker chains that cover every layer. After rerouting, a
    # pipeline that lost a worker is no longer one; its survivors still hold their stages.
    pipelines: tuple[tuple[int, ...], ...] = ()
    # A sharded data-parallel plan's replica groups, when one is not of ``shards``
    # consecutive workers (re-sharded over its survivors: planner.choice.sharded); each
    # group's workers in shard order, the groups in worker order.
    replica_groups: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        _validate(self)

    @cached_property
    def stage_of(self) -> dict[int, Stage]:
        return {s.worker: s for s in self.stages}

    @cached_property
    def derived(self) -> dict[tuple, object]:
        """What is computed from this plan and a job's constants (its gradient buckets),
        kept with it: a plan never changes, and one plan is timed, sized and compared with
        others many times over (planner.plans.program.buckets_of)."""
        return {}

    @cached_property
    def workers(self) -> tuple[int, ...]:
        return tuple(map(_worker, self.stages))

    @cached_property
    def micro_batches_of_home(self) -> dict[int, tuple[int, ...]]:
        per_home: dict[int, list[int]] = {}
        for route in self.routes:
            per_home.setdefault(route.home, []).extend(route.micro_batches)
        return {h: tuple(sorted(mbs)) for h, mbs in sorted(per_home.items())}

    def holders(self, layer: int) -> tuple[int, ...]:
        return tuple(s.worker for s in self.stages if s.first_layer <= layer < s.end_layer)

    def load(self) -> dict[int, int]:
        """Micro-batches each worker computes per step."""
        count = dict.fromkeys(self.workers, 0)
        for route in self.routes:
            for worker in route.hops:
                count[worker] += len(route.micro_batches)
        return count


_worker, _first, _end = itemgetter(0), itemgetter(1), itemgetter(2)  # a Stage's fields


def _validate(plan: Plan) -> None:
    workers = [s.worker for s in plan.stages]
    if workers != sorted(set(workers)):
        raise PlanError("stages must list each worker once, sorted by worker")
    by_worker = {s.worker: s for s in plan.stages}
    for s in plan.stages:
        if not 0 <= s.first_layer < s.end_layer <= plan.num_layers:
            raise PlanError(f"worker {s.worker} holds an empty or out-of-range layer range")
    for chain in (*(r.hops for r in plan.routes), *plan.pipelines):
        layer = 0
        for hop in chain:
            stage = by_worker.get(hop)
            if stage is None:
                raise PlanError(f"chain through worker {hop}, which holds no stage")
            if stage.first_layer != layer:
                raise PlanError(f"chain {chain} skips or repeats layers at worker {hop}")
            layer = stage.end_layer
        if layer != plan.num_layers:
            raise PlanError(f"chain {chain} does not reach the last layer")
    grouped = [w for g in plan.replica_groups for w in g]
    if plan.replica_groups and grouped != list(plan.workers):
        raise PlanError("replica groups must split the workers, in worker order")
    in_pipelines = [w for p in plan.pipelines for w in p]
    if len(in_pipelines) != len(set(in_pipelines)):
        raise PlanError("a worker is in two pipelines")
    seen: set[int] = set()
    for route in plan.routes:
        for mb in route.micro_batches:
            if mb in seen or not 0 <= mb < plan.num_micro_batches:
                raise PlanError(f"micro-batch {mb} is routed twice or is out of range")
            seen.add(mb)
    if len(seen) != plan.num_micro_batches:
        raise PlanError(f"{plan.num_micro_batches - len(seen)} micro-batches are not routed")


def rename_workers(
    plan: Plan,
    name: Mapping[int, int],
    *,
    routes: tuple[Route, ...] | None = None,
    pipelines: tuple[tuple[int, ...], ...] | None = None,
) -> Plan:
    """``plan`` with worker ``w`` renamed ``name.get(w, w)`` in its stages, routes and
    pipelines; ``routes`` or ``pipelines``, when given, replace its own (already renamed).

    A renaming that keeps the workers distinct turns a valid plan into a valid plan, so
    the result is not validated again (the simulator renames thousands of plans of 2,048
    workers); ``routes`` and ``pipelines`` given must be the plan's own under the same
    renaming, reordered or with homes and micro-batches renumbered one to one
    (planner.simulation.symmetry.canonical)."""
    get = name.get
    renamed = [get(w, w) for w in plan.workers]
    if len(set(renamed)) != len(renamed):
        raise PlanError("a renaming gave two workers one name")
    # (tuples of distinct workers sort by worker; built in C: 2,048 stages a plan)
    stages = tuple(
        sorted(
            map(
                Stage._make,
                zip(renamed, map(_first, plan.stages), map(_end, plan.stages), strict=True),
            )
        )
    )
    if routes is None:
        routes = tuple(
            Route(r.home, tuple(map(get, r.hops, r.hops)), r.micro_batches) for r in plan.routes
        )
    if pipelines is None:
        pipelines = tuple(tuple(map(get, p, p)) for p in plan.pipelines)
    return unchecked_plan(
        num_layers=plan.num_layers,
        num_micro_batches=plan.num_micro_batches,
        stages=stages,
        routes=routes,
        pipelines=pipelines,
        replica_groups=tuple(tuple(map(get, g, g)) for g in plan.replica_groups),
    )


def unchecked_plan(
    *,
    num_layers: int,
    num_micro_batches: int,
    stages: tuple[Stage, ...],
    routes: tuple[Route, ...],
    pipelines: tuple[tuple[int, ...], ...] = (),
    replica_groups: tuple[tuple[int, ...], ...] = (),
) -> Plan:
    """``Plan(...)`` not validated: for a plan derived from a valid one by a change that
    keeps it valid (a renaming, a reroute), which the simulator makes by the thousand at
    16k workers. Its maker's tests validate what it makes."""
    out = object.__new__(Plan)
    for field, value in (
        ("num_layers", num_layers),
        ("num_micro_batches", num_micro_batches),
        ("stages", stages),
        ("routes", routes),
        ("pipelines", pipelines),
        ("replica_groups", replica_groups),
    ):
        object.__setattr__(out, field, value)
    return out


def split_evenly(total: int, weights: Sequence[float]) -> list[int]:
    """Integer shares of ``total`` proportional to ``weights``, remainder to the largest
    fractional parts (ties to the lower index), so the result is deterministic."""
    weight_sum = float(sum(weights))
    exact = [total * w / weight_sum for w in weights]
    shares = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[: total - sum(shares)]:
        shares[i] += 1
    return shares


def pipelines_plan(
    *,
    num_layers: int,
    num_micro_batches: int,
    pipelines: Sequence[Sequence[int]],
    boundaries: Sequence[Sequence[int]],
    micro_batch_counts: Sequence[int],
) -> Plan:
    """A plan of independent pipelines: pipeline j is workers ``pipelines[j]`` with layer
    boundaries ``boundaries[j]`` (len = stages + 1, from 0 to num_layers) and takes the
    next ``micro_batch_counts[j]`` micro-batches. Pipelines given 0 micro-batches still
    hold their layers (they take part in the gradient all-reduce)."""
    if sum(micro_batch_counts) != num_micro_batches:
        raise PlanError("micro-batch counts do not add up to the step's micro-batches")
    stages: list[Stage] = []
    routes: list[Route] = []
    next_mb = 0
    for home, (workers, bounds, count) in enumerate(
        zip(pipelines, boundaries, micro_batch_counts, strict=True)
    ):
        if len(bounds) != len(workers) + 1:
            raise PlanError(f"pipeline {home}: {len(workers)} workers but {len(bounds) - 1} stages")
        for worker, first, end in zip(workers, bounds, bounds[1:], strict=False):
            stages.append(Stage(worker, first, end))
        routes.append(Route(home, tuple(workers), tuple(range(next_mb, next_mb + count))))
        next_mb += count
    stages.sort(key=lambda s: s.worker)
    return Plan(
        num_layers=num_layers,
        num_micro_batches=num_micro_batches,
        stages=tuple(stages),
        routes=tuple(routes),
        pipelines=tuple(tuple(p) for p in pipelines),
    )


def turn_counts(num_micro_batches: int, sizes: Sequence[int]) -> list[int] | None:
    """How many turns each replica group runs in a step (a group of ``k`` members runs
    ``k`` micro-batches a turn, one each): the fewest turns for the busiest group, the
    step covered exactly, every group one turn at least (its members' loop must see the
    step); the lower groups take the larger counts, so that whole groups alike get the
    lower ones one more (as the even deal). None if no count covers the step."""
    m, n = num_micro_batches, len(sizes)
    if not n or min(sizes) < 1:
        return None
    if len(set(sizes)) == 1:  # groups alike: the turns split evenly
        k = sizes[0]
        if m % k or m // k < n:
            return None
        return split_evenly(m // k, [1.0] * n)
    full = (1 << (m + 1)) - 1

    def reachable(most: int) -> list[int] | None:
        # reach[g]: bit r set when groups g.. can cover r micro-batches exactly, each
        # running 1..most turns
        reach = [0] * (n + 1)
        reach[n] = 1
        for g in reversed(range(n)):
            reach[g] = _turns_of(reach[g + 1], sizes[g], most, full)
        return reach if reach[0] >> m & 1 else None

    # Allowing more turns only adds sums, so the fewest turns that cover the step are
    # found by halving (a linear scan took seconds for 1,024 workers in groups of 64).
    low, high = max(1, -(-m // sum(sizes))), m
    if reachable(high) is None:
        return None
    while low < high:
        mid = (low + high) // 2
        if reachable(mid) is None:
            low = mid + 1
        else:
            high = mid
    reach = reachable(low)
    assert reach is not None
    counts, left = [], m
    for g in range(n):
        t = next(
            t for t in range(low, 0, -1)
            if left - t * sizes[g] >= 0 and reach[g + 1] >> (left - t * sizes[g]) & 1
        )  # fmt: skip
        counts.append(t)
        left -= t * sizes[g]
    return counts


def _turns_of(bits: int, size: int, most: int, mask: int) -> int:
    """The sums ``bits`` reach plus 1..``most`` turns of ``size`` micro-batches: the OR of
    ``bits << t * size`` over t, by doubling (O(log most) shifts, not ``most``)."""
    out, block, count, shift = 0, bits, 1, 0  # block: turns 0..count-1 from bits
    k = most
    while k:
        if k & 1:
            out |= block << shift * size
            shift += count
        k >>= 1
        if k:
            block = (block | (block << count * size)) & mask
            count *= 2
    return (out << size) & mask


def data_parallel(
    workers: Sequence[int],
    num_micro_batches: int,
    shards: int = 1,
    num_layers: int = 1,
    sizes: Sequence[int] = (),
) -> Plan:
    """Every worker holds the model (all ``num_layers``: the drop-in describes one), the
    step dealt as the runtime deals it (chameleon_runtime.sampler.deal): a replica group
    (``shards`` consecutive workers, or ``sizes`` when a group was re-sharded over its
    survivors) takes a turn of one micro-batch each, the groups in turn
    (``turn_counts``), so the members of a group run as many."""
    ordered = sorted(workers)
    sizes = list(sizes) or [shards] * max(1, len(ordered) // shards)
    turns = turn_counts(num_micro_batches, sizes)
    if turns is None:
        raise PlanError(f"{num_micro_batches} micro-batches are no whole turns of groups {sizes}")
    counts = [t for t, k in zip(turns, sizes, strict=True) for _ in range(k)]
    plan = pipelines_plan(
        num_layers=num_layers,
        num_micro_batches=num_micro_batches,
        pipelines=[[w] for w in ordered],
        boundaries=[[0, num_layers]] * len(ordered),
        micro_batch_counts=counts,
    )
    if any(k != shards for k in sizes):
        starts = [sum(sizes[:g]) for g in range(len(sizes))]
        groups = tuple(tuple(ordered[a : a + k]) for a, k in zip(starts, sizes, strict=True))
        plan = replace(plan, replica_groups=groups)
    return plan


def contiguous_runs(values: Iterable[int]) -> list[tuple[int, int]]:
    """[(first, end)] of maximal runs of consecutive integers, e.g. 0,1,2,5 -> (0,3),(5,6)."""
    runs: list[tuple[int, int]] = []
    for v in sorted(values):
        if runs and runs[-1][1] == v:
            runs[-1] = (runs[-1][0], v + 1)
        else:
            runs.append((v, v + 1))
    return runs
