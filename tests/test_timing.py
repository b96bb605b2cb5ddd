"""The step graph's timing: 1F1B closed forms, the fast paths equal the general walk,
and no plan the planner can build deadlocks."""

import random
from dataclasses import replace

import pytest

from planner.estimator.estimate import estimate
from planner.estimator.timing import (
    ScheduleDeadlock,
    simulate,
    simulate_compute,
    simulate_pipeline,
    simulate_tails,
)
from planner.job.cost import CostModel
from planner.plans.layout import initial_plan
from planner.plans.plan import Plan, Route, Stage
from planner.plans.program import build_program, ops_for
from planner.plans.reroute import reroute_plan
from tests.synthetic import random_job, uniform_job


@pytest.mark.parametrize(
    ("dp", "pp", "per_pipeline"),
    [(1, 4, 8), (2, 4, 8), (4, 4, 8), (1, 8, 8), (1, 2, 1), (1, 4, 2), (3, 2, 5)],
)
def test_symmetric_1f1b_is_m_plus_p_minus_1_slots(dp, pp, per_pipeline):
    # PAPER.md: T = (m + p - 1) * (t_f + t_b) for m micro-batches on p stages.
    job = uniform_job(dp=dp, pp=pp, num_layers=8, micro_batches=dp * per_pipeline)
    est = estimate(job, initial_plan(job))
    slot = (1.0 + 2.0) * 8 / pp
    assert est.step_s == pytest.approx((per_pipeline + pp - 1) * slot)


def test_1f1b_keeps_p_minus_k_micro_batches_in_flight():
    job = uniform_job(dp=1, pp=4, micro_batches=8)
    est = estimate(job, initial_plan(job))
    assert [est.in_flight[w] for w in range(4)] == [4, 3, 2, 1]
    few = uniform_job(dp=1, pp=4, micro_batches=2)
    assert [estimate(few, initial_plan(few)).in_flight[w] for w in range(4)] == [2, 2, 2, 1]


def _random_plans(seeds):
    for seed in seeds:
        rng = random.Random(seed)
        job = random_job(rng)
        plan = initial_plan(job)
        yield job, plan
        if job.training.dp > 1:
            # Every stage has a peer when dp > 1, so rerouting is always possible.
            yield job, reroute_plan(plan, rng.sample(plan.workers, 1))


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clipping"])
@pytest.mark.parametrize("seed", range(40))
def test_deduplicated_estimate_equals_the_full_graph(seed, clip):
    from dataclasses import replace

    for job, plan in _random_plans([seed]):
        if clip:
            job = replace(
                job,
                training=replace(job.training, global_norm=True),
                cluster=replace(job.cluster, store_round_trip_s=1e-3),
            )
        full = simulate(
            build_program(plan, job.model.layer_params, global_norm=clip), CostModel(job)
        )
        assert estimate(job, plan).step_s == pytest.approx(full.step_s, rel=1e-12)


def test_phi_grid_equals_the_general_walk_on_random_pipelines():
    rng = random.Random(7)

    class Costs:
        """Per-stage times keyed by stage index; transfer cost keyed by receiver."""

        def __init__(self, f, b, cf, cb):
            self.f, self.b, self.cf, self.cb = f, b, cf, cb

        def forward_s(self, first, end, worker=None):
            return self.f[first]

        def backward_s(self, first, end, worker=None):
            return self.b[first]

        def boundary_bytes(self, layer):
            return layer

        def transfer_s(self, src, dst, num_bytes):
            return self.cf[dst] if src < dst else self.cb[dst]

    for _ in range(500):
        p, m = rng.randint(1, 7), rng.randint(1, 12)
        f = [rng.uniform(0.1, 3) for _ in range(p)]
        b = [rng.uniform(0.1, 5) for _ in range(p)]
        cf = [0.0] + [rng.uniform(0, 1) for _ in range(p - 1)]
        cb = [rng.uniform(0, 1) for _ in range(p - 1)] + [0.0]
        fast = simulate_pipeline(f, b, cf, cb, m)
        ops = ops_for(
            [Route(0, tuple(range(p)), tuple(range(m)))], {i: i for i in range(m)}, {0: 0}
        )
        general = simulate_compute(ops, {k: (k, k + 1) for k in range(p)}, Costs(f, b, cf, cb))
        assert fast == pytest.approx([general[k] for k in range(p)])


