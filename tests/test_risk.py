"""The risk a layout takes at the next failure (planner.choice.risk), and the choice it changes."""

import math
import random
from pathlib import Path

import pytest

from planner.choice.policy import Policy
from planner.choice.risk import expected_redo_s, exposure, risk_s, windows
from planner.choice.selection import decide, score
from planner.config import load_job
from planner.job.failures import FailureRate, scope_shares
from planner.plans.layout import initial_plan
from planner.plans.plan import pipelines_plan
from planner.plans.reroute import reroute_plan
from planner.search.layouts import Search
from planner.simulation.trace import Event

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.fixture(scope="module")
def testbed():
    return load_job(CONFIGS / "cpu_testbed.toml")  # 2 pipelines of 4, one per node


def test_two_replicas_on_two_nodes_risk_nothing_at_the_next_failure(testbed):
    e = exposure(testbed, initial_plan(testbed))
    assert (e.fatal_share(), e.sole_holders, e.fatal_nodes) == (0.0, (), ())
    # ... only a second failure inside the recovery from the first: with D = 15 min and a
    # recovery window of well under a second, next to nothing (a thousandth of a second)
    assert 0 < risk_s(testbed, initial_plan(testbed), mtbf_s=900, since_checkpoint_s=0) < 1e-3


def _restart_cost(job, d, since):
    redo = expected_redo_s(since_s=since, interval_s=job.training.checkpoint_interval_s, mtbf_s=d)
    return job.cluster.detection_s + job.cluster.restart_s + redo


