"""Layer allocation: split the model's layers into the stages of one pipeline.

PAPER.md splits layers evenly and places leftover layers to balance. We do the general
version of that: the split that minimises the slowest stage's forward+backward time
subject to every stage fitting in a worker's memory (stage k of n holds n - k micro-batches
of activations under 1F1B). Ties go to the split whose first stages are shortest: earlier
stages keep more micro-batches in flight, so later stages have more room. On uniform
layers this is the even split with the leftovers last.

A stage's memory is not monotone in its range (it keeps its last layer's output for the
backward, and the last stage keeps none), so no greedy packing is exact. A dynamic
program is: a stage's micro-batches in flight depend only on how many stages follow it,
so ``best[j][f]``, the smallest bottleneck of layers [f, L) split into the last j stages,
serves every stage count at once. Rows are built on demand, O(L^2) each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.job.cost import CostModel

_INF = float("inf")
_EPS = 1e-12


@dataclass(frozen=True)
class Partition:
    boundaries: tuple[int, ...]  # 0 = b0 < b1 < ... < bn = num_layers
    stage_s: tuple[float, ...]  # forward + backward of one micro-batch, per stage

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) - 1

    @property
    def bottleneck_s(self) -> float:
        return max(self.stage_s)


class Partitioner:
    """Memoised fastest feasible partitions of one job's model, for any stage count.

    ``replicated``: the stages will have replicas in other pipelines, so each also holds
    a gradient exchange's buffers at the end of the step (``CostModel.exchange_bytes``;
    for a stage's whole range, the most any of its buckets can need)."""

    def __init__(self, costs: CostModel, *, replicated: bool = False) -> None:
        self._costs = costs
        self._replicated = replicated
        model = costs.job.model
        self._num_layers = model.num_layers
        self._prefix_time = [0.0]
        for i in range(model.num_layers):
            step = model.total("forward_s", i, i + 1) + model.total("backward_s", i, i + 1)
            self._prefix_time.append(self._prefix_time[-1] + step)
        self._per_stage_s = 2 * costs.job.cluster.pass_cpu_s  # a forward's and a backward's
        self._limit = costs.job.worker_memory_bytes
        # _best[j - 1][f]: the bottleneck of [f, L) over the last j stages (inf: none fits)
        self._best: list[list[float]] = []
        self._most_in_flight: dict[tuple[int, int], int] = {}
        self._cache: dict[int, Partition | None] = {}

    def fastest(self, num_stages: int) -> Partition | None:
        """The fastest split into exactly ``num_stages`` stages, or None if none fits."""
        if num_stages not in self._cache:
            self._cache[num_stages] = self._solve(num_stages)
        return self._cache[num_stages]

    def fastest_at_speeds(self, factors: Sequence[float]) -> Partition | None:
        """The split into ``len(factors)`` stages whose slowest stage is fastest when
        stage k's forward+backward takes ``factors[k]`` times its time (a slow worker's:
        planner.choice.stragglers gives it fewer layers), under the same memory bounds;
        None if none fits. ``stage_s`` are at full speed, as ``fastest``'s. The same
        dynamic program, its rows for these factors alone (each stage's factor depends on
        its position, so they serve no other count)."""
        p = len(factors)
        if not 1 <= p <= self._num_layers:
            return None
        rows: list[list[float]] = []  # rows[j - 1]: [f, L) over the last j stages
        for j in range(1, p + 1):
            rows.append(self._next_row(rows[-1] if rows else None, j, factors[p - j]))
        return self._split(p, lambda j: rows[j - 1], lambda k: factors[k])

    def stage_time(self, first: int, end: int) -> float:
        """One micro-batch's forward+backward over layers [first, end) at full speed."""
        return self._stage_time(first, end)

    def _stage_time(self, first: int, end: int) -> float:
        return self._prefix_time[end] - self._prefix_time[first] + self._per_stage_s

    def _fits(self, first: int, end: int, in_flight: int) -> bool:
        """Whether [first, end) fits with ``in_flight`` micro-batches. Memory grows with
        the micro-batches in flight, so one bisection per range answers every count."""
        key = (first, end)
        most = self._most_in_flight.get(key)
        if most is None:
            lo, hi = 0, self._num_layers  # no stage holds more than there are stages
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self._memory_bytes(first, end, mid) <= self._limit:
                    lo = mid
                else:
                    hi = mid - 1
            most = self._most_in_flight[key] = lo
        return in_flight <= most

    def _memory_bytes(self, first: int, end: int, in_flight: int) -> int:
        exchange = self._costs.exchange_bytes(2, first, end) if self._replicated else 0
        return self._costs.memory_bytes(first, end, in_flight, exchange)

    def _row(self, stages_after: int) -> list[float]:
        """``best`` for the last ``stages_after`` stages, building the rows it needs."""
        while len(self._best) < stages_after:
            after = self._best[-1] if self._best else None
            self._best.append(self._next_row(after, len(self._best) + 1))
        return self._best[stages_after - 1]

    def _next_row(self, after: list[float] | None, j: int, slow: float = 1.0) -> list[float]:
        """The bottleneck of [f, L) over the last ``j`` stages, for every f, from the row
        for the last ``j - 1`` (``after``; None for j = 1), the first of the j taking
        ``slow`` times its time."""
        n = self._num_layers
        row = [_INF] * (n + 1)
        if after is None:
            for f in range(n):
                if self._fits(f, n, 1):
                    row[f] = slow * self._stage_time(f, n)
            return row
        for f in range(n - j + 1):
            best = _INF
            for e in range(f + 1, n - j + 2):
                rest = after[e]
                if rest == _INF:
                    continue
                here = slow * self._stage_time(f, e)
                if here >= best:
                    break  # longer first stages only take longer
                if self._fits(f, e, j):
                    best = min(best, max(here, rest))
            row[f] = best
        return row

    def _solve(self, num_stages: int) -> Partition | None:
        if not 1 <= num_stages <= self._num_layers:
            return None
        return self._split(num_stages, self._row, lambda k: 1.0)

    def _split(
        self,
        num_stages: int,
        row: Callable[[int], list[float]],
        slow: Callable[[int], float],
    ) -> Partition | None:
        """The split that reaches the bottleneck ``row(num_stages)[0]`` (None if memory
        rules every split out), from ``row(j)``, the rows for the last j stages, stage k
        taking ``slow(k)`` times its time."""
        n = self._num_layers
        bottleneck = row(num_stages)[0]
        if bottleneck == _INF:
            return None  # memory alone rules it out
        bounds, first = [0], 0
        for j in range(num_stages, 1, -1):
            after, factor = row(j - 1), slow(num_stages - j)
            # the shortest first stage that still reaches the optimum
            first = next(
                e
                for e in range(first + 1, n - j + 2)
                if factor * self._stage_time(first, e) <= bottleneck + _EPS
                and after[e] <= bottleneck + _EPS
                and self._fits(first, e, j)
            )
            bounds.append(first)
        bounds.append(n)
        stage_s = tuple(self._stage_time(a, b) for a, b in zip(bounds, bounds[1:], strict=False))
        return Partition(boundaries=tuple(bounds), stage_s=stage_s)


def balanced_split(weights: list[float] | tuple[float, ...], num_stages: int) -> tuple[int, ...]:
    """Boundaries of the contiguous split of ``weights`` into ``num_stages`` non-empty
    parts whose largest part is smallest (ties: later parts larger). A pure function of
    its inputs, so every worker computes the same first layout without talking."""
    n = len(weights)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def fits(cap: float) -> list[int] | None:
        bounds = [n]
        end = n
        for stage in range(num_stages - 1, 0, -1):
            first = end - 1
            while first - 1 >= stage and prefix[end] - prefix[first - 1] <= cap:
                first -= 1
            if prefix[end] - prefix[first] > cap:
                return None
            bounds.append(first)
            end = first
        if prefix[end] > cap:
            return None
        bounds.append(0)
        return bounds[::-1]

    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    result = fits(candidates[lo])
    assert result is not None
    return tuple(result)