def test_repeated_reroutes_never_deadlock():
    # Any set of routes ordered by phi is deadlock-free; exercise many random ones.
    rng = random.Random(3)
    for _ in range(200):
        dp, pp = rng.randint(2, 5), rng.randint(1, 5)
        job = uniform_job(
            dp=dp,
            pp=pp,
            num_layers=max(pp, rng.randint(pp, 10)),
            micro_batches=dp * rng.randint(1, 6),
        )
        plan = initial_plan(job)
        for _ in range(rng.randint(1, dp - 1)):
            victim = rng.choice(plan.workers)
            try:
                plan = reroute_plan(plan, [victim])
            except ValueError:
                break
            estimate(job, plan)  # raises ScheduleDeadlock if the program could deadlock


def test_a_cyclic_program_is_reported_as_a_deadlock():
    job = uniform_job(dp=1, pp=2, num_layers=2, micro_batches=2)
    plan = initial_plan(job)
    program = build_program(plan, job.model.layer_params)
    # Make stage 0 run both backwards before any forward: it waits for gradients of
    # micro-batches it never sent.
    first = program.workers[0]
    swapped = tuple(op for op in first.ops if op.kind.value == "B") + tuple(
        op for op in first.ops if op.kind.value == "F"
    )
    broken = type(program)(
        plan,
        (
            type(first)(
                plan,
                first.worker,
                first.first_layer,
                first.end_layer,
                swapped,
                first.tail,
                first.max_in_flight,
            ),
            program.workers[1],
        ),
        program.buckets,
    )
    with pytest.raises(ScheduleDeadlock, match="wait on each other"):
        simulate(broken, CostModel(job))


def test_communication_and_commit_add_to_the_step():
    from planner.job.workload import Link

    free = uniform_job(dp=2, pp=2, num_layers=4, micro_batches=4)
    slow = uniform_job(
        dp=2, pp=2, num_layers=4, micro_batches=4, intra=Link(1e3, 0.01), commit_s=0.5
    )
    assert (
        estimate(slow, initial_plan(slow)).step_s > estimate(free, initial_plan(free)).step_s + 0.5
    )


def test_plan_rejects_routes_that_skip_layers():
    with pytest.raises(ValueError, match="skips or repeats"):
        Plan(4, 1, (Stage(0, 0, 2), Stage(1, 3, 4)), (Route(0, (0, 1), (0,)),))
    with pytest.raises(ValueError, match="skips or repeats layers at worker 1"):
        Plan(4, 1, (Stage(0, 0, 2), Stage(1, 1, 4)), (Route(0, (0, 1), (0,)),))
    with pytest.raises(ValueError, match="through worker 7, which holds no stage"):
        Plan(4, 1, (Stage(0, 0, 2), Stage(1, 2, 4)), (Route(0, (0, 7), (0,)),))
    with pytest.raises(ValueError, match="does not reach the last layer"):
        Plan(4, 1, (Stage(0, 0, 2), Stage(1, 2, 4)), (Route(0, (0,), (0,)),))
    with pytest.raises(ValueError, match="does not reach the last layer"):
        Plan(4, 1, (Stage(0, 0, 2), Stage(1, 2, 4)), (Route(0, (0, 1), (0,)),), ((0,),))
    Plan(4, 1, (Stage(0, 0, 2), Stage(1, 2, 4)), (Route(0, (0, 1), (0,)),), ((0, 1),))
    with pytest.raises(ValueError, match="routed twice"):
        Plan(2, 1, (Stage(0, 0, 2), Stage(1, 0, 2)), (Route(0, (0,), (0,)), Route(1, (1,), (0,))))
    with pytest.raises(ValueError, match="not routed"):
        Plan(2, 2, (Stage(0, 0, 2),), (Route(0, (0,), (0,)),))


