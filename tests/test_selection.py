"""Policy selection by expected throughput until the next failure."""

import itertools
import math
from pathlib import Path

import pytest

from planner.choice.policy import Candidate, Policy, Transition
from planner.choice.selection import Outlook, choose, decide, score
from planner.estimator.estimate import Estimate
from planner.plans.layout import initial_plan
from tests.synthetic import uniform_job

ROOT = Path(__file__).resolve().parent.parent


def _frozen_clock():
    return itertools.repeat(0.0).__next__


def test_paper_worked_example_flips_at_ten_over_ln_two():
    # PAPER.md: B = 10, t_reroute = 2 s, t_dynamic = 1 s, transition 10 s. The paper's
    # first-order score flips at D = 20 s; the exact one where 10 exp(-10 / D) = 5, at
    # D = 10 / ln 2 = 14.4 s: a 10 s transition is paid in full whenever the failure comes
    # after it, so the paper's form (which charges it pro rata) undervalues it.
    flip = 10 / math.log(2)

    def reroute(d):
        return score(global_batch=10, step_s=2.0, transition_s=0.0, mtbf_s=d)

    def dynamic(d):
        return score(global_batch=10, step_s=1.0, transition_s=10.0, mtbf_s=d)

    assert reroute(flip) == pytest.approx(dynamic(flip)) == pytest.approx(5.0)
    assert reroute(flip - 0.1) > dynamic(flip - 0.1)
    assert dynamic(flip + 0.1) > reroute(flip + 0.1)
    # The first-order form's error is second order in t_transition / D.
    for d in (100.0, 1000.0):
        first_order = 10 * (d - 10) / d
        assert dynamic(d) == pytest.approx(first_order, rel=(10 / d) ** 2)


def test_the_score_is_never_negative_and_has_the_right_limits():
    fast_slow_move = dict(global_batch=8, step_s=1.0, transition_s=30.0)
    slow_no_move = dict(global_batch=8, step_s=1.5, transition_s=0.5)
    for d in (1e-3, 0.1, 1.0, 10.0, 1e3, 1e9):
        assert score(**fast_slow_move, mtbf_s=d) >= 0
        assert score(**slow_no_move, mtbf_s=d) >= 0
    # D -> 0: the cheaper transition wins even though its step is slower (the paper's
    # form gave -239.0 against -10.7 here and picked the slower step for the wrong reason).
    assert score(**slow_no_move, mtbf_s=0.1) > score(**fast_slow_move, mtbf_s=0.1)
    # D -> infinity: the faster step.
    assert score(**fast_slow_move, mtbf_s=1e6) > score(**slow_no_move, mtbf_s=1e6)


def test_choose_applies_the_worked_example_to_candidates():
    job = uniform_job(dp=2, pp=1, num_layers=2, micro_batches=10)
    plan = initial_plan(job)

    def candidate(policy, step_s, transition_s):
        est = Estimate(
            plan=plan, step_s=step_s, memory_bytes={0: 1}, in_flight={0: 1}, limit_bytes=10
        )
        return Candidate(
            policy, plan=plan, estimate=est, transition=Transition(migration_s=transition_s)
        )

    candidates = [candidate(Policy.REROUTE, 2.0, 0.0), candidate(Policy.REPARALLELIZE, 1.0, 10.0)]
    flip = 10 / math.log(2)
    assert choose(job, candidates, Outlook(flip - 0.5)).policy is Policy.REROUTE
    assert choose(job, candidates, Outlook(flip + 0.5)).policy is Policy.REPARALLELIZE
    # A tie goes to the least disruptive policy.
    tied = [candidate(Policy.REPARALLELIZE, 2.0, 0.0), candidate(Policy.REROUTE, 2.0, 0.0)]
    assert choose(job, tied, Outlook(1.0)).policy is Policy.REROUTE


