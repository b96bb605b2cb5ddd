"""A job with workers of unequal speed (Job.slow): the estimator prices each worker's
compute at its own speed, on devices and on hosts whose workers share cores, so that a
deal that gives a slow worker fewer micro-batches is priced as faster than the even one,
and the memo of pipeline timings does not mix speeds."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from planner.choice.stragglers import deal, resplit_plan, straggler_choice, uneven_plan
from planner.estimator.estimate import estimate
from planner.job.cost import CostModel
from planner.plans.layout import initial_plan
from planner.plans.plan import pipelines_plan
from tests.synthetic import uniform_job


def dp_plan(counts: list[int], num_layers: int = 8):
    return pipelines_plan(
        num_layers=num_layers,
        num_micro_batches=sum(counts),
        pipelines=[[w] for w in range(len(counts))],
        boundaries=[[0, num_layers]] * len(counts),
        micro_batch_counts=counts,
    )


def test_a_slow_workers_passes_and_update_take_its_factor():
    job = replace(uniform_job(dp=4, pp=1), slow=((2, 3.0),))
    costs = CostModel(job)
    assert costs.forward_s(0, 8, 2) == 3 * costs.forward_s(0, 8, 1) == 24.0
    assert costs.backward_s(0, 8, 2) == 48.0 and costs.backward_s(0, 8) == 16.0
    assert job.slowdown(2) == 3.0 and job.slowdown(0) == 1.0 and job.slowdown(None) == 1.0


def test_an_even_deal_waits_for_the_slow_worker_and_an_uneven_one_does_not():
    even_job = uniform_job(dp=4, pp=1, micro_batches=16)
    job = replace(even_job, slow=((3, 3.0),))
    even, uneven = dp_plan([4, 4, 4, 4]), dp_plan([5, 5, 5, 1])
    # 8 layers of 1 s forward, 2 s backward: a micro-batch is 24 s, 72 s on worker 3
    assert estimate(even_job, even).step_s == pytest.approx(4 * 24)
    assert estimate(job, even).step_s == pytest.approx(4 * 72)
    assert estimate(job, uneven).step_s == pytest.approx(max(5 * 24, 1 * 72))
    assert estimate(job, uneven).step_s < estimate(job, even).step_s


def test_the_memo_of_pipeline_timings_keeps_speeds_apart():
    plain = uniform_job(dp=2, pp=2, micro_batches=8)
    slow = replace(plain, slow=((1, 2.0),))
    plan = pipelines_plan(
        num_layers=8, num_micro_batches=8, pipelines=[[0, 1], [2, 3]],
        boundaries=[[0, 4, 8], [0, 4, 8]], micro_batch_counts=[4, 4],
    )  # fmt: skip
    memo: dict = {}
    fast_s = estimate(plain, plan, memo=memo).step_s
    slow_s = estimate(slow, plan, memo=memo).step_s
    assert slow_s > fast_s
    assert slow_s == estimate(slow, plan).step_s  # what the memo held is not reused


def test_on_a_shared_host_a_slowed_worker_leaves_the_cores_to_the_others():
    # 4 workers on 2 cores, one slowed 3x (stopped two thirds of the time, as the test
    # fault does): the even deal waits for it; giving it fewer micro-batches pays.
    base = uniform_job(dp=4, pp=1, micro_batches=16, num_layers=1)
    shared = replace(base, cluster=replace(base.cluster, host_cores=2.0))
    job = replace(shared, slow=((3, 3.0),))
    even, uneven = dp_plan([4, 4, 4, 4], 1), dp_plan([5, 5, 4, 2], 1)
    unslowed = estimate(shared, even).step_s
    assert unslowed == pytest.approx(16 * 3 / 2)  # the cores busy all step
    slowed = estimate(job, even).step_s
    assert slowed > 1.4 * unslowed
    assert estimate(job, uneven).step_s < 0.85 * slowed


def test_the_deal_finishes_the_slowest_pipeline_as_early_as_any_deal_can():
    per_mb, fill = [1.0, 1.0, 2.5, 1.3], [1, 1, 1, 0]
    counts = deal(12, per_mb, fill)
    assert sum(counts) == 12

    def finish(c):
        return max((f + k) * s for k, s, f in zip(c, per_mb, fill, strict=True) if k)

    best = min(finish(c) for c in itertools.product(range(13), repeat=4) if sum(c) == 12)
    assert finish(counts) == best


def test_a_slowdown_is_planned_around_only_when_it_lasts_long_enough_to_pay():
    job = uniform_job(dp=4, pp=2, micro_batches=16)
    slow = replace(job, slow=((3, 2.0),))
    current = initial_plan(job)
    uneven = uneven_plan(slow, current)
    assert uneven.stages == current.stages  # nothing moves: the same layers on each
    assert uneven.load()[3] < current.load()[3]
    brief = straggler_choice(slow, current, horizon_s=10.0)
    assert brief.chosen.name == "stay"  # the moves there and back outlast it
    lasting = straggler_choice(slow, current, horizon_s=3600.0)
    assert lasting.chosen.name == "uneven deal"
    stay = lasting.stay
    assert lasting.chosen.estimate.step_s < stay.estimate.step_s
    assert lasting.even_step_s < lasting.chosen.estimate.step_s
    # left out, its stage's replicas on the other pipelines take its micro-batches
    leave = next(o for o in lasting.options if o.name == "leave out")
    assert leave.feasible and 3 not in leave.plan.workers


def test_a_sharded_model_is_not_dealt_unevenly_and_says_why():
    job = uniform_job(dp=4, pp=1, micro_batches=8)
    sharded = replace(job, training=replace(job.training, shards=2), slow=((1, 2.0),))
    choice = straggler_choice(sharded, initial_plan(job), horizon_s=3600.0)
    uneven = next(o for o in choice.options if o.name == "uneven deal")
    assert not uneven.feasible and "whole turns" in uneven.reason


def test_the_break_even_horizon_is_where_a_move_starts_to_pay():
    from planner.choice.stragglers import MARGIN, break_even_s, dealt_unevenly

    job = uniform_job(dp=4, pp=2, micro_batches=16)
    slow = replace(job, slow=((3, 2.0),))
    current = initial_plan(job)
    h = break_even_s(straggler_choice(slow, current, horizon_s=1.0))
    assert h is not None and h > 0
    assert straggler_choice(slow, current, horizon_s=h * 0.99).chosen.name == "stay"
    assert straggler_choice(slow, current, horizon_s=h * 1.01).chosen.name != "stay"
    # no move ever pays when the worker is hardly slower
    barely = replace(job, slow=((3, 1.01),))
    assert break_even_s(straggler_choice(barely, current, 1.0), MARGIN) is None
    assert not dealt_unevenly(current)
    assert dealt_unevenly(uneven_plan(slow, current))


def test_a_split_at_speeds_gives_a_slow_stage_fewer_layers_and_is_the_best_split():
    from planner.plans.partition import Partitioner

    job = uniform_job(dp=2, pp=3, num_layers=9)
    partitioner = Partitioner(CostModel(job), replicated=True)
    assert partitioner.fastest_at_speeds([1.0, 1.0, 1.0]) == partitioner.fastest(3)
    split = partitioner.fastest_at_speeds([1.0, 2.0, 1.0])
    assert split is not None
    sizes = [b - a for a, b in zip(split.boundaries, split.boundaries[1:], strict=False)]
    assert sizes[1] < 3 and sum(sizes) == 9

    def bottleneck(bounds, factors):
        return max(
            f * partitioner._stage_time(a, b)
            for f, a, b in zip(factors, bounds, bounds[1:], strict=False)
        )

    for factors in ([1.0, 2.0, 1.0], [3.0, 1.0, 1.0], [1.0, 1.0, 1.5], [2.0, 1.0, 2.0]):
        best = min(bottleneck((0, a, b, 9), factors) for a in range(1, 8) for b in range(a + 1, 9))
        found = partitioner.fastest_at_speeds(factors)
        assert found is not None
        assert bottleneck(found.boundaries, factors) == pytest.approx(best)


def test_a_pipeline_with_a_slow_worker_is_split_again_around_it():
    job = uniform_job(dp=4, pp=2, micro_batches=16)
    slow = replace(job, slow=((3, 2.0),))
    current = initial_plan(job)
    resplit = resplit_plan(slow, current)
    assert resplit.workers == current.workers and resplit.pipelines == current.pipelines
    held = resplit.stage_of[3]
    assert held.end_layer - held.first_layer < current.stage_of[3].num_layers
    # the other pipelines keep their layers
    assert all(resplit.stage_of[w] == current.stage_of[w] for w in (0, 1, 4, 5, 6, 7))
    lasting = straggler_choice(slow, current, horizon_s=3600.0)
    option = next(o for o in lasting.options if o.name == "re-partition")
    assert option.feasible and option.plan == resplit
    assert option.estimate.step_s < lasting.stay.estimate.step_s
    # its layers move there and back: dearer than the deal, which moves none
    uneven = next(o for o in lasting.options if o.name == "uneven deal")
    assert option.transition_s > uneven.transition_s
    # data parallel: one stage each, nothing to split; a live run does not take it yet
    dp = replace(uniform_job(dp=4, pp=1, micro_batches=8), slow=((1, 2.0),))
    none = straggler_choice(dp, initial_plan(dp), horizon_s=3600.0).options[-1]
    assert none.name == "re-partition" and not none.feasible and "one stage" in none.reason
    live = straggler_choice(slow, current, horizon_s=3600.0, repartition=False).options[-1]
    assert not live.feasible and "live run" in live.reason


def test_a_deal_made_again_is_told_against_the_even_deal_without_the_slowdown():
    # Dealt 6/2 around a 3x worker that is now read at 5x: the "failure-free" step the
    # run reports (and benchmarks/stragglers.py predicts from) is the even deal's at full
    # speed, not the running 6/2 deal's, whose 6 micro-batches bound it.
    even_job = uniform_job(dp=2, pp=1, micro_batches=8)
    even = dp_plan([4, 4])
    running = dp_plan([6, 2])
    again = straggler_choice(replace(even_job, slow=((1, 5.0),)), running, horizon_s=3600.0)
    assert again.even_step_s == pytest.approx(estimate(even_job, even).step_s)
    assert again.even_step_s < estimate(even_job, running).step_s
    first = straggler_choice(replace(even_job, slow=((1, 3.0),)), even, horizon_s=3600.0)
    assert first.even_step_s == pytest.approx(again.even_step_s)
