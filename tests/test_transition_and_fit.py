"""The groups a recovery must build (planner.estimator.transition), the fit to measured steps
(planner.estimator.fit) and its move to another load (planner.plans.load)."""

from dataclasses import replace

import pytest

from planner.estimator.estimate import estimate, message_ops
from planner.estimator.fit import fit_host
from planner.estimator.transition import build_s, groups_to_build
from planner.job.cost import CostModel
from planner.plans.layout import initial_plan
from planner.plans.load import at_load
from planner.plans.plan import pipelines_plan
from planner.plans.reroute import reroute_plan
from tests.synthetic import uniform_job


def test_the_gloo_runtime_keeps_its_group_unless_an_outsider_joins():
    job = uniform_job(dp=2, pp=2, num_layers=4)
    job = replace(job, cluster=replace(job.cluster, allreduce="exchange"))
    current = initial_plan(job)
    rerouted = reroute_plan(current, [1])
    assert groups_to_build(job, current, rerouted, [1]) == []
    # A plan that also involves a worker outside the group (a replacement, 4) builds one
    # over all its members.
    assert groups_to_build(job, current, rerouted, [1], members=[4]) == [frozenset({0, 2, 3, 4})]


def test_on_nccl_a_reroute_rebuilds_only_the_failed_stages_group():
    job = uniform_job(dp=4, pp=2, num_layers=4)  # pipelines (0,1) (2,3) (4,5) (6,7)
    current = initial_plan(job)
    built = groups_to_build(job, current, reroute_plan(current, [3]), [3])
    stage_1 = {w for s in current.stages if s.first_layer == 2 for w in [s.worker]} - {3}
    assert built == [frozenset(stage_1)]  # intact pipelines and stage 0's group are kept
    cluster = job.cluster
    assert build_s(job, built) == pytest.approx(
        cluster.pg_init_base_s + cluster.pg_init_per_worker_s * 3 + 3 * cluster.store_round_trip_s
    )


def test_message_ops_count_every_send_and_receive():
    job = uniform_job(dp=2, pp=3, num_layers=6, micro_batches=8)  # 4 per pipeline
    ops = message_ops(initial_plan(job), job.model.layer_params)
    # Ends: one neighbour, middles two, each both ways per micro-batch; plus one bucket
    # peer (send and receive) per worker.
    assert sorted(ops.values()) == [2 * 4 + 2] * 4 + [4 * 4 + 2] * 2


def _shared_host(job, cores=2.0):
    return replace(job, cluster=replace(job.cluster, host_cores=cores, nodes_per_host=1))


def test_the_fit_separates_base_and_per_message_cpu_and_reproduces_the_step():
    job = _shared_host(
        uniform_job(dp=2, pp=4, num_layers=8, micro_batches=8, forward_s=0.001, backward_s=0.002)
    )
    plan = initial_plan(job)
    ops = message_ops(plan, job.model.layer_params, job.cluster.allreduce)
    compute = {w: 0.030 for w in plan.workers}
    cpu = {w: 0.030 + 0.002 + 0.0005 * ops[w] for w in plan.workers}  # base 2 ms, 0.5 ms/msg
    fit = fit_host(job, plan, 0.200, cpu, compute)
    assert fit.overhead_s == pytest.approx(0.002) and fit.message_cpu_s == pytest.approx(0.0005)
    fitted = fit.apply(job)
    assert estimate(fitted, plan).step_s == pytest.approx(0.200, rel=0.02)


def test_the_pass_loop_cpu_is_charged_per_pass_apart_from_the_overhead():
    job = _shared_host(uniform_job(dp=2, pp=2, num_layers=4, micro_batches=8))
    plan = initial_plan(job)
    compute = {w: 0.030 for w in plan.workers}
    # Every worker runs 8 passes per step (4 micro-batches, forward and backward): 0.4 ms
    # of loop CPU each, then a base of 2 ms beyond it.
    loop = {w: 8 * 0.0004 for w in plan.workers}
    cpu = {w: compute[w] + loop[w] + 0.002 for w in plan.workers}
    fit = fit_host(job, plan, 0.200, cpu, compute, pass_cpu_s=loop)
    assert fit.pass_cpu_s == pytest.approx(0.0004)
    assert fit.overhead_s == pytest.approx(0.002)
    fitted = fit.apply(job)
    costs = CostModel(fitted)
    layers = fitted.model.total("forward_s", 0, 2)
    assert costs.forward_s(0, 2) == pytest.approx(layers + 0.0004)


def test_a_fit_moves_to_another_load_by_the_measured_contention():
    job = _shared_host(
        uniform_job(dp=4, pp=2, num_layers=4, micro_batches=8, forward_s=0.001, backward_s=0.002)
    )
    plan = initial_plan(job)  # 8 workers on one host of 2 cores
    compute = {w: 0.020 for w in plan.workers}
    cpu = {w: 0.025 for w in plan.workers}
    # One process alone: the same passes cost 2 / (1 + 7c) of 8 at once; here c = 0.1.
    passes = 8 * 4 * (0.001 + 0.002)
    fit = fit_host(job, plan, 0.150, cpu, compute, alone_passes_cpu_s=None)
    k8 = fit.factor
    alone = passes * k8 / 1.7
    fit = fit_host(job, plan, 0.150, cpu, compute, alone_passes_cpu_s=alone)
    assert fit.contention == pytest.approx(0.1)
    fitted = fit.apply(job)
    assert at_load(fitted, plan) == (fitted, None)  # at the load it was fitted at
    smaller = pipelines_plan(
        num_layers=4, num_micro_batches=8, pipelines=[[0, 1], [2, 3]], boundaries=[[0, 2, 4]] * 2,
        micro_batch_counts=[4, 4],
    )  # fmt: skip
    moved, load = at_load(fitted, smaller)
    assert load == 4
    k = (1 + 0.1 * 3) / (1 + 0.1 * 7)
    assert moved.model.layers[0].forward_s == pytest.approx(fitted.model.layers[0].forward_s * k)
    # The runtime's own CPU does not scale with the passes' contention (planner.plans.load).
    assert moved.cluster.worker_overhead_s == fitted.cluster.worker_overhead_s > 0


def test_a_wake_up_waits_only_while_more_processes_are_runnable_than_cores():
    from planner.plans.load import wait_at_s

    job = _shared_host(uniform_job(dp=4, pp=2, num_layers=4, micro_batches=8))
    fitted = replace(
        job, cluster=replace(job.cluster, fitted_workers=8, message_wait_s=0.006, host_cores=2)
    )
    assert wait_at_s(fitted, 8) == pytest.approx(0.006)
    # less than in proportion to the queue (planner.plans.load: measured)
    assert wait_at_s(fitted, 5) == pytest.approx(0.006 * (3 / 6) ** 0.5)
    assert wait_at_s(fitted, 2) == 0.0 and wait_at_s(fitted, 1) == 0.0
