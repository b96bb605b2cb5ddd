"""Pipeline templates and micro-batch allocation: the closed forms the search ranks with.

A template is a pipeline length with its fastest feasible layer split and a closed-form
1F1B time T(m) = fill + m * c, where c is the slowest stage's forward+backward of one
micro-batch and fill is the rest of the pipeline's latency (the other stages once, plus the
activation and gradient transfers between them). The search only ranks with these; every
plan it hands out is timed on the real step graph.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.job.cost import CostModel
from planner.plans.partition import Partition


@dataclass(frozen=True)
class Template:
    partition: Partition
    fill_s: float
    per_mb_s: float
    # The stage whose gradient all-reduce and optimizer step take longest, for the tail.
    max_stage_grad_bytes: float = 0.0
    max_stage_optimizer_s: float = 0.0
    # Per stage: forward, backward, transfer into it, gradient transfer into it from the
    # next stage. What the lone-pipeline simulation and the lower bound read.
    forward_s: tuple[float, ...] = ()
    backward_s: tuple[float, ...] = ()
    forward_comm_s: tuple[float, ...] = ()
    backward_comm_s: tuple[float, ...] = ()

    @property
    def length(self) -> int:
        return self.partition.num_stages

    def time_s(self, num_micro_batches: int) -> float:
        return 0.0 if num_micro_batches == 0 else self.fill_s + num_micro_batches * self.per_mb_s

    def lower_bound_s(self, num_micro_batches: int) -> float:
        """A provable lower bound on the 1F1B time on the step graph. Any stage k runs its
        2m passes one after another (m * s_k), cannot start before the first micro-batch
        reaches it (the forwards before it), idles after its warm-up forwards until the
        first gradient returns from the stages after it, and after its last backward the
        stages before it still run theirs. Within a few percent of the graph, where the
        linear form above can be 20% high on short uneven pipelines."""
        m = num_micro_batches
        if m == 0:
            return 0.0
        f, b, cf, cb = self.forward_s, self.backward_s, self.forward_comm_s, self.backward_comm_s
        p = len(f)
        best = 0.0
        lead = trail = 0.0
        round_trip = sum(f[1:]) + sum(b[1:]) + sum(cf[1:]) + sum(cb[:-1])
        for k in range(p):
            idle = max(0.0, round_trip - min(p - k - 1, m - 1) * f[k])
            best = max(best, lead + m * (f[k] + b[k]) + idle + trail)
            if k + 1 < p:
                lead += f[k] + cf[k + 1]
                trail += b[k] + cb[k]
                round_trip -= f[k + 1] + b[k + 1] + cf[k + 1] + cb[k]
        return best


def make_template(costs: CostModel, partition: Partition, *, spans_nodes: bool) -> Template:
    job = costs.job
    link = job.inter_link if spans_nodes else job.intra_link
    bounds = partition.boundaries
    stages = list(zip(bounds, bounds[1:], strict=False))
    forward_comm = (0.0, *(link.transfer_s(costs.boundary_bytes(a)) for a, _ in stages[1:]))
    backward_comm = (*(link.transfer_s(costs.boundary_bytes(b)) for _, b in stages[:-1]), 0.0)
    per_mb = partition.bottleneck_s
    grad = job.training.grad_bytes
    return Template(
        partition=partition,
        fill_s=sum(partition.stage_s) - per_mb + sum(forward_comm) + sum(backward_comm),
        per_mb_s=per_mb,
        max_stage_grad_bytes=max(job.model.total("num_params", a, b) * grad for a, b in stages),
        max_stage_optimizer_s=max(costs.optimizer_s(a, b) for a, b in stages),
        forward_s=tuple(costs.forward_s(a, b) for a, b in stages),
        backward_s=tuple(costs.backward_s(a, b) for a, b in stages),
        forward_comm_s=forward_comm,
        backward_comm_s=backward_comm,
    )


Kind = tuple[Template, int]  # a template and how many pipelines of it


def _take(t: Template, cap: float) -> int:
    """Micro-batches a pipeline of template t can finish by time ``cap``."""
    return 0 if cap < t.fill_s + t.per_mb_s - 1e-12 else int((cap - t.fill_s) / t.per_mb_s + 1e-9)


def fractional_time_s(kinds: Sequence[Kind], num_micro_batches: int) -> float:
    """Lower bound on the slowest pipeline: the optimum when a pipeline may take a
    fraction of a micro-batch, m_j(T) = max(0, (T - fill_j) / c_j)."""
    by_fill = sorted(kinds, key=lambda tn: tn[0].fill_s)
    rate = weighted_fill = relaxed = 0.0
    for i, (t, n) in enumerate(by_fill):
        rate += n / t.per_mb_s
        weighted_fill += n * t.fill_s / t.per_mb_s
        relaxed = (num_micro_batches + weighted_fill) / rate
        if i + 1 == len(by_fill) or by_fill[i + 1][0].fill_s >= relaxed:
            break
    return relaxed


def allocate_kinds(kinds: Sequence[Kind], num_micro_batches: int) -> list[list[int]]:
    """Micro-batches for every pipeline of every kind, minimising the slowest pipeline.

    Pipeline j can finish floor((T - fill_j) / c_j) micro-batches by time T. The smallest T
    at which all of them fit is a breakpoint fill_j + k * c_j between the fractional bound
    and that bound plus the largest c_j (at that point every pipeline active in the bound
    gains at least one), so only those few breakpoints are tried. Identical pipelines are
    handled together: this is O(kinds), not O(pipelines).
    """
    if not kinds:
        return []
    relaxed = fractional_time_s(kinds, num_micro_batches)
    widest = max(t.per_mb_s for t, _n in kinds)
    candidates = sorted(
        t.fill_s + j * t.per_mb_s
        for t, _n in kinds
        for j in range(
            max(1, math.floor((relaxed - t.fill_s) / t.per_mb_s)),
            math.ceil((relaxed + widest - t.fill_s) / t.per_mb_s) + 1,
        )
    )
    cap = next(
        (c for c in candidates if sum(n * _take(t, c) for t, n in kinds) >= num_micro_batches),
        candidates[-1],
    )
    counts = [[_take(t, cap)] * n for t, n in kinds]
    # The pipelines that reach exactly ``cap`` made the total jump past M: hand the surplus
    # back from the last of them, so the slowest pipeline still ends at ``cap``.
    excess = sum(map(sum, counts)) - num_micro_batches
    order = sorted(range(len(kinds)), key=lambda k: (-kinds[k][0].time_s(counts[k][0]), -k))
    for k in order:
        for j in range(len(counts[k]) - 1, -1, -1):
            if excess <= 0:
                break
            if counts[k][j] > 0:
                counts[k][j] -= 1
                excess -= 1
    return counts


def allocate(templates: Sequence[Template], num_micro_batches: int) -> list[int]:
    """``allocate_kinds`` for a list of pipelines, in their order."""
    index: dict[int, int] = {}
    kinds: list[list] = []
    for t in templates:
        if id(t) not in index:
            index[id(t)] = len(kinds)
            kinds.append([t, 0])
        kinds[index[id(t)]][1] += 1
    per_kind = allocate_kinds([(t, n) for t, n in kinds], num_micro_batches)
    taken = [0] * len(kinds)
    out = []
    for t in templates:
        k = index[id(t)]
        out.append(per_kind[k][taken[k]])
        taken[k] += 1
    return out