def test_decision_flips_with_mtbf_on_a_real_plan():
    # Stage 0 of one of 4 pipelines dies. Its peers absorb its micro-batches in their
    # bubbles (about 1.15x), cheaper than dropping the pipeline; a 3x4 + 1x3 re-split is
    # faster still (1.09x) but must move weights over slow links first. Short windows
    # favour rerouting, long ones the new plan.
    from planner.job.workload import Link

    link = Link(1e5, 0.0)
    job = uniform_job(dp=4, pp=4, num_layers=8, micro_batches=32, intra=link, inter=link)
    current = initial_plan(job)
    short = decide(job, current, [0], mtbf_s=2.0, clock=_frozen_clock())
    long = decide(job, current, [0], mtbf_s=1e6, clock=_frozen_clock())
    reroute, reparallelize, _restart = long.candidates
    assert reparallelize.estimate.step_s < reroute.estimate.step_s
    assert reparallelize.transition.total_s > reroute.transition.total_s
    assert short.chosen.policy is Policy.REROUTE
    assert long.chosen.policy is Policy.REPARALLELIZE


def test_forced_policy_is_taken_when_feasible_and_refused_when_not():
    job = uniform_job(dp=2, pp=2, num_layers=4)
    current = initial_plan(job)
    forced = decide(job, current, [1], policy=Policy.RESTART, clock=_frozen_clock())
    assert forced.chosen.policy is Policy.RESTART
    # Both replicas of stage 0 lost: rerouting has nowhere to send their micro-batches.
    impossible = decide(job, current, [0, 2], policy=Policy.REROUTE, clock=_frozen_clock())
    assert impossible.chosen is None
    assert "lost every replica" in impossible.candidates[0].reason


def test_losing_every_replica_of_a_stage_falls_back_to_restart():
    job = uniform_job(dp=2, pp=2, num_layers=4)
    decision = decide(job, initial_plan(job), [0, 2], clock=_frozen_clock())
    reroute, reparallelize, restart = decision.candidates
    assert not reroute.feasible and not reparallelize.feasible
    assert "lost every replica" in reparallelize.reason
    assert decision.chosen is restart


def test_restart_uses_spares_at_the_old_size():
    job = uniform_job(dp=2, pp=2, num_layers=4, per_node=2, spare_nodes=1)
    decision = decide(job, initial_plan(job), [1], clock=_frozen_clock())
    restart = decision.candidates[2]
    assert restart.feasible
    assert sorted(restart.plan.workers) == [0, 2, 3, 4]  # spare worker 4 replaces 1
    assert restart.estimate.step_s == pytest.approx(decision.baseline.step_s)
    assert restart.transition.restart_s == job.cluster.restart_s


def test_the_launch_layout_is_the_best_scoring_of_every_shape_on_a_small_cluster():
    """pipeline_stages="auto": on the test bed (8 workers, one host of 2 cores) the
    launch times every shape; it starts no slower than the layout the config names,
    which the search's ranking alone left out (it proposed 4x2, 1.5% slower)."""
    from planner.choice.selection import launch_choice
    from planner.config import load_job
    from planner.search.layouts import Search

    job = load_job(ROOT / "configs" / "cpu_testbed.toml")
    workers = list(range(job.cluster.num_devices))
    configured = Search(job).estimate(initial_plan(job)).step_s
    ranked = Search(job).propose(None, workers)[0].estimate.step_s
    choice = launch_choice(job, workers, Outlook(mtbf_s=3600.0))
    assert choice is not None and choice.estimate.feasible
    assert choice.estimate.step_s <= configured * (1 + 1e-9) < ranked
    assert set(choice.plan.workers) <= set(workers)


def test_no_launch_layout_when_nothing_fits():
    from planner.choice.selection import launch_choice

    job = uniform_job(dp=2, pp=2, num_layers=4, memory_bytes=10)
    assert launch_choice(job, list(range(4)), Outlook(mtbf_s=3600.0)) is None