def test_a_failure_inside_the_recovery_from_the_next_one_is_charged(testbed):
    # Two replicas of every stage: losing any worker leaves its partner (same stage, the
    # other pipeline) the sole holder until a spare has the stage again. Each of the 8
    # workers has one partner, and its window is detection plus copying its stage.
    plan = initial_plan(testbed)
    w = windows(testbed, plan)
    assert w.workers == 8 and len(w.windows) == 8
    assert all(n == 1 and t > testbed.cluster.detection_s for t, n in w.windows)
    d = 2.5  # a soak's failure rate: one every few seconds
    device = 1 - scope_shares()[1]
    want = device * sum(-math.expm1(-t / d) for t, _n in w.windows) / (8 * 7)
    assert w.follow_on_share(d) == pytest.approx(want)
    assert risk_s(testbed, plan, mtbf_s=d, since_checkpoint_s=0) == pytest.approx(
        want * _restart_cost(testbed, d, 0)
    )

    # Data parallel, spread over both nodes (no node holds every replica): two whole
    # replicas are partners; with a third nobody is left alone by one loss, and there is
    # nothing to charge.
    def replicas(n):
        return pipelines_plan(
            num_layers=plan.num_layers, num_micro_batches=plan.num_micro_batches,
            pipelines=[[w] for w in (0, 4, 1)[:n]], boundaries=[[0, plan.num_layers]] * n,
            micro_batch_counts=[plan.num_micro_batches // n] * (n - 1)
            + [plan.num_micro_batches - plan.num_micro_batches // n * (n - 1)],
        )  # fmt: skip

    assert [n for _t, n in windows(testbed, replicas(2)).windows] == [1, 1]
    assert windows(testbed, replicas(2)).follow_on_share(d) > 0.05  # one in twenty
    assert windows(testbed, replicas(3)).follow_on_share(d) == 0.0
    assert risk_s(testbed, replicas(3), mtbf_s=d, since_checkpoint_s=0) == 0.0
    # The window grows the share with the failure rate, and it vanishes as D grows.
    assert w.follow_on_share(1.0) > w.follow_on_share(d) > w.follow_on_share(3600.0) > 0


def test_a_rerouted_stage_has_one_holder_left_and_its_node_with_it(testbed):
    plan = initial_plan(testbed)
    lost = 1
    peer = next(
        s.worker for s in plan.stages if s.worker != lost and s[1:] == plan.stage_of[lost][1:]
    )
    rerouted = reroute_plan(plan, [lost])
    e = exposure(testbed, rerouted)
    assert e.sole_holders == (peer,)
    assert e.fatal_nodes == (testbed.node_of(peer),)
    device, node = scope_shares()
    assert device == pytest.approx(0.587 + 0.129) and node == pytest.approx(0.284)
    on_node = sum(1 for w in rerouted.workers if testbed.node_of(w) == testbed.node_of(peer))
    assert e.fatal_share() == pytest.approx(device * 1 / 7 + node * on_node / 7)
    # A run whose failures never took a node fears for its nodes less.
    assert e.fatal_share(node_share=0.0) == pytest.approx(1 / 7)
    # Its cost: the share of failures that restart, times a restart and the work redone.
    d = 600.0
    redo = expected_redo_s(since_s=5.0, interval_s=30.0, mtbf_s=d)
    share = e.fatal_share() + windows(testbed, rerouted).follow_on_share(d)
    want = share * (testbed.cluster.detection_s + testbed.cluster.restart_s + redo)
    assert risk_s(testbed, rerouted, mtbf_s=d, since_checkpoint_s=5.0) == pytest.approx(want)


def test_one_pipeline_loses_a_layer_to_any_failure(testbed):
    plan = initial_plan(testbed)
    one = reroute_plan(plan, plan.pipelines[1])  # only pipeline 0 is left
    e = exposure(testbed, one)
    assert e.fatal_share() == pytest.approx(1.0)
    assert set(e.sole_holders) == set(plan.pipelines[0])


@pytest.mark.parametrize(
    ("since", "interval", "d"), [(0.0, 30.0, 10.0), (12.0, 30.0, 25.0), (29.0, 30.0, 400.0)]
)
def test_the_work_redone_is_that_of_a_poisson_arrival(since, interval, d):
    rng = random.Random(7)
    n = 200_000
    sampled = sum((since + rng.expovariate(1 / d)) % interval for _ in range(n)) / n
    assert expected_redo_s(since_s=since, interval_s=interval, mtbf_s=d) == pytest.approx(
        sampled, rel=0.01
    )


def test_the_limits_of_the_work_redone():
    # Rare failures: anywhere in the interval, half of it on average.
    assert expected_redo_s(since_s=0, interval_s=30, mtbf_s=1e9) == pytest.approx(15, rel=1e-6)
    # Failures far more often than checkpoints: the work since now, and D more.
    assert expected_redo_s(since_s=10, interval_s=3600, mtbf_s=1) == pytest.approx(11, rel=1e-6)


def test_the_risk_term_changes_the_choice_on_the_testbed(testbed):
    """chameleon plan --dry-run -c configs/cpu_testbed.toml --fail 1: the reroute is the
    faster step and the cheaper transition, but it leaves rank 1's stage one holder on a
    node that holds a whole pipeline: a quarter of next failures would restart. The
    re-partition keeps a copy of every layer on two nodes and wins."""
    current = initial_plan(testbed)
    decision = decide(testbed, current, [1], search=Search(testbed))
    reroute, reparallelize, _ = decision.candidates
    assert reroute.estimate.step_s < reparallelize.estimate.step_s
    assert reroute.transition.total_s < reparallelize.transition.total_s
    assert decision.risk_s(testbed, reroute) > 1.0
    assert decision.risk_s(testbed, reparallelize) == 0.0
    assert decision.chosen.policy is Policy.REPARALLELIZE

    # Blind to the next failure (the same D, no risk term), the reroute would have won.
    def blind(c):  # noqa: ANN001, ANN202
        return score(
            global_batch=testbed.training.global_batch_size,
            step_s=c.estimate.step_s,
            transition_s=c.transition.total_s,
            mtbf_s=decision.mtbf_s,
        )

    assert blind(reroute) > blind(reparallelize)


def test_the_share_of_node_failures_is_learned():
    prior = FailureRate(device_mtbf_s=3600.0)
    assert prior.node_share() == pytest.approx(scope_shares()[1])
    devices_only = prior.observe(devices=8, seconds=60, failures=3)
    assert devices_only.node_share() == pytest.approx(scope_shares()[1] / 4)
    nodes = devices_only.observe(devices=8, seconds=60, failures=1, node_failures=1)
    assert nodes.node_share() == pytest.approx((scope_shares()[1] + 1) / 5)


def test_a_failure_takes_a_node_by_its_cause_or_by_what_it_took(testbed):
    node0 = tuple(testbed.workers_on_node(0))
    assert Event(1.0, "fail", (1,), "host").takes_node(testbed)
    assert not Event(1.0, "fail", node0, "gpu").takes_node(testbed)
    assert Event(1.0, "fail", node0).takes_node(testbed)
    assert not Event(1.0, "fail", node0[:2]).takes_node(testbed)


def test_a_growth_pays_for_the_risk_of_the_layout_it_moves_to():
    # 10% faster steps for a 0.5 s move are worth it at D = 60 s, with no risk on either
    # side; not when the faster layout risks a restart that costs 30 s at one failure
    # in five (6 s expected), and again when staying risks as much as growing.
    from planner.choice.selection import worth_growing

    fast = dict(current_s=1.0, grown_s=0.9, transition_s=0.5, mtbf_s=60.0)
    assert worth_growing(**fast)
    assert not worth_growing(**fast, grown_risk_s=6.0)
    assert worth_growing(**fast, current_risk_s=6.0, grown_risk_s=6.0)
