"""Layer allocation (partition) and micro-batch allocation against brute force."""

import itertools
import random

import pytest

from planner.job.cost import CostModel
from planner.plans.partition import Partition, Partitioner
from planner.plans.plan import split_evenly
from planner.search.template import Template, allocate
from tests.synthetic import random_job, uniform_job


def _brute_force_bottleneck(costs: CostModel, num_stages: int) -> float | None:
    job = costs.job
    n = job.model.num_layers
    limit = job.worker_memory_bytes
    best = None
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = (0, *cuts, n)
        stages = list(zip(bounds, bounds[1:]))
        if any(costs.memory_bytes(a, b, num_stages - k) > limit for k, (a, b) in enumerate(stages)):
            continue
        worst = max(costs.forward_s(a, b) + costs.backward_s(a, b) for a, b in stages)
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(60))
def test_partition_is_the_fastest_feasible_split(seed):
    job = random_job(random.Random(seed))
    costs = CostModel(job)
    partitioner = Partitioner(costs)
    for stages in range(1, job.model.num_layers + 1):
        got = partitioner.fastest(stages)
        want = _brute_force_bottleneck(costs, stages)
        if want is None:
            assert got is None
            continue
        assert got is not None
        assert got.bottleneck_s == pytest.approx(want)
        bounds = got.boundaries
        assert bounds[0] == 0 and bounds[-1] == job.model.num_layers and len(bounds) == stages + 1
        assert all(a < b for a, b in zip(bounds, bounds[1:]))
        for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
            assert costs.memory_bytes(a, b, stages - k) <= job.worker_memory_bytes


def test_uniform_layers_split_evenly_with_leftovers_early():
    job = uniform_job(dp=1, pp=4, num_layers=10)
    split = Partitioner(CostModel(job)).fastest(4)
    sizes = [b - a for a, b in zip(split.boundaries, split.boundaries[1:])]
    assert max(sizes) == 3 and sum(sizes) == 10
    # later stages keep fewer micro-batches in flight, so they take the larger shares
    assert sizes == sorted(sizes)


def test_no_partition_when_memory_cannot_hold_the_model():
    job = uniform_job(dp=1, pp=2, num_layers=4, memory_bytes=1000)
    assert Partitioner(CostModel(job)).fastest(2) is None


def _greedy_optimum(templates, total):
    counts = [0] * len(templates)
    for _ in range(total):
        j = min(range(len(templates)), key=lambda j: (templates[j].time_s(counts[j] + 1), j))
        counts[j] += 1
    return max(t.time_s(c) for t, c in zip(templates, counts))


def test_allocation_minimises_the_slowest_pipeline():
    rng = random.Random(1)
    dummy = Partition((0, 1), (1.0,))
    for _ in range(3000):
        kinds = [
            Template(dummy, rng.choice([0, 0.5, 1, 3, 7.3, 20]), rng.choice([0.3, 1, 1.7, 2.5]))
            for _ in range(rng.randint(1, 3))
        ]
        templates = [rng.choice(kinds) for _ in range(rng.randint(1, 6))]
        total = rng.randint(1, 40)
        counts = allocate(templates, total)
        assert sum(counts) == total and min(counts) >= 0
        got = max(t.time_s(c) for t, c in zip(templates, counts))
        assert got == pytest.approx(_greedy_optimum(templates, total))


def test_split_evenly_gives_remainders_to_the_first():
    assert split_evenly(10, [1, 1, 1]) == [4, 3, 3]
    assert split_evenly(7, [2, 1]) == [5, 2]
    assert sum(split_evenly(101, [0.3, 0.3, 0.4])) == 101