def test_a_tail_exchange_waits_for_its_last_holder_and_a_crossed_order_deadlocks():
    from planner.plans.program import Bucket, TailKind, TailOp

    job = uniform_job(dp=2, pp=1, num_layers=2, micro_batches=2)
    job = replace(job, cluster=replace(job.cluster, allreduce="exchange"))
    costs = CostModel(job)
    b0 = Bucket(index=0, first_layer=0, end_layer=1, holders=(0, 1), round=0)
    b1 = Bucket(index=1, first_layer=1, end_layer=2, holders=(0, 1), round=1)
    tail = (TailOp(TailKind.EXCHANGE, b0), TailOp(TailKind.EXCHANGE, b1), TailOp(TailKind.COMMIT))
    ranges = {0: (0, 2), 1: (0, 2)}
    timing = simulate_tails({0: 1.0, 1: 3.0}, {0: tail, 1: tail}, ranges, costs)
    first = 3.0 + costs.allreduce_s((0, 1), 0, 1)
    assert timing.commit_end_s == pytest.approx(
        first + costs.allreduce_s((0, 1), 1, 2) + costs.commit_s(2)
    )
    crossed = (tail[1], tail[0], tail[2])
    with pytest.raises(ScheduleDeadlock, match="worker 0 at exchange"):
        simulate_tails({0: 0.0, 1: 0.0}, {0: tail, 1: crossed}, ranges, costs)


def test_clipping_reports_each_layer_once_and_every_worker_reads_before_its_step():
    from planner.plans.program import TailKind

    job = uniform_job(dp=2, pp=2, num_layers=4, micro_batches=4)
    job = replace(job, cluster=replace(job.cluster, allreduce="exchange"))
    plan = reroute_plan(initial_plan(job), [1])  # a stage with one holder left
    # exchange: the norms go through the store
    program = build_program(plan, job.model.layer_params, global_norm=True, allreduce="exchange")
    counted = sorted(layer for p in program.workers for layer in p.owned_layers())
    assert counted == list(range(plan.num_layers))  # every layer once, whoever holds it
    for p in program.workers:
        kinds = [op.kind for op in p.tail]
        assert (TailKind.REPORT_NORM in kinds) == bool(p.owned_layers())
        assert kinds.index(TailKind.COMMIT) < kinds.index(TailKind.READ_NORM)
        assert kinds.index(TailKind.READ_NORM) < kinds.index(TailKind.OPTIMIZE)
        if TailKind.REPORT_NORM in kinds:
            assert kinds.index(TailKind.REPORT_NORM) < kinds.index(TailKind.COMMIT)
    plain = build_program(plan, job.model.layer_params, allreduce="exchange")
    assert all(TailKind.READ_NORM not in [op.kind for op in p.tail] for p in plain.workers)
    # the estimator times the program it is given: clipping costs its store round trips
    job = replace(job, cluster=replace(job.cluster, store_round_trip_s=1e-3))
    clipped_job = replace(job, training=replace(job.training, global_norm=True))
    assert estimate(clipped_job, plan).step_s > estimate(job, plan).step_s
    # A ring's commit sums the norms with the votes: no store operation in its tail, the
    # norm read after the commit, and the same step time with clipping as without.
    ring = build_program(plan, job.model.layer_params, global_norm=True)
    for p in ring.workers:
        kinds = [op.kind for op in p.tail]
        assert not {TailKind.REPORT_NORM, TailKind.REPORT_LOSS, TailKind.READ_LOSS} & set(kinds)
        assert kinds.index(TailKind.COMMIT) < kinds.index(TailKind.READ_NORM)
    ring_job = replace(job, cluster=replace(job.cluster, allreduce="ring"))
    clipped = replace(ring_job, training=replace(ring_job.training, global_norm=True))
    assert estimate(clipped, plan).step_s == pytest.approx(estimate(ring_job, plan).step_s)
