"""The level-by-level timing of rerouted components (planner.estimator.wavefront) gives the event
driven walk's answer to the last bit, and the program's own in-flight counts."""

import random

import pytest

from planner.estimator.timing import simulate_compute
from planner.estimator.wavefront import time_routes
from planner.job.cost import CostModel
from planner.plans.layout import initial_plan
from planner.plans.plan import Plan, Route
from planner.plans.program import max_in_flight, ops_for, position_in_home, tie_rank
from planner.plans.reroute import RerouteInfeasible, reroute_plan
from tests.synthetic import random_job, uniform_job


def _walk(plan: Plan, costs: CostModel) -> tuple[list[float], list[int]]:
    order = sorted(plan.workers)
    ops = ops_for(plan.routes, position_in_home(plan), tie_rank(plan))
    for w in order:
        ops.setdefault(w, [])
    ranges = {s.worker: (s.first_layer, s.end_layer) for s in plan.stages}
    ends = simulate_compute(ops, ranges, costs)
    return [ends[w] for w in order], [max_in_flight(ops[w]) for w in order]


def _levels(plan: Plan, costs: CostModel) -> tuple[list[float], list[int]]:
    ranges = {s.worker: (s.first_layer, s.end_layer) for s in plan.stages}
    return time_routes(
        plan.routes, position_in_home(plan), tie_rank(plan), ranges, costs, sorted(plan.workers)
    )


def _rerouted(rng: random.Random, plan: Plan, times: int) -> list[Plan]:
    plans = [plan]
    for _ in range(times):
        try:
            plan = reroute_plan(
                plan, rng.sample(plan.workers, rng.randint(1, min(2, len(plan.workers))))
            )
        except RerouteInfeasible:
            break
        plans.append(plan)
    return plans


@pytest.mark.parametrize("seed", range(30))
def test_levels_equal_the_event_driven_walk(seed):
    rng = random.Random(seed)
    job = random_job(rng)
    costs = CostModel(job)
    for plan in _rerouted(rng, initial_plan(job), times=3):
        ends, peaks = _levels(plan, costs)
        assert (ends, peaks) == _walk(plan, costs)


def test_a_large_rerouted_component_on_uneven_micro_batch_shares():
    # Peers serving several broken pipelines at once: several passes of one worker share
    # a phi, the case the sweeps within a level exist for.
    job = uniform_job(dp=8, pp=4, num_layers=8, micro_batches=8 * 5, per_node=4)
    costs = CostModel(job)
    plan = reroute_plan(reroute_plan(initial_plan(job), [1, 6]), [13])
    assert (levels := _levels(plan, costs)) == _walk(plan, costs)
    assert max(levels[0]) > 0


def test_a_share_that_does_not_start_at_position_zero():
    job = uniform_job(dp=1, pp=3, num_layers=3, micro_batches=4)
    costs = CostModel(job)
    plan = initial_plan(job)
    first, rest = Route(0, (0, 1, 2), (0, 1)), Route(0, (0, 1, 2), (2, 3))
    split = Plan(plan.num_layers, plan.num_micro_batches, plan.stages, (first, rest))
    ranges = {0: (0, 1), 1: (1, 2), 2: (2, 3)}
    where, rank = position_in_home(split), tie_rank(split)
    only_rest = time_routes([rest], where, rank, ranges, costs, (0, 1, 2))
    ops = ops_for([rest], where, rank)
    walk = simulate_compute(ops, ranges, costs)
    assert only_rest[0] == [walk[w] for w in (0, 1, 2)]


def test_no_routes_end_at_zero():
    job = uniform_job(dp=1, pp=2)
    assert time_routes([], {}, {}, {}, CostModel(job), (0, 1)) == ([0.0, 0.0], [0, 0])


@pytest.mark.parametrize("seed", range(10))
def test_components_are_the_routes_connected_by_shared_workers(seed):
    """The estimator times each group of routes that share workers apart; its union-find
    gives networkx's connected components, in route order."""
    import networkx as nx

    from planner.estimator.estimate import _components

    rng = random.Random(seed)
    job = uniform_job(dp=8, pp=4, num_layers=8, micro_batches=8 * 5, per_node=4)
    for plan in _rerouted(rng, initial_plan(job), times=4):
        graph = nx.Graph()
        graph.add_nodes_from(range(len(plan.routes)))
        by_worker: dict[int, list[int]] = {}
        for i, route in enumerate(plan.routes):
            for w in route.hops:
                by_worker.setdefault(w, []).append(i)
        for on in by_worker.values():
            graph.add_edges_from((on[0], i) for i in on[1:])
        expected = sorted(sorted(c) for c in nx.connected_components(graph))
        index = {id(r): i for i, r in enumerate(plan.routes)}
        got = [[index[id(r)] for r in group] for group in _components(plan)]
        assert got == expected  # each group in route order, groups by their first route
