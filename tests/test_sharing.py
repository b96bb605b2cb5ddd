"""A step on a shared host (planner.estimator.sharing): the program under processor sharing agrees
with the critical path when every worker has a core, with the host's CPU over its cores
when nobody waits, and lets a waiting stage's core go to the others."""

from dataclasses import replace

import pytest

from planner.estimator.estimate import estimate
from planner.estimator.sharing import simulate_shared
from planner.estimator.timing import simulate
from planner.job.cost import CostModel
from planner.plans.layout import initial_plan
from planner.plans.program import build_program
from planner.plans.reroute import reroute_plan
from tests.synthetic import uniform_job


def _shared(job, cores):  # noqa: ANN001, ANN202
    return replace(job, cluster=replace(job.cluster, host_cores=cores, nodes_per_host=64))


def _step(job, plan, cores, own=0.0):  # noqa: ANN001, ANN202
    program = build_program(plan, job.model.layer_params)
    return simulate_shared(
        program, CostModel(job), cores=cores, host_of=dict.fromkeys(plan.workers, 0),
        own_cpu_s=dict.fromkeys(plan.workers, own),
    )  # fmt: skip


@pytest.mark.parametrize(("dp", "pp"), [(1, 4), (2, 4), (4, 2), (3, 1)])
def test_with_a_core_per_worker_it_is_the_critical_path(dp, pp):
    job = uniform_job(dp=dp, pp=pp, num_layers=8, micro_batches=8 * dp)
    plan = initial_plan(job)
    expected = simulate(build_program(plan, job.model.layer_params), CostModel(job)).step_s
    assert _step(job, plan, cores=dp * pp) == pytest.approx(expected)


def test_a_rerouted_plan_too():
    job = uniform_job(dp=2, pp=4, num_layers=8, micro_batches=16)
    plan = reroute_plan(initial_plan(job), [5])
    expected = simulate(build_program(plan, job.model.layer_params), CostModel(job)).step_s
    assert _step(job, plan, cores=8) == pytest.approx(expected)


def test_workers_that_never_wait_share_the_cores_evenly():
    # Data parallel only, free links: 4 workers of 4 micro-batches each (3 s per
    # micro-batch over 8 layers: 24 s of passes) on 2 cores, plus 1 s of their own CPU.
    job = uniform_job(dp=4, pp=1, num_layers=8, micro_batches=16)
    plan = initial_plan(job)
    assert _step(job, plan, cores=2, own=1.0) == pytest.approx(4 * (4 * 24 + 1) / 2)


def test_a_stage_waiting_for_its_input_leaves_its_core_to_the_others():
    # One pipeline of 2 stages on 1 core: while stage 1 waits for the first forward,
    # stage 0 has the core alone; the step is longer than the CPU over the cores only
    # by what nobody could run, and shorter than the critical path with a core each
    # stretched by 2.
    job = uniform_job(dp=1, pp=2, num_layers=8, micro_batches=4)
    plan = initial_plan(job)
    cpu = 2 * 4 * (4 * 1.0 + 4 * 2.0)  # both stages, 4 micro-batches, forward + backward
    one_core = _step(job, plan, cores=1)
    assert one_core == pytest.approx(cpu)  # one core never idles: someone can always run
    alone = _step(job, plan, cores=2)
    assert alone == pytest.approx(estimate(job, plan).step_s)
    assert cpu / 2 < alone < cpu


def test_the_estimate_on_a_shared_host_is_the_program_under_sharing():
    job = _shared(uniform_job(dp=2, pp=4, num_layers=8, micro_batches=16), cores=2.0)
    plan = initial_plan(job)
    assert estimate(job, plan).step_s == pytest.approx(_step(job, plan, cores=2.0))
