"""chameleon simulate: traces, the accounting of a run, the policies and the oracle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.choice.policy import Policy, reroute_candidate, restart_candidate
from planner.choice.selection import (
    choose,
    log_score,
    reparallelize_options,
    restart_variants,
)
from planner.config import load_job
from planner.job.errors import ConfigError
from planner.simulation import trace as traces
from planner.simulation.oracle import oracle
from planner.simulation.outcome import simulate
from planner.simulation.simulate import POLICIES, REDUNDANT_OVERHEAD, Simulator
from planner.simulation.trace import Event, Trace

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
HOUR = 3600.0


@pytest.fixture(scope="module")
def ascend():
    return load_job(CONFIGS / "ascend910b_32_gpt13b.toml")


@pytest.fixture(scope="module")
def sim(ascend):
    return Simulator(ascend)


def one_failure(worker: int, t_s: float, duration_s: float) -> Trace:
    return Trace("one", duration_s, (Event(t_s, "fail", (worker,)),), "test")


def test_generated_trace_follows_the_rate_the_causes_and_the_repairs(ascend):
    mtbf = 0.5 * HOUR
    tr = traces.generated(ascend, duration_s=500 * HOUR, seed=3, mtbf_s=mtbf, repair_s=2 * HOUR)
    fails = [e for e in tr.events if e.kind == "fail"]
    assert 0.85 * 1000 < len(fails) < 1.15 * 1000  # 500 h at one per 0.5 h
    per_node = ascend.cluster.devices_per_node // ascend.tp
    for e in fails:
        if e.cause in ("network", "host"):
            assert len(e.workers) == per_node  # a whole node
        else:
            assert len(e.workers) == 1
    share = sum(e.cause == "gpu" for e in fails) / len(fails)
    assert abs(share - 0.587) < 0.06
    repairs = {(e.workers, round(e.t_s, 6)) for e in tr.events if e.kind == "repair"}
    for e in fails:
        back = traces.PROCESS_RESTART_S if e.cause == "software" else 2 * HOUR
        if e.t_s + back < tr.duration_s:
            assert (e.workers, round(e.t_s + back, 6)) in repairs
    # The job's own rate when no --mtbf: its devices over device_mtbf_hours.
    own = traces.generated(ascend, duration_s=2000 * HOUR, seed=1)
    expected = 2000 * HOUR * ascend.cluster.num_devices / ascend.cluster.device_mtbf_s
    assert 0.8 * expected < own.failures < 1.2 * expected


def test_oobleck_trace_halves_the_job_at_its_interval(ascend):
    tr = traces.oobleck(ascend, 600.0, duration_s=10 * HOUR, seed=1)
    assert [e.t_s for e in tr.events] == [600.0 * (i + 1) for i in range(ascend.num_workers // 2)]
    lost = [w for e in tr.events for w in e.workers]
    assert len(set(lost)) == len(lost) == ascend.num_workers // 2
    assert tr.name == "oobleck-10m"


def test_a_trace_file_is_read_and_bad_ones_are_named(ascend, tmp_path):
    good = tmp_path / "t.json"
    good.write_text(
        json.dumps(
            {"events": [{"t_hours": 1, "fail_nodes": [1]}, {"t_hours": 3, "repair_nodes": [1]}]}
        )
    )
    tr = traces.load(good, ascend, duration_s=10 * HOUR)
    assert [(e.t_s, e.kind) for e in tr.events] == [(HOUR, "fail"), (3 * HOUR, "repair")]
    assert tr.events[0].workers == tuple(ascend.workers_on_node(1))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"events": [{"t_hours": 1, "fail_ranks": [999]}]}))
    with pytest.raises(ConfigError, match="event 0: 999 is not in the cluster"):
        traces.load(bad, ascend, duration_s=HOUR)
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not a JSON trace"):
        traces.load(bad, ascend, duration_s=HOUR)


def test_without_failures_every_policy_trains_at_its_failure_free_rate(sim):
    empty = Trace("none", 10 * HOUR, (), "test")
    report = simulate(sim.job, empty, POLICIES, sim=sim)
    for o in report.outcomes:
        expected = 1 / (1 + REDUNDANT_OVERHEAD) if o.policy == "redundant" else 1.0
        assert o.vs_failure_free == pytest.approx(expected)
        assert o.transition_s == o.redo_s == 0
        # Bamboo's overhead is paid all the time: a share of the run lost to slower steps.
        assert o.degraded_s == pytest.approx(10 * HOUR * (1 - expected), abs=1e-6)


def test_a_restart_costs_its_restart_and_the_work_since_the_checkpoint(sim):
    job = sim.job
    interval = job.training.checkpoint_interval_s
    t_fail, duration = 2.5 * interval, 10 * interval  # half an interval since the checkpoint
    tr = one_failure(3, t_fail, duration)
    end = sim.run(tr, "restart")
    state, lost = sim.hit(sim.start("restart"), tr.events[0])
    (choice,) = sim.choices(state, lost, "restart")
    assert choice.candidate.policy is Policy.RESTART
    restart_s, seen_s = job.cluster.restart_s, job.cluster.detection_s
    redo = 0.5 * interval
    assert choice.transition.total_s == pytest.approx(restart_s + redo)
    new_rate = job.training.global_batch_size / choice.step_s
    expected = sim.rate0 * t_fail + new_rate * (duration - t_fail - seen_s - restart_s - redo)
    assert end.totals.samples == pytest.approx(expected)
    assert end.totals.transition_s == pytest.approx(seen_s + restart_s)
    assert end.totals.redo_s == pytest.approx(redo)
    assert end.totals.restarts == 1 and end.totals.in_place == 0


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "oracle"])
def test_every_second_of_a_run_is_accounted_for(sim, policy):
    # Failures closer together than a restart: the second lands mid-transition.
    events = (
        Event(HOUR, "fail", (2,)),
        Event(HOUR + 5, "fail", (7,)),
        Event(3 * HOUR, "fail", tuple(sim.job.workers_on_node(2))),
        Event(5 * HOUR, "repair", (2, 7)),
        Event(6 * HOUR, "fail", (11,)),
    )
    tr = Trace("mixed", 12 * HOUR, events, "test")
    t = sim.run(tr, policy).totals
    assert t.useful_s + t.transition_s + t.redo_s + t.stopped_s == pytest.approx(tr.duration_s)
    assert t.samples <= sim.rate0 * tr.duration_s


@pytest.mark.slow  # every sequence of choices: seconds
@pytest.mark.timeout(60)  # 2 s measured
def test_the_oracle_is_never_below_a_sequence_of_choices_it_could_have_made(sim):
    job = sim.job
    for seed in (1, 2):
        tr = traces.generated(
            job, duration_s=48 * HOUR, seed=seed, mtbf_s=3 * HOUR, repair_s=6 * HOUR
        )
        best = oracle(sim, tr).best.totals.samples
        for policy in ("adaptive", "reroute", "restart"):
            assert best >= sim.run(tr, policy).totals.samples - 1e-6


def test_adaptive_learns_d_from_the_failures_it_sees(sim):
    tr = traces.oobleck(sim.job, 600.0, duration_s=4 * HOUR, seed=0)
    state = sim.start("adaptive")
    prior = sim.mtbf_s(state)
    for event in tr.events[:4]:
        state, lost = sim.hit(state, event)
        state = sim.recover(state, sim.choices(state, lost, "adaptive")[0])
    # Four failures in 40 minutes: far more often than the config's prior says.
    assert sim.mtbf_s(state) < prior / 2


def test_decisions_are_cached_across_policies(ascend):
    sim = Simulator(ascend)
    tr = traces.oobleck(ascend, 1800.0, duration_s=2 * HOUR, seed=0)
    sim.run(tr, "reroute")
    first = sim.decisions
    sim.run(tr, "reroute")
    assert sim.decisions == first  # the same states: nothing planned again


class EverySimulator(Simulator):
    """Adaptive's choices made over every candidate, each planned by the planner itself
    (``reparallelize_options``, ``restart_candidate``, ``reroute_candidate``: what
    ``chameleon run``'s ``decide`` weighs), none of the simulator's cached answers used:
    what the simulator's pruned, cached choice must equal."""

    def _adaptive(self, q, state):
        job, outlook, search = self.job, self.outlook(state), self.search

        def key(c):
            return log_score(job, c, outlook)

        options, fastest, _ = reparallelize_options(
            search, q.plan, q.lost, q.survivors, clock=lambda: 0.0
        )
        repartitions = [c for c in options if c.feasible]
        best_rp = max(repartitions, key=key, default=None)
        restart = restart_candidate(
            search, q.plan, q.lost, q.survivors, best_over_survivors=fastest,
            since_checkpoint_s=0.0, spares=q.pool,
        )  # fmt: skip
        variants = restart_variants(restart, repartitions)
        chosen = self._restart(max(variants, key=key), self.since_checkpoint_s(state), 1.0)
        pool = [reroute_candidate(search, q.plan, q.lost), best_rp, chosen and chosen.candidate]
        return choose(job, [c for c in pool if c is not None], outlook)

    def _growth_options(self, q, outlook, policy):
        if policy != "adaptive":
            return super()._growth_options(q, outlook, policy)
        options = reparallelize_options(
            self.search, q.plan, q.lost, q.survivors, clock=lambda: 0.0
        )[0]
        return [q.answer(c) for c in options if c.feasible]


def test_adaptive_chooses_as_over_every_candidate_planning_only_those_that_could_win(ascend):
    """A re-partition's migration (or a restart's layout) is planned only when its step
    alone could still win (``Simulator._adaptive``): the same choices at every failure and
    repair, and so the same run, as with every candidate planned, where the pruning left
    most candidates out and the choice was often not the fastest layout."""
    tr = traces.generated(ascend, duration_s=120 * HOUR, seed=0, mtbf_s=2 * HOUR, repair_s=2 * HOUR)
    every = EverySimulator(ascend)
    planned, offered, not_fastest = [], [], []

    class Checked(Simulator):
        def _adaptive(self, q, state):
            planned.append(set())
            got = super()._adaptive(q, state)
            assert got == every._adaptive(q, state)
            offered.append(len(self.answers.layouts(q)) if self.answers.movable(q) else 0)
            if got is not None and got.policy is Policy.REPARALLELIZE:
                not_fastest.append(got.plan != self.answers.layouts(q)[0].proposal.plan)
            return got

        def _growth_options(self, q, outlook, policy):
            planned.append(set())
            got = super()._growth_options(q, outlook, policy)
            want = every._growth_options(q, outlook, policy)
            assert got == [max(want, key=lambda c: log_score(ascend, c, outlook))][: len(want)]
            offered.append(len(self.answers.layouts(q)) if self.answers.movable(q) else 0)
            return got

    pruned = Checked(ascend)
    real = pruned.answers.repartition

    def counted(q, i):
        planned[-1].add(i)
        return real(q, i)

    pruned.answers.repartition = counted
    end = pruned.run(tr, "adaptive")
    assert end == every.run(tr, "adaptive")
    assert len(planned) > 100 and end.totals.growths > 0, len(planned)
    # most layouts never planned; some choices not the fastest layout
    assert sum(map(len, planned)) < sum(offered) / 2
    assert sum(not_fastest) >= 10, sum(not_fastest)


def test_an_in_place_recovery_also_pays_detection_and_the_step_it_interrupted(sim):
    job = sim.job
    tr = one_failure(3, HOUR, 2 * HOUR)
    state, lost = sim.hit(sim.start("reroute"), tr.events[0])
    (choice,) = sim.choices(state, lost, "reroute")
    after = sim.recover(state, choice)
    paid = job.cluster.detection_s + sim.step0_s / 2 + choice.transition.total_s
    assert after.resume_s - HOUR == pytest.approx(paid)
    # a second failure before training resumed interrupts no step
    again, lost2 = sim.hit(after, Event(HOUR + paid / 2, "fail", (5,)))
    (second,) = sim.choices(again, lost2, "reroute")
    later = sim.recover(again, second)
    assert later.resume_s - again.t_s == pytest.approx(
        job.cluster.detection_s + second.transition.total_s
    )


@pytest.mark.parametrize("policy", ["adaptive", "reroute", "restart"])
def test_a_stopped_job_restarts_from_its_checkpoint_when_its_workers_are_back(sim, policy):
    job = sim.job
    every = tuple(range(job.num_workers))
    t_stop, t_back = 1.25 * job.training.checkpoint_interval_s, 3 * HOUR
    tr = Trace(
        "all down", 6 * HOUR,
        (Event(t_stop, "fail", every), Event(t_back, "repair", every)), "test",
    )  # fmt: skip
    t = sim.run(tr, policy).totals
    assert t.stopped and t.restarts == 1
    assert t.stopped_s == pytest.approx(t_back - t_stop)
    lost = 0.25 * job.training.checkpoint_interval_s  # since the checkpoint before the stop
    assert t.redo_s == pytest.approx(lost)
    seen = job.cluster.detection_s
    assert t.useful_s == pytest.approx(
        t_stop + (tr.duration_s - t_back - seen - job.cluster.restart_s - lost)
    )
    # back on the launch plan, or on a faster layout the search found: a restart starts
    # every worker again, so it takes the fastest plan over them (policy.restart_candidate)
    assert t.samples >= sim.rate0 * t.useful_s * (1 - 1e-9)


def test_a_restart_takes_the_fastest_plan_over_every_live_worker(ascend):
    """A run shrunk to one pipeline restarts (every replica of a stage lost) with the
    repaired workers idle: it must not restart into the one pipeline again."""
    from planner.choice.policy import restart_candidate
    from planner.search.layouts import Search

    search = Search(ascend).warm_up()
    launch = Simulator(ascend).plan0
    few = list(launch.workers[:7])
    (shrunk, *_) = search.propose(launch, few)
    current = shrunk.plan
    lost = [current.workers[0]]
    idle = [w for w in launch.workers if w not in current.workers]
    survivors = [w for w in current.workers if w not in lost] + idle
    best = min(search.propose(current, survivors), key=lambda p: p.estimate.step_s)
    kept = restart_candidate(
        search, current, lost, survivors, best_over_survivors=None, since_checkpoint_s=0.0,
        spares=idle,
    )  # fmt: skip
    c = restart_candidate(
        search, current, lost, survivors, best_over_survivors=best, since_checkpoint_s=0.0,
        spares=idle,
    )  # fmt: skip
    assert kept.estimate.step_s > 1.5 * best.estimate.step_s  # one pipeline on a spare
    assert c.plan == best.plan and c.estimate.step_s == best.estimate.step_s
    assert "live workers" in c.label


def test_the_growing_policies_take_repaired_workers_back_in_when_it_pays(sim):
    """chameleon run takes rejoined workers in when the grown layout pays before the next
    failure (worth_growing); Oobleck re-instantiates on nodes that return; ReCycle and
    torchrun keep their layout until the next failure."""
    events = (Event(HOUR, "fail", (3,)), Event(3 * HOUR, "repair", (3,)))
    tr = Trace("fail and repair", 12 * HOUR, events, "test")
    for policy in ("adaptive", "reparallelize"):
        end = sim.run(tr, policy)
        assert end.totals.growths == 1, policy
        assert 3 in end.plan.workers and end.step_s == pytest.approx(sim.step0_s, rel=0.02)
        assert end.totals.in_place == 1  # a growth is not a recovery
    for policy in ("reroute", "restart"):
        end = sim.run(tr, policy)
        assert end.totals.growths == 0, policy


def test_progress_follows_every_policy_through_the_trace(ascend, sim):
    # what chameleon simulate's progress bar is fed: each policy's simulated time, never
    # going back, and its failures so far, ending at the trace's length and count
    tr = traces.oobleck(ascend, 3600.0, duration_s=6 * 3600.0)
    seen: dict[str, list[tuple[float, int]]] = {}
    simulate(
        ascend, tr, ["adaptive", "restart", "oracle"], sim=sim,
        progress=lambda p, t, n: seen.setdefault(p, []).append((t, n)),
    )  # fmt: skip
    assert sorted(seen) == ["adaptive", "oracle", "restart"]
    for points in seen.values():
        assert len(points) == len(tr.events) + 1
        assert points == sorted(points)
        assert points[-1] == (tr.duration_s, tr.failures)
        assert [n for _t, n in points[:-1]] == [
            sum(e.kind != "repair" for e in tr.events[: i + 1]) for i in range(len(tr.events))
        ]


def test_a_seed_replays_the_same_run(ascend):
    # Nothing measured on this machine enters a simulated run (a re-partition's search
    # time once did: two runs of one seed differed in the fifth digit).
    tr = traces.generated(ascend, duration_s=48 * HOUR, seed=2, mtbf_s=2 * HOUR, repair_s=HOUR)
    runs = [
        simulate(ascend, tr, ["adaptive", "reparallelize"], sim=Simulator(ascend)) for _ in "ab"
    ]
    for a, b in zip(runs[0].outcomes, runs[1].outcomes):
        assert a == b


@pytest.mark.slow  # two processes, seconds
@pytest.mark.timeout(60)  # 5 s measured
def test_two_processes_give_the_figures_of_one(ascend):
    # chameleon simulate runs adaptive and the oracle in this process and the rest in a
    # forked one: the same figures, in the order asked, and the progress of both.
    tr = traces.generated(ascend, duration_s=48 * HOUR, seed=5, mtbf_s=2 * HOUR, repair_s=HOUR)
    names = ["restart", "adaptive", "reroute", "oracle"]
    one = simulate(ascend, tr, names, sim=Simulator(ascend))
    seen: dict[str, list[tuple[float, int]]] = {}
    two = simulate(
        ascend, tr, names, sim=Simulator(ascend), processes=2,
        progress=lambda p, t, n: seen.setdefault(p, []).append((t, n)),
    )  # fmt: skip
    assert [o.policy for o in two.outcomes] == names
    assert two.outcomes == one.outcomes
    assert sorted(seen) == sorted(names)
    assert all(points[-1] == (tr.duration_s, tr.failures) for points in seen.values())
    assert two.decisions >= one.decisions  # (each process computes its own answers)


def test_a_simulation_process_that_dies_is_said(ascend, monkeypatch):
    import os

    from planner.simulation import simulate as module

    def dies(self, trace, policy, on_event=None):
        if policy == "restart":
            os._exit(9)
        return real(self, trace, policy, on_event)

    real = module.Simulator.run
    monkeypatch.setattr(module.Simulator, "run", dies)
    tr = one_failure(0, HOUR, 2 * HOUR)
    with pytest.raises(RuntimeError, match="restart: exited with code 9"):
        simulate(ascend, tr, ["adaptive", "restart"], sim=Simulator(ascend), processes=2)


def test_a_progress_callback_that_raises_in_the_listener_is_raised_to_the_caller(ascend):
    # the child's progress reaches the callback on a listener thread; its error is the
    # caller's, not a thread's traceback and a missing result
    tr = traces.generated(ascend, duration_s=24 * HOUR, seed=5, mtbf_s=2 * HOUR, repair_s=HOUR)

    def bar(policy, t_s, failures):
        if policy == "restart":
            raise ValueError("the bar is gone")

    with pytest.raises(ValueError, match="the bar is gone"):
        simulate(
            ascend, tr, ["adaptive", "restart"], sim=Simulator(ascend), processes=2, progress=bar
        )
