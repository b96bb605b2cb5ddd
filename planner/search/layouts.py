"""Dynamic re-parallelisation: the fast plan search (PAPER.md, planner).

Given the surviving workers, find pipelines (possibly of different lengths), a layer split
for each and a micro-batch count for each, that fit in memory and finish the step soonest.

1. Templates. For every length n the model can be split into, the fastest split that fits
   (``planner.plans.partition``) and a closed-form 1F1B time T_n(m) = fill_n + m * c_n, with c_n
   the slowest stage's forward+backward and fill_n the rest of the pipeline's latency.
2. Shapes. A shape is a multiset of lengths. We enumerate shapes of at most two distinct
   lengths a > b: for each a, the counts N//a - k (k < ``COUNT_SLACK``) of it, with the
   remainder filled by copies of one b. Micro-batches go to pipelines by water-filling on
   T_n(m) (the paper's "in proportion to pipeline size, remainder to balance", made
   exact; ``planner.search.template``), and a shape's time is its slowest pipeline plus an
   all-reduce tail. Shapes are visited in order of a fractional lower bound, so only the
   few that can still make the top k are allocated exactly.
3. The best shapes (``KEEP`` tiers), and the plan that just keeps every intact pipeline, are
   placed on real workers by matching (``planner.plans.matching``) and timed on the full step
   graph; the caller picks among them by expected throughput.

``reference.py`` holds the exhaustive version used to check this one on small clusters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from planner.estimator.estimate import Estimate, Memo, estimate
from planner.estimator.timing import simulate_pipeline
from planner.job.cost import CostModel
from planner.job.workload import Job
from planner.plans.matching import assign_slots
from planner.plans.migration import holdings_of
from planner.plans.partition import Partition, Partitioner
from planner.plans.plan import Plan, pipelines_plan
from planner.search.template import (
    Kind,
    Template,
    allocate,
    allocate_kinds,
    fractional_time_s,
    make_template,
)

Shape = tuple[tuple[int, int], ...]  # (pipeline length, how many), longest first

# Which closed-form-ranked shapes get timed on the step graph: (how many, within what
# fraction of the best). Small clusters also time near-ties, since there it is cheap.
KEEP = ((3, float("inf")),)
SMALL_CLUSTER = 32
ALL_SHAPES = 16
KEEP_SMALL = ((3, float("inf")), (64, 0.003))
COUNT_SLACK = 3


@dataclass(frozen=True)
class Proposal:
    plan: Plan
    estimate: Estimate
    label: str  # how the search found it, for display


class Layout:
    """A proposal of the search before it is placed on workers: its label and its
    estimated step (``Search.layouts``). ``proposal`` places it, once."""

    def __init__(
        self, search: Search, label: str, step_s: float, feasible: bool, place: Callable[[], Plan]
    ) -> None:
        self.search, self.label, self.step_s, self.feasible = search, label, step_s, feasible
        self._place = place

    @cached_property
    def proposal(self) -> Proposal:
        plan = self._place()
        return Proposal(plan, self.search.estimate(plan), self.label)


class Search:
    """Templates and shape scoring for one job; ``propose`` runs the search.

    Everything memoised here depends on the job alone, not on which workers failed, so
    one Search serves every failure of a run: ``warm_up`` at job start computes the
    templates (as Oobleck precomputes its pipeline templates) and a failure then pays only
    for the search itself.
    """

    def __init__(self, job: Job) -> None:
        self.job = job
        self.costs = CostModel(job)
        # A lone pipeline's stages exchange no gradients; replicated ones hold the
        # exchange's buffers too, so they may need a longer pipeline (planner.plans.partition).
        self._partitioners = {r: Partitioner(self.costs, replicated=r) for r in (False, True)}
        self._templates: dict[tuple[int, bool], Template | None] = {}
        self.memo: Memo = {}  # timings of distinct pipelines, shared by every estimate
        self._alone: dict[tuple[int, int, bool], float] = {}
        self._ranked: dict[int, list[tuple[float, Shape, list[list[int]]]]] = {}
        self._interchangeable = job.interchangeable_workers
        self._shaped: dict[tuple, Estimate] = {}  # (``estimate``)

    def warm_up(self, *, failures: int = 1) -> Search:
        """Ahead of any failure: every template the job can use, and the shape ranking for
        up to ``failures`` lost workers (it depends on how many survive, not on which)."""
        for length in range(1, min(self.job.num_workers, self.job.model.num_layers) + 1):
            self.template(length, replicated=False)
            self.template(length)
        for lost in range(1, failures + 1):
            if self.job.num_workers > lost:
                self.rank_shapes(self.job.num_workers - lost)
        return self

    def estimate(self, plan: Plan) -> Estimate:
        """``plan``'s estimate; on interchangeable workers, a plan of whole pipelines is
        timed once per structure (``_shape_of``) and its figures named onto the workers
        of every other plan of that structure: searches over one survivor count propose
        the same few structures on different workers again and again (14 structures for
        the 680 such estimates of a 5-day run at 16,384 GPUs)."""
        shape = self._shape_of(plan)
        if shape is None:
            return estimate(self.job, plan, memo=self.memo)
        hit = self._shaped.get(shape)
        if hit is None:
            hit = self._shaped[shape] = estimate(self.job, plan, memo=self.memo)
            return hit
        if hit.plan.routes == plan.routes:
            return hit if hit.plan == plan else replace(hit, plan=plan)
        name = {
            was: now
            for old, new in zip(hit.plan.routes, plan.routes, strict=True)
            for was, now in zip(old.hops, new.hops, strict=True)
        }
        return replace(
            hit,
            plan=plan,
            memory_bytes={name[w]: b for w, b in hit.memory_bytes.items()},
            in_flight={name[w]: n for w, n in hit.in_flight.items()},
        )

    def _shape_of(self, plan: Plan) -> tuple | None:
        """What the estimate of ``plan`` depends on where workers are interchangeable: per
        route, in order, its hops' layer ranges and its micro-batches' count, when each
        route is a whole pipeline running its home's micro-batches in order (the
        estimator's per-pipeline fast path); None for any other plan."""
        if not self._interchangeable or plan.replica_groups:
            return None
        routes = plan.routes
        if len(routes) != len(plan.pipelines) or len({r.home for r in routes}) != len(routes):
            return None
        if sum(map(len, plan.pipelines)) != len(plan.stages):
            return None  # (a stage on no route)
        stage_of = plan.stage_of
        shape = []
        for route, pipeline in zip(routes, plan.pipelines, strict=True):
            mbs = route.micro_batches
            if route.hops != pipeline or any(b <= a for a, b in zip(mbs, mbs[1:], strict=False)):
                return None
            ranges = tuple((stage_of[w].first_layer, stage_of[w].end_layer) for w in route.hops)
            shape.append((ranges, len(mbs)))
        return (plan.num_layers, plan.num_micro_batches, tuple(shape))

    def template(self, length: int, *, replicated: bool = True) -> Template | None:
        """The template of ``length`` stages, for a pipeline with replicas (the default)
        or a lone one; None when no split of that length fits."""
        key = (length, replicated)
        if key not in self._templates:
            split = self._partitioners[replicated].fastest(length)
            self._templates[key] = (
                None
                if split is None
                else make_template(self.costs, split, spans_nodes=self._spans_nodes(length))
            )
        return self._templates[key]

    def usable_lengths(self, num_workers: int) -> list[int]:
        """Pipeline lengths some shape over ``num_workers`` can use (a lone pipeline needs
        the least memory, so this is every length that fits alone)."""
        top = min(num_workers, self.job.model.num_layers)
        return [n for n in range(1, top + 1) if self.template(n, replicated=False)]

    def fits(self, shape: Shape) -> bool:
        """Whether every pipeline of ``shape`` has a template that fits as it will run."""
        replicated = _replicated(shape)
        return all(self.template(n, replicated=replicated) for n, _count in shape)

    def _spans_nodes(self, length: int) -> bool:
        return length * self.job.tp > self.job.cluster.devices_per_node

    def tail_s(self, kinds: Sequence[Kind]) -> float:
        """What follows the last backward, for ranking only: the slowest stage's all-reduce
        among all pipelines plus its optimizer step, and the commit barrier."""
        n = sum(count for _t, count in kinds)
        link = self.job.inter_link if self.job.cluster.num_nodes > 1 else self.job.intra_link
        ring = 2 * (n - 1) / n / link.bandwidth_bytes_per_s if n > 1 else 0.0
        latency = 2 * (n - 1) * link.latency_s
        worst = max(
            ring * t.max_stage_grad_bytes + latency + t.max_stage_optimizer_s for t, _n in kinds
        )
        return worst + self.costs.commit_s(n)

    def shapes(self, num_workers: int) -> list[Shape]:
        """Candidate shapes over at most ``num_workers``.

        Up to ``ALL_SHAPES`` workers: every multiset of lengths. Up to ``SMALL_CLUSTER``:
        copies of one length a plus copies of one shorter b, every count of both (leaving
        workers idle, or the all-reduce inside one node, can win there). Beyond: a's count
        within ``COUNT_SLACK`` of the most that fit, b filling the rest.
        """
        lengths = self.usable_lengths(num_workers)
        if num_workers <= ALL_SHAPES:
            every = (_as_shape(ms) for ms in length_multisets(num_workers, lengths))
            return [shape for shape in every if self.fits(shape)]
        small = num_workers <= SMALL_CLUSTER
        found: list[Shape] = []
        for a in lengths:
            most = num_workers // a
            for count_a in range(most, 0 if small else max(0, most - COUNT_SLACK), -1):
                rest = num_workers - count_a * a
                found.append(((a, count_a),))
                for b in lengths:
                    if b >= a or b > rest:
                        continue
                    fill = rest // b
                    for count_b in range(fill, 0 if small else fill - 1, -1):
                        found.append(((a, count_a), (b, count_b)))
        return [shape for shape in found if self.fits(shape)]

    def pipeline_alone_s(
        self, length: int, num_micro_batches: int, *, replicated: bool = True
    ) -> float:
        """A template pipeline running ``num_micro_batches`` alone, timed on its step
        graph (the phi-grid; memoised)."""
        key = (length, num_micro_batches, replicated)
        if key not in self._alone:
            t = self.template(length, replicated=replicated)
            assert t is not None
            self._alone[key] = (
                max(
                    simulate_pipeline(
                        t.forward_s,
                        t.backward_s,
                        t.forward_comm_s,
                        t.backward_comm_s,
                        num_micro_batches,
                    )
                )
                if num_micro_batches
                else 0.0
            )
        return self._alone[key]

    def kinds(self, shape: Shape) -> list[Kind]:
        replicated = _replicated(shape)
        return [(self.template(n, replicated=replicated), count) for n, count in shape]  # type: ignore[misc]

    def rank_shapes(self, num_workers: int) -> list[tuple[float, Shape, list[list[int]]]]:
        """``_rank_shapes``, memoised per number of workers."""
        if num_workers not in self._ranked:
            self._ranked[num_workers] = self._rank_shapes(num_workers)
        return self._ranked[num_workers]

    def _rank_shapes(self, num_workers: int) -> list[tuple[float, Shape, list[list[int]]]]:
        """The shapes worth timing on the real graph, best first, with their micro-batch
        counts. A shape is kept if for some tier (count, margin) of ``KEEP`` (or
        ``KEEP_SMALL``) it ranks within the first ``count`` and within ``margin`` of the
        best: a ranking cannot tell near-ties apart, the full estimate can.

        Small clusters are ranked by lone-pipeline times on the step graph, visited in
        order of a provable lower bound (``Template.lower_bound_s``) so that only shapes
        that could still make a tier are simulated. Large clusters are ranked by the
        linear closed form, visited in order of its fractional bound.
        """
        exact = num_workers <= SMALL_CLUSTER
        tiers = KEEP_SMALL if exact else KEEP
        most = max(count for count, _margin in tiers)
        m_total = self.job.training.num_micro_batches
        visits = []
        for shape in self.shapes(num_workers):
            kinds = self.kinds(shape)
            tail = self.tail_s(kinds)
            if exact:
                counts = allocate_kinds(kinds, m_total)
                bound = max(
                    t.lower_bound_s(max(c)) for (t, _n), c in zip(kinds, counts, strict=True)
                )
                visits.append((bound + tail, shape, kinds, counts, tail))
            else:
                visits.append((fractional_time_s(kinds, m_total) + tail, shape, kinds, None, tail))
        visits.sort(key=lambda v: (v[0], v[1]))
        best: list[tuple[float, Shape, list[list[int]]]] = []

        def cutoff() -> float:
            """Above this bound a shape can make no tier (thresholds only shrink)."""
            if not best:
                return float("inf")
            return max(
                min(
                    best[0][0] * (1 + margin),
                    best[count - 1][0] if len(best) >= count else float("inf"),
                )
                for count, margin in tiers
            )

        for bound, shape, kinds, counts, tail in visits:
            if bound > cutoff():
                break
            if exact:
                slowest = max(
                    self.pipeline_alone_s(t.length, max(c), replicated=_replicated(shape))
                    for (t, _n), c in zip(kinds, counts, strict=True)
                )
            else:
                counts = allocate_kinds(kinds, m_total)
                slowest = max(t.time_s(max(c)) for (t, _n), c in zip(kinds, counts, strict=True))
            best.append((slowest + tail, shape, counts))
            best.sort(key=lambda r: (r[0], sum(n for _l, n in r[1]), r[1]))
            del best[most:]
        return [
            r
            for rank, r in enumerate(best)
            if any(rank < count and r[0] <= best[0][0] * (1 + margin) for count, margin in tiers)
        ]

    def realise(
        self,
        *,
        current: Plan | None,
        survivors: Sequence[int],
        shape: Shape,
        counts: list[list[int]],
    ) -> Plan:
        """Place a shape on real workers: matching picks who holds what (``current``
        None: nobody holds anything yet, the launch)."""
        holdings = holdings_of(current, set(survivors)) if current is not None else {}
        kinds = self.kinds(shape)
        bounds = [t.partition.boundaries for t, count in kinds for _ in range(count)]
        slots = [list(zip(b, b[1:], strict=False)) for b in bounds]
        placed = assign_slots(
            self.costs,
            holdings=holdings,
            old_pipelines=current.pipelines if current is not None else [],
            new_pipelines=slots,
            workers=sorted(survivors),
        )
        return pipelines_plan(
            num_layers=self.job.model.num_layers,
            num_micro_batches=self.job.training.num_micro_batches,
            pipelines=placed,
            boundaries=bounds,
            micro_batch_counts=[m for per_kind in counts for m in per_kind],
        )

    def intact_plan(self, current: Plan, survivors: Sequence[int]) -> Plan | None:
        """Keep only the pipelines that lost no worker, layers unchanged (dp shrinks)."""
        intact = self._intact(current, survivors)
        return None if intact is None else self._intact_plan(current, *intact)

    @staticmethod
    def _intact_plan(
        current: Plan, kept: list[tuple[int, ...]], bounds: list[tuple[int, ...]], counts: list[int]
    ) -> Plan:
        return pipelines_plan(
            num_layers=current.num_layers,
            num_micro_batches=current.num_micro_batches,
            pipelines=kept,
            boundaries=bounds,
            micro_batch_counts=counts,
        )

    def _intact(
        self, current: Plan, survivors: Sequence[int]
    ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], list[int]] | None:
        """``intact_plan``'s pipelines, their boundaries and micro-batch counts."""
        alive = set(survivors)
        stage_of = current.stage_of
        kept = [p for p in current.pipelines if all(w in alive for w in p)]
        if not kept:
            return None
        by_bounds: dict[tuple[int, ...], Template] = {}
        templates = []
        bounds = []
        for p in kept:
            b = (*(stage_of[w].first_layer for w in p), current.num_layers)
            if b not in by_bounds:
                stage_s = tuple(
                    self.costs.forward_s(x, y) + self.costs.backward_s(x, y)
                    for x, y in zip(b, b[1:], strict=False)
                )
                by_bounds[b] = make_template(
                    self.costs, Partition(b, stage_s), spans_nodes=self._spans_nodes(len(p))
                )
            templates.append(by_bounds[b])
            bounds.append(b)
        return kept, bounds, allocate(templates, self.job.training.num_micro_batches)

    def _structure(self, bounds: Sequence[Sequence[int]], counts: Sequence[int]) -> tuple:
        """``_shape_of`` the plan of whole pipelines with layer boundaries ``bounds`` and
        ``counts`` micro-batches each, in order (``pipelines_plan``), without making it."""
        return (
            self.job.model.num_layers,
            self.job.training.num_micro_batches,
            tuple(
                (tuple(zip(b, b[1:], strict=False)), m) for b, m in zip(bounds, counts, strict=True)
            ),
        )

    def propose(self, current: Plan | None, survivors: Sequence[int]) -> list[Proposal]:
        """Feasible plans over the survivors, timed on the step graph, fastest first
        (``current`` None: the launch, where nobody holds anything and no pipeline is
        intact)."""
        return [layout.proposal for layout in self.layouts(current, survivors)]

    def layouts(self, current: Plan | None, survivors: Sequence[int]) -> list[Layout]:
        """``propose``'s proposals, in its order, each placed on workers only when asked
        (``Layout.proposal``). Where workers are interchangeable a layout's estimate is its
        structure's (``estimate``), known without placing it once that structure was
        timed; a caller that needs only some of them (the fastest; those whose step could
        still win: planner.simulation.answers) places only those. Elsewhere every layout
        is placed here, as its estimate needs."""
        found: list[Layout] = []
        intact = self._intact(current, survivors) if current is not None else None
        intact_key = None
        if intact is not None:
            kept, bounds, counts = intact
            intact_key = self._structure(bounds, counts)
            found.append(
                self._layout(
                    "keep intact pipelines", intact_key, lambda: self._intact_plan(current, *intact)
                )
            )
        for _time, shape, counts in self.rank_shapes(len(survivors)):
            bounds = [
                t.partition.boundaries for t, count in self.kinds(shape) for _ in range(count)
            ]
            key = self._structure(bounds, [m for per_kind in counts for m in per_kind])

            def place(shape: Shape = shape, counts: list[list[int]] = counts) -> Plan:
                return self.realise(
                    current=current, survivors=survivors, shape=shape, counts=counts
                )

            layout = self._layout(describe_shape(shape), key, place)
            if key == intact_key and _same_plan(found[0].proposal.plan, layout.proposal.plan):
                continue  # (the intact pipelines again: the first found is kept)
            found.append(layout)
        feasible = [layout for layout in found if layout.feasible]
        feasible.sort(key=lambda layout: (layout.step_s, layout.label))
        return feasible

    def _layout(self, label: str, structure: tuple, place: Callable[[], Plan]) -> Layout:
        hit = self._shaped.get(structure) if self._interchangeable else None
        if hit is not None:
            return Layout(self, label, hit.step_s, hit.feasible, place)
        layout = Layout(self, label, 0.0, True, place)
        est = layout.proposal.estimate
        layout.step_s, layout.feasible = est.step_s, est.feasible
        return layout


def length_multisets(
    total: int, lengths: Sequence[int], *, largest: int | None = None
) -> Iterator[tuple[int, ...]]:
    """Non-increasing tuples of ``lengths`` whose sum is at most ``total`` (non-empty)."""
    for n in sorted(lengths, reverse=True):
        if (largest is not None and n > largest) or n > total:
            continue
        yield (n,)
        for rest in length_multisets(total - n, lengths, largest=n):
            yield (n, *rest)


def _same_plan(a: Plan, b: Plan) -> bool:
    return (a.stages, a.routes) == (b.stages, b.routes)


def _replicated(shape: Shape) -> bool:
    return sum(count for _n, count in shape) > 1


def _as_shape(lengths: Sequence[int]) -> Shape:
    counts: dict[int, int] = {}
    for n in lengths:
        counts[n] = counts.get(n, 0) + 1
    return tuple(sorted(counts.items(), reverse=True))


def describe_shape(shape: Shape) -> str:
    return " + ".join(f"{count}x{n}" for n, count in shape) + " stages"
