"""The choice on every shipped config: its limits in D (with the next failure's risk), reroute's transition, the sign of
every score, and D learned from failures (planner.job.failures)."""

from pathlib import Path

import pytest

from planner.choice.policy import Policy, reparallelize_candidates
from planner.choice.selection import decide
from planner.config import load_job
from planner.job.failures import FailureRate
from planner.plans.layout import initial_plan
from planner.search.layouts import Search

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.toml"))
# D far below every transition (scores underflow to 0; the choice compares their logs)
TINY_D_S, HUGE_D_S = 1e-7, 1e12


def _big_configs():
    for path in CONFIGS:
        job = load_job(path)
        if job.num_workers >= 8:
            # (the 1,024-GPU HSDP job's four decisions take 2 s here: the full suite's,
            # not the fast tier's)
            marks = [pytest.mark.slow] if path.stem.endswith("_hsdp") else []
            yield pytest.param(job, id=path.stem, marks=marks)


@pytest.mark.parametrize("job", list(_big_configs()))
@pytest.mark.timeout(60)  # 2 s measured (27 s before turn_counts halved its search)
def test_the_choice_has_the_right_limits_on_every_shipped_config(job):
    current = initial_plan(job)
    search = Search(job)
    for failed in ([1], [job.num_workers - 1]):
        near = decide(job, current, failed, mtbf_s=TINY_D_S, search=search)
        far = decide(job, current, failed, mtbf_s=HUGE_D_S, search=search)
        for decision in (near, far):
            feasible = [c for c in decision.candidates if c.feasible]
            assert all(decision.score(job, c) >= 0 for c in feasible)

        # As D -> 0 the cheapest cost over this failure and the next wins: the transition
        # plus the restart the layout it leaves risks (planner.choice.risk).
        def cost(c, near=near):  # noqa: ANN001, ANN202
            return c.transition.total_s + near.risk_s(job, c)

        cheapest = min(cost(c) for c in near.candidates if c.feasible)
        assert cost(near.chosen) == pytest.approx(cheapest)
        fastest = min(c.estimate.step_s for c in far.candidates if c.feasible)
        assert far.chosen.estimate.step_s == pytest.approx(fastest)
        # Rerouting pays less than any re-partition the search proposes.
        reroute = near.candidates[0]
        assert reroute.policy is Policy.REROUTE and reroute.feasible
        survivors = [w for w in current.workers if w not in failed]
        proposals = search.propose(current, survivors)
        options = reparallelize_candidates(
            search, proposals, current, survivors, failed=failed, search_s=near.search_s
        )
        if job.training.shards > 1:  # (a sharded job weighs whole groups taken back only)
            options = [c for c in near.candidates[1:2] if c.feasible]
        assert near.search_s > 0

        def own(c):  # noqa: ANN001, ANN202
            # What the policy itself costs. The protocol's messages are paid by both, and a
            # plan that leaves workers idle pays less of them (fewer reports; on a shared
            # host, fewer runnable processes to wake up behind): on the profiled CPU test
            # bed a "keep intact pipelines" of 4 workers confirms ~7 ms sooner than 7.
            return c.transition.total_s - c.transition.protocol_s

        assert all(own(reroute) < own(o) for o in options)
        assert all(c.transition.protocol_s > 0 for c in (reroute, *options))


def test_d_comes_from_the_devices_in_use_unless_given():
    job = load_job(CONFIGS[0].parent / "h100_16384_llama405b.toml")
    current = initial_plan(job)
    decision = decide(job, current, [1], search=Search(job))
    devices = (job.num_workers - 1) * job.tp
    assert decision.mtbf_s == pytest.approx(job.cluster.device_mtbf_s / devices)
    assert "prior" in decision.mtbf_source and str(devices) in decision.mtbf_source
    given = decide(job, current, [1], mtbf_s=60.0, search=Search(job))
    assert (given.mtbf_s, given.mtbf_source) == (60.0, "--mtbf")


def test_the_posterior_follows_the_failures_a_job_sees():
    hour = 3600.0
    prior = FailureRate(device_mtbf_s=1000 * hour)  # D = 125 h on 8 devices
    assert prior.mtbf(8).seconds == pytest.approx(125 * hour)
    # 8 devices fail 5 times in 10 hours: Gamma(1 + 5, 1000 h + 80 h) per device-hour.
    seen = prior.observe(devices=8, seconds=10 * hour, failures=5)
    assert seen.mtbf(8).seconds == pytest.approx(1080 / 6 / 8 * hour)
    assert "5 failure(s)" in seen.mtbf(8).source
    # Many failures: D tends to what the job observes (80 device-hours / 50 failures).
    many = prior.observe(devices=8, seconds=10 * 3600 * 100, failures=500)
    assert many.mtbf(8).seconds == pytest.approx(8000 / 500 / 8 * hour, rel=0.15)
    # None at all for long: D grows past the prior.
    quiet = prior.observe(devices=8, seconds=10_000 * hour)
    assert quiet.mtbf(8).seconds > prior.mtbf(8).seconds
    # D given outright is never learned.
    fixed = FailureRate(1000 * hour, fixed_s=60.0, fixed_source="--mtbf")
    assert fixed.observe(devices=8, seconds=hour, failures=9).mtbf(8).seconds == 60.0
