"""Layer allocation: split the model's layers into the stages of one pipeline.

PAPER.md splits layers evenly and places leftover layers to balance. We do the general
version of that: the split that minimises the slowest stage's forward+backward time
subject to every stage fitting in a worker's memory (stage k of n holds n - k micro-batches
of activations under 1F1B), with the leftovers going to the *first* stages' neighbours
last: we fill from the last stage backwards, because later stages stash fewer micro-batches
and so have more room. On uniform layers this is the even split.

Both greedy directions are exact for feasibility here: the constraints on a stage depend
only on its index and its range, and a sub-range of a feasible range is feasible, so
taking the longest feasible suffix never hurts the stages before it.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from planner.cost import CostModel

_INF = float("inf")


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
    """Memoised fastest feasible partitions of one job's model, for any stage count."""

    def __init__(self, costs: CostModel) -> None:
        self._costs = costs
        model = costs.job.model
        self._num_layers = model.num_layers
        self._time = [
            costs.forward_s(i, i + 1) + costs.backward_s(i, i + 1) for i in range(model.num_layers)
        ]
        self._prefix_time = [0.0]
        for t in self._time:
            self._prefix_time.append(self._prefix_time[-1] + t)
        self._limit = costs.job.worker_memory_bytes
        self._cache: dict[int, Partition | None] = {}

    def fastest(self, num_stages: int) -> Partition | None:
        """The fastest split into exactly ``num_stages`` stages, or None if none fits."""
        if num_stages not in self._cache:
            self._cache[num_stages] = self._solve(num_stages)
        return self._cache[num_stages]

    def _stage_time(self, first: int, end: int) -> float:
        return self._prefix_time[end] - self._prefix_time[first]

    def _fits(self, first: int, end: int, stage: int, num_stages: int) -> bool:
        return self._costs.memory_bytes(first, end, num_stages - stage) <= self._limit

    def _longest_suffix(self, end: int, stage: int, num_stages: int, cap_s: float) -> int:
        """Smallest ``first`` such that [first, end) fits stage ``stage`` within cap_s."""
        lowest_time = bisect_left(self._prefix_time, self._prefix_time[end] - cap_s - 1e-12, 0, end)
        first = max(lowest_time, stage)  # leave one layer for each stage before this one
        while first < end and not self._fits(first, end, stage, num_stages):
            first += 1
        return first

    def _greedy(self, num_stages: int, cap_s: float) -> list[int] | None:
        """Boundaries from packing stages from the last backwards, or None if the layers
        do not all fit in ``num_stages`` stages of at most ``cap_s``."""
        bounds = [self._num_layers]
        end = self._num_layers
        for stage in range(num_stages - 1, -1, -1):
            first = 0 if stage == 0 else self._longest_suffix(end, stage, num_stages, cap_s)
            if first >= end:
                return None
            if stage == 0 and (
                self._stage_time(0, end) > cap_s + 1e-12 or not self._fits(0, end, 0, num_stages)
            ):
                return None
            bounds.append(first)
            end = first
        return bounds[::-1]

    def _solve(self, num_stages: int) -> Partition | None:
        if not 1 <= num_stages <= self._num_layers:
            return None
        if self._greedy(num_stages, _INF) is None:
            return None  # memory alone rules it out
        cap = max(max(self._time), self._prefix_time[-1] / num_stages)
        while True:
            bounds = self._greedy(num_stages, cap)
            if bounds is not None:
                break
            cap = self._next_cap(num_stages, cap)
        stage_s = tuple(self._stage_time(a, b) for a, b in zip(bounds, bounds[1:], strict=False))
        return Partition(boundaries=tuple(bounds), stage_s=stage_s)

    def _next_cap(self, num_stages: int, cap_s: float) -> float:
        """The smallest cap above ``cap_s`` at which some stage of the greedy can take one
        more layer: the next point where the greedy's answer can change. Stages held back
        by memory rather than time give no candidate, since a larger cap cannot help them."""
        best = _INF
        end = self._num_layers
        for stage in range(num_stages - 1, 0, -1):
            first = self._longest_suffix(end, stage, num_stages, cap_s)
            if first > stage:
                grown = self._stage_time(first - 1, end)
                if grown > cap_s:
                    best = min(best, grown)
            if first >= end:
                break
            end = first
        rest = self._stage_time(0, end)
        if rest > cap_s:
            best = min(best, rest)
        if best == _INF:  # cannot happen when a cap of infinity fits; never loop forever
            raise AssertionError("partition search made no progress")
        return best


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
