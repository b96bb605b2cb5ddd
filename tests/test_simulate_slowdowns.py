"""chameleon simulate with stragglers beside failures: traces with slowdowns, every step
held back to the slow worker's pace for the policies that wait, adaptive dealing around
it as chameleon run does once that pays, and back when it ends."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from planner.choice.stragglers import break_even_s, straggler_choice
from planner.config import load_job
from planner.estimator.estimate import estimate
from planner.job.errors import ConfigError
from planner.simulation import trace as traces
from planner.simulation.outcome import simulate
from planner.simulation.simulate import FOUND_AFTER_STEPS, POLICIES, Simulator
from planner.simulation.trace import Event, Trace

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
HOUR = 3600.0


@pytest.fixture(scope="module")
def sim():
    return Simulator(load_job(CONFIGS / "ascend910b_32_gpt13b.toml"))


def slowdown(worker: int, factor: float, t_s: float, lasts_s: float) -> tuple[Event, Event]:
    return (
        Event(t_s, "slow", (worker,), "test", factor),
        Event(t_s + lasts_s, "speed", (worker,), "test"),
    )


def test_a_trace_file_brings_slowdowns_and_bad_ones_are_named(sim, tmp_path):
    job = sim.job
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"events": [
        {"t_hours": 1, "slow_ranks": [0], "factor": 3, "for_hours": 0.5},
        {"t_hours": 2, "fail_ranks": [0]},
    ]}))  # fmt: skip
    tr = traces.load(path, job, duration_s=10 * HOUR)
    assert [(e.t_s, e.kind, e.factor) for e in tr.events] == [
        (HOUR, "slow", 3.0), (1.5 * HOUR, "speed", 1.0), (2 * HOUR, "fail", 1.0)
    ]  # fmt: skip
    assert tr.events[0].workers == (job.worker_of(0),)
    assert (tr.failures, tr.slowdowns) == (1, 1)
    for event, words in [
        ({"t_hours": 1, "slow_ranks": [0], "factor": 3}, "needs factor and for_hours"),
        ({"t_hours": 1, "fail_ranks": [0], "factor": 3}, "belong to a slowdown"),
        ({"t_hours": 1, "slow_ranks": [0], "factor": 0.5, "for_hours": 1}, "greater than 1"),
    ]:
        path.write_text(json.dumps({"events": [event]}))
        with pytest.raises(ConfigError, match=words):
            traces.load(path, job, duration_s=HOUR)


def test_drawn_slowdowns_leave_the_failures_as_they_were(sim):
    job = sim.job
    plain = traces.generated(job, duration_s=200 * HOUR, seed=5, mtbf_s=2 * HOUR)
    spec = traces.Slowdowns(every_s=HOUR, factor=2.5, for_s=0.25 * HOUR)
    slowed = traces.generated(job, duration_s=200 * HOUR, seed=5, mtbf_s=2 * HOUR, slowdowns=spec)
    assert [e for e in slowed.events if e.kind in ("fail", "repair")] == list(plain.events)
    starts = [e for e in slowed.events if e.kind == "slow"]
    assert 160 < len(starts) < 240  # 200 h at one an hour
    assert all(e.factor == 2.5 and len(e.workers) == 1 for e in starts)
    ends = [e for e in slowed.events if e.kind == "speed"]
    mean = sum(b.t_s - a.t_s for a, b in zip(starts, ends)) / len(ends)
    assert 0.15 * HOUR < mean < 0.35 * HOUR
    with pytest.raises(ConfigError, match="above 1"):
        traces.Slowdowns(every_s=HOUR, factor=1.0)


def test_the_policies_that_wait_train_at_the_slow_workers_pace(sim):
    job, lasts = sim.job, 2 * HOUR
    tr = Trace("slow", 10 * HOUR, slowdown(3, 3.0, HOUR, lasts), "test")
    slow_step = estimate(replace(job, slow=((3, 3.0),)), sim.plan0).step_s
    assert slow_step > sim.step0_s * 1.2
    for policy in ("reroute", "reparallelize", "restart"):
        t = sim.run(tr, policy).totals
        batch = job.training.global_batch_size
        expected = sim.rate0 * (tr.duration_s - lasts) + batch / slow_step * lasts
        assert t.samples == pytest.approx(expected)
        assert t.slowed_s == pytest.approx(lasts)
        assert t.deals == 0 and t.transition_s == 0
        assert t.degraded_s == pytest.approx(lasts * (1 - sim.step0_s / slow_step))


def test_adaptive_deals_around_a_lasting_slowdown_once_it_pays_and_back_at_its_end(sim):
    job, t0, lasts = sim.job, HOUR, 2 * HOUR
    tr = Trace("slow", 10 * HOUR, slowdown(3, 3.0, t0, lasts), "test")
    choice = straggler_choice(
        replace(job, slow=((3, 3.0),)), sim.plan0, 1.0, leave_out=False, repartition=False
    )
    h = break_even_s(choice)
    assert h is not None and h < lasts
    stay, uneven = choice.stay, choice.options[1]
    moved_at = t0 + max(h, FOUND_AFTER_STEPS * stay.estimate.step_s)
    there = uneven.transition_s - uneven.back_s
    adaptive = sim.run(tr, "adaptive").totals
    assert adaptive.deals == 2  # there, and back once the worker has its speed
    batch = job.training.global_batch_size
    expected = (
        sim.rate0 * (tr.duration_s - lasts - uneven.back_s)
        + batch / stay.estimate.step_s * (moved_at - t0)
        + batch / uneven.estimate.step_s * (t0 + lasts - moved_at - there)
    )
    assert adaptive.samples == pytest.approx(expected)
    waited = sim.run(tr, "reroute").totals
    assert adaptive.samples > waited.samples
    # A slowdown over before the deal pays moves nothing: adaptive waits, as the others.
    brief = Trace("brief", 10 * HOUR, slowdown(3, 3.0, t0, 0.5 * h), "test")
    t = sim.run(brief, "adaptive").totals
    assert t.deals == 0
    assert t.samples == pytest.approx(sim.run(brief, "reroute").totals.samples)


def test_slowdowns_and_failures_together_account_for_every_second(sim):
    events = sorted(
        [
            *slowdown(3, 3.0, HOUR, 3 * HOUR),
            Event(2 * HOUR, "fail", (7,)),  # mid-deal: a failure's plan replaces the deal
            Event(2.5 * HOUR, "fail", (3,)),  # the slow worker itself
            *slowdown(9, 2.0, 5 * HOUR, 2 * HOUR),
            Event(5.5 * HOUR, "repair", (3, 7)),
        ],
        key=lambda e: e.t_s,
    )
    tr = Trace("mixed", 12 * HOUR, tuple(events), "test")
    report = simulate(sim.job, tr, POLICIES, sim=sim)
    for o in report.outcomes:
        state = sim.run(tr, o.policy) if o.policy != "oracle" else None
        if state is not None:
            t = state.totals
            total = t.useful_s + t.transition_s + t.redo_s + t.stopped_s
            assert total == pytest.approx(tr.duration_s), o.policy
    by = {o.policy: o for o in report.outcomes}
    assert report.slowdowns == 2
    assert by["oracle"].throughput >= by["adaptive"].throughput - 1e-9
    assert by["adaptive"].deals >= 2
