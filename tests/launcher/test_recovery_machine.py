"""The recovery state machine (launcher/recovery.py), walked through event sequences: a
failure in every phase, two at once, the leader's own workers, a replacement joining
mid-recovery, deadlines, and generations that only move forward."""

from launcher.recovery import (
    Abort,
    Admit,
    AppliedReported,
    Failed,
    Forget,
    Grow,
    Kill,
    Phase,
    Planned,
    Preempt,
    Publish,
    ReadyReported,
    Rebalance,
    Recovered,
    Report,
    Restart,
    StartPlanning,
    State,
    Tick,
    Timeouts,
    decide,
)

# Two pipelines of two stages: workers 0, 1 and 2, 3; layers 0-1 and 2-3.
LAYOUT = {0: (0, 2), 1: (2, 4), 2: (0, 2), 3: (2, 4)}
TIMEOUTS = Timeouts(collect_s=10, plan_s=20, confirm_s=30, max_futile=2)


def start(world=4, layout=LAYOUT):
    return State.initial(
        world=frozenset(range(world)), layout=layout, resume_step=0, timeouts=TIMEOUTS
    )


def ready(
    rank, *, after, applied=0, step=5, held=None, layout=LAYOUT, pending=False, committed=None
):
    if held is None:
        held = tuple(range(*layout[rank])) if rank in layout else ()
    report = Report(after, applied, step, tuple(held), pending=pending, committed=committed)
    return ReadyReported(rank, report)


def run(state, *events, now=0.0):
    """Feed events in order; every action returned."""
    actions = []
    for event in events:
        state, out = decide(state, event, now)
        actions += out
    return state, actions


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def planned(generation, layout, extra_members=()):
    return Planned(generation, layout=layout, members=frozenset(layout) | set(extra_members))


THREE = {0: (0, 2), 1: (2, 4), 2: (0, 4)}  # worker 2 alone holds everything


def test_a_failure_is_aborted_collected_planned_published_and_confirmed():
    s, actions = run(start(), Failed(frozenset({3})))
    (abort,) = of(actions, Abort)
    assert (abort.generation, abort.lost, s.phase) == (0, (3,), Phase.COLLECT)
    s, actions = run(s, ready(0, after=0), ready(1, after=0))
    assert actions == [] and s.phase is Phase.COLLECT  # worker 2 has not answered yet
    s, actions = run(s, ready(2, after=0))
    (plan,) = of(actions, StartPlanning)
    assert (plan.generation, plan.base, plan.failed, plan.idle, plan.resume_step) == (
        1, 0, (3,), (), 5,
    )  # fmt: skip
    s, actions = run(s, planned(1, THREE))
    assert of(actions, Publish) == [Publish(1, after=0)] and s.phase is Phase.CONFIRM
    s, actions = run(s, AppliedReported(0, 1), AppliedReported(1, 1))
    assert not of(actions, Recovered)
    s, actions = run(s, AppliedReported(2, 1))
    (done,) = of(actions, Recovered)
    assert (done.generation, done.resume_step, done.steps_lost) == (1, 5, 0)
    assert of(actions, Forget) == [Forget(below=1)]
    assert (s.phase, s.confirmed, s.live) == (Phase.RUNNING, 1, frozenset({0, 1, 2}))


def test_a_failure_during_collect_is_no_longer_waited_for():
    s, _ = run(start(), Failed(frozenset({3})), ready(0, after=0), ready(1, after=0))
    s, actions = run(s, Failed(frozenset({2})))
    (plan,) = of(actions, StartPlanning)
    assert plan.failed == (2, 3) and s.phase is Phase.PLAN  # pipeline 0 holds every layer


def test_a_failure_while_planning_plans_again_under_a_new_generation():
    s, _ = run(start(), Failed(frozenset({3})), *(ready(r, after=0) for r in (0, 1, 2)))
    assert s.planning == 1
    s, actions = run(s, Failed(frozenset({2})))
    (plan,) = of(actions, StartPlanning)
    assert (plan.generation, plan.failed) == (2, (2, 3))
    s, actions = run(s, planned(1, THREE))  # the answer nobody waits for any more
    assert actions == [] and s.phase is Phase.PLAN
    s, actions = run(s, planned(2, {0: (0, 2), 1: (2, 4)}))
    assert of(actions, Publish) == [Publish(2, after=0)]


def test_a_failure_while_a_plan_is_applied_aborts_it_and_starts_from_what_is_held():
    s, _ = run(start(), Failed(frozenset({3})), *(ready(r, after=0) for r in (0, 1, 2)))
    s, _ = run(s, planned(1, THREE))
    s, actions = run(s, Failed(frozenset({0})))  # groups, migration: all of CONFIRM
    (abort,) = of(actions, Abort)
    assert abort.generation == 1 and s.phase is Phase.COLLECT and s.aborted == 1
    # The migration's agreement did not hold: both still hold generation 0's stages.
    s, actions = run(s, ready(1, after=1), ready(2, after=1))
    (plan,) = of(actions, StartPlanning)
    assert (plan.generation, plan.base, plan.failed) == (2, 0, (0, 3))


def test_after_a_plan_everyone_applied_the_next_plan_starts_from_it():
    s, _ = run(start(), Failed(frozenset({3})), *(ready(r, after=0) for r in (0, 1, 2)))
    s, _ = run(s, planned(1, THREE))
    s, _ = run(s, Failed(frozenset({0})))  # lost after the migration's agreement held
    s, actions = run(
        s, ready(1, after=1, applied=1, layout=THREE), ready(2, after=1, applied=1, layout=THREE)
    )
    (plan,) = of(actions, StartPlanning)
    assert (plan.base, plan.failed) == (1, (0,))


def test_a_member_that_cannot_apply_a_plan_aborts_it():
    s, _ = run(start(), Failed(frozenset({3})), *(ready(r, after=0) for r in (0, 1, 2)))
    s, _ = run(s, planned(1, THREE))
    s, actions = run(s, ready(2, after=1))  # its group could not be built, say
    assert of(actions, Abort)[0].generation == 1 and s.phase is Phase.COLLECT
    s, actions = run(s, ready(0, after=1), ready(1, after=1))
    assert of(actions, StartPlanning)[0].generation == 2


def test_two_failures_at_once():
    s, actions = run(start(), Failed(frozenset({1, 3})))
    assert of(actions, Abort)[0].lost == (1, 3)
    s, actions = run(s, ready(0, after=0), ready(2, after=0))
    assert of(actions, StartPlanning)[0].failed == (1, 3)


def test_the_loss_of_the_leaders_own_workers_is_recovered_like_any_other():
    # Ranks 0 and 1 run under the leader agent; pipeline 1 (ranks 2, 3) holds every layer.
    s, actions = run(start(), Failed(frozenset({0, 1})), ready(2, after=0), ready(3, after=0))
    (plan,) = of(actions, StartPlanning)
    assert plan.failed == (0, 1) and s.phase is Phase.PLAN


def test_a_replacement_joining_mid_recovery_is_admitted_once_it_is_over():
    s, _ = run(start(), Failed(frozenset({3})))
    s, actions = run(s, Admit(frozenset({3})))  # rank 3's replacement is up already
    assert actions == [] and 3 not in s.live
    s, actions = run(s, ready(3, after=0, held=()))  # nobody waits for its answer
    assert actions == [] and 3 not in s.reports
    s, _ = run(s, *(ready(r, after=0) for r in (0, 1, 2)))
    s, _ = run(s, planned(1, THREE), *(AppliedReported(r, 1) for r in (0, 1, 2)))
    s, actions = run(s, Admit(frozenset({3})))
    assert 3 in s.live and actions


def test_a_survivor_that_never_answers_is_killed_at_the_collect_deadline():
    s, _ = run(start(), Failed(frozenset({3})), ready(0, after=0), ready(1, after=0))
    s, actions = run(s, Tick(), now=9.0)
    assert actions == []
    s, actions = run(s, Tick(), now=10.0)
    (kill,) = of(actions, Kill)
    assert kill.ranks == (2,)
    assert of(actions, StartPlanning)[0].failed == (2, 3)


def test_no_plan_within_the_deadline_restarts():
    s, _ = run(start(), Failed(frozenset({3})), *(ready(r, after=0) for r in (0, 1, 2)))
    s, actions = run(s, Tick(), now=20.0)
    assert of(actions, Restart) and s.phase is Phase.ENDED
    assert run(s, Failed(frozenset({0})))[1] == []  # over: the restart path owns the job


def test_a_plan_not_applied_in_time_is_abandoned_for_a_new_one():
    s, _ = run(start(), Failed(frozenset({3})), *(ready(r, after=0) for r in (0, 1, 2)))
    s, _ = run(s, Planned(1, layout=THREE, members=frozenset(THREE), transition_s=1.0))
    s, actions = run(s, Tick(), now=32.9)
    assert actions == []
    s, actions = run(s, Tick(), now=33.0)  # 30 s + 3x the estimated transition
    assert of(actions, Abort)[0].generation == 1 and s.phase is Phase.COLLECT


def test_generation_numbers_only_move_forward():
    s = start(world=6, layout={r: (0, 4) for r in range(6)})  # six replicas
    layout = dict(s.layouts[0])
    numbers = []
    events = [Failed(frozenset({5}))]
    for gen, lost in ((1, 4), (2, 3), (3, 2)):
        alive = [r for r in range(6) if r < lost + 1]
        events += [ready(r, after=gen - 1, applied=gen - 1, layout=layout) for r in alive]
        layout = {r: (0, 4) for r in alive}
        events += [Failed(frozenset({lost}))]
    for event in events:
        s, actions = decide(s, event, 0.0)
        numbers += [a.generation for a in actions if isinstance(a, StartPlanning | Publish)]
    assert numbers == sorted(set(numbers))


def test_survivors_that_disagree_on_the_step_restart():
    s, actions = run(
        start(), Failed(frozenset({3})), ready(0, after=0, step=3), ready(1, after=0, step=4),
        ready(2, after=0, step=3),
    )  # fmt: skip
    (restart,) = of(actions, Restart)
    assert "disagree" in restart.reason and restart.reached == 4


def test_survivors_a_step_apart_over_a_ring_commit_roll_the_step_forward():
    # A ring's commit reached 1 and not 0 and 2, which voted for step 3 (pending) and
    # hold its gradients: step 3 was committed, and they apply it with 1's sums.
    sums = (2.5, 0.25, 4.0)
    s, actions = run(
        start(), Failed(frozenset({3})), ready(0, after=0, step=3, pending=True),
        ready(1, after=0, step=4, committed=sums), ready(2, after=0, step=3, pending=True),
    )  # fmt: skip
    assert not of(actions, Restart)
    (planning,) = of(actions, StartPlanning)
    assert planning.resume_step == 4 and planning.roll_forward == (3, sums)
    # Without a vote behind (not pending), the step cannot be applied there: a restart.
    _, actions = run(
        start(), Failed(frozenset({3})), ready(0, after=0, step=3, pending=True),
        ready(1, after=0, step=4, committed=sums), ready(2, after=0, step=3),
    )  # fmt: skip
    assert "disagree" in of(actions, Restart)[0].reason
    # Everyone pending, nobody ahead: not committed; the plan resumes at the step.
    _, actions = run(
        start(), Failed(frozenset({3})),
        *(ready(r, after=0, step=3, pending=True) for r in (0, 1, 2)),
    )  # fmt: skip
    (planning,) = of(actions, StartPlanning)
    assert planning.resume_step == 3 and planning.roll_forward is None


def test_a_spare_reports_no_step_and_its_death_aborts_nothing():
    s = start(world=5)  # rank 4 is a spare
    s, actions = run(s, Failed(frozenset({4})))
    assert not of(actions, Abort) and s.phase is Phase.RUNNING and 4 not in s.live
    s, actions = run(s, Failed(frozenset({3})), *(ready(r, after=0) for r in (0, 1, 2)))
    assert of(actions, StartPlanning)[0].idle == ()


def test_a_worker_that_no_longer_holds_its_stage_is_planned_as_lost_and_idle():
    s, _ = run(start(), Failed(frozenset({3})))
    s, actions = run(s, ready(0, after=0), ready(1, after=0, held=()), ready(2, after=0))
    (plan,) = of(actions, StartPlanning)
    assert plan.failed == (1, 3) and plan.idle == (1,)


def test_the_steps_lost_are_measured_from_the_reports():
    # Worker 1 is not a holder any more but says it applied step 7: whatever the layout,
    # the recovery resumes at the holders' 6 and reports one step lost.
    s, actions = run(
        start(), Failed(frozenset({3})), ready(0, after=0, step=6),
        ready(1, after=0, step=7, held=()), ready(2, after=0, step=6),
        planned(1, {0: (0, 2), 2: (2, 4)}), AppliedReported(0, 1), AppliedReported(2, 1),
    )  # fmt: skip
    (done,) = of(actions, Recovered)
    assert (done.resume_step, done.steps_lost) == (6, 1)


def test_stale_answers_are_ignored():
    s, _ = run(start(), Failed(frozenset({3})), *(ready(r, after=0) for r in (0, 1, 2)))
    s, _ = run(s, planned(1, THREE), Failed(frozenset({2})))
    s, actions = run(s, ready(0, after=0))  # its answer to the first abort, late
    assert actions == [] and 0 not in s.reports


def test_recoveries_that_get_nowhere_end_in_a_restart():
    s, _ = run(start(), Failed(frozenset({3})), *(ready(r, after=0) for r in (0, 1, 2)))
    gen = 1
    for _ in range(TIMEOUTS.max_futile + 1):
        s, _ = run(s, planned(gen, THREE))
        s, actions = run(s, ready(2, after=gen), ready(0, after=gen), ready(1, after=gen))
        gen += 1
        if of(actions, Restart):
            break
    assert "made no progress" in of(actions, Restart)[0].reason


def test_a_growth_takes_replacements_in_and_a_failure_cancels_it():
    s, _ = run(start(world=5), Admit(frozenset({4})))
    s, actions = run(s, Grow(frozenset({4})))
    assert "rejoin" in of(actions, Abort)[0].reason
    s, actions = run(s, *(ready(r, after=0) for r in (0, 1, 2, 3)), ready(4, after=0))
    assert of(actions, StartPlanning)[0].joining == (4,)
    grown = {0: (0, 2), 1: (2, 4), 2: (0, 2), 3: (2, 3), 4: (3, 4)}
    s, actions = run(s, planned(1, grown), *(AppliedReported(r, 1) for r in range(5)))
    assert of(actions, Recovered)[0].joined == (4,)
    # A failure during the next growth makes it a recovery again: nobody joins.
    s, _ = run(s, Admit(frozenset({4})), Grow(frozenset({4})), Failed(frozenset({3})))
    assert s.joining == frozenset()


def test_a_growth_whose_abort_splits_a_commit_rolls_forward_first_and_grows_after():
    # The rejoin's abort came as step 5's commit ended on 1 and not on 0, 2 and 3 (step 5
    # pending there). Workers behind apply step 5 inside the script's optimizer.step(),
    # before the script's own code after it (a schedule's step): what they would send the
    # replacement is a step behind there. So the step rolls forward without it (nothing
    # healed whole), and a recovery of its own takes it in once all are back in the loop.
    sums = (1.0, 0.5, 2.0)
    s, _ = run(start(world=5), Admit(frozenset({4})), Grow(frozenset({4})))
    s, actions = run(
        s, *(ready(r, after=0, step=5, pending=True) for r in (0, 2, 3)),
        ready(1, after=0, step=6, committed=sums), ready(4, after=0, step=None, held=()),
    )  # fmt: skip
    (plan,) = of(actions, StartPlanning)
    assert (plan.roll_forward, plan.joining, plan.idle, plan.resume_step) == ((5, sums), (), (), 6)
    assert plan.deferred  # (the planner keeps the layout: nothing lost, nobody taken in)
    s, actions = run(s, planned(1, LAYOUT), *(AppliedReported(r, 1) for r in range(4)))
    assert of(actions, Recovered)[0].joined == ()
    (abort,) = of(actions, Abort)
    assert abort.generation == 1 and "rejoin" in abort.reason and s.joining == {4}
    s, actions = run(
        s, *(ready(r, after=1, applied=1, step=7) for r in range(4)), ready(4, after=1, held=())
    )
    (plan,) = of(actions, StartPlanning)
    assert (plan.roll_forward, plan.joining, plan.idle, plan.resume_step) == (None, (4,), (4,), 7)
    grown = {0: (0, 2), 1: (2, 4), 2: (0, 2), 3: (2, 3), 4: (3, 4)}
    s, actions = run(s, planned(2, grown), *(AppliedReported(r, 2) for r in range(5)))
    assert of(actions, Recovered)[0].joined == (4,) and not of(actions, Abort)


def test_a_deferred_joiner_survives_a_failure_meanwhile_and_a_stop_skips_it():
    sums = (1.0, 0.5, 2.0)
    split = (
        *(ready(r, after=0, step=5, pending=True) for r in (0, 2, 3)),
        ready(1, after=0, step=6, committed=sums),
    )
    s, _ = run(start(world=6), Admit(frozenset({4, 5})), Grow(frozenset({4, 5})))
    s, _ = run(s, *split, ready(4, after=0, step=None, held=()), ready(5, after=0, held=()))
    assert s.deferred == {4, 5}
    # Joiner 5 dies while the plan is confirmed: 4 still comes in after.
    s, actions = run(s, planned(1, LAYOUT), Failed(frozenset({5})))
    s, actions = run(s, *(AppliedReported(r, 1) for r in range(4)))
    assert "rejoin" in of(actions, Abort)[0].reason and s.joining == {4}
    # A preemption notice before the plan: the stop plan is not followed by a growth.
    s, _ = run(start(world=5), Admit(frozenset({4})), Grow(frozenset({4})), Preempt())
    s, actions = run(s, *split, ready(4, after=0, step=None, held=()))
    assert of(actions, StartPlanning)[0].stop
    s, actions = run(s, planned(1, LAYOUT), *(AppliedReported(r, 1) for r in range(4)))
    assert of(actions, Recovered) and not of(actions, Abort)


def test_a_failure_whose_abort_splits_a_commit_leaves_an_idle_worker_out_of_the_plan():
    # Worker 4 is idle (it holds nothing); 3 fails as step 5's commit ends on 1 alone.
    sums = (1.0, 0.5, 2.0)
    s, actions = run(
        start(world=5), Failed(frozenset({3})),
        *(ready(r, after=0, step=5, pending=True) for r in (0, 2)),
        ready(1, after=0, step=6, committed=sums), ready(4, after=0, step=None, held=()),
    )  # fmt: skip
    (plan,) = of(actions, StartPlanning)
    assert (plan.roll_forward, plan.failed, plan.idle) == ((5, sums), (3,), ())
    s, actions = run(s, planned(1, THREE), *(AppliedReported(r, 1) for r in range(3)))
    assert of(actions, Recovered) and not of(actions, Abort) and 4 in s.live


def test_a_rebalance_re_partitions_a_healthy_job_and_a_failure_makes_it_a_recovery():
    """pipeline_stages="auto": the launch layout, judged again once calibrated."""
    s, actions = run(start(world=5), Rebalance())
    assert "calibrated" in of(actions, Abort)[0].reason
    s, actions = run(s, *(ready(r, after=0) for r in (0, 1, 2, 3)), ready(4, after=0))
    (plan,) = of(actions, StartPlanning)
    assert plan.rebalance and plan.failed == () and plan.joining == ()
    s, actions = run(s, planned(1, LAYOUT), *(AppliedReported(r, 1) for r in range(4)))
    assert of(actions, Recovered) and not s.rebalancing
    # Mid-recovery it is ignored (the recovery re-plans anyway); a failure during one
    # makes it an ordinary recovery.
    s, _ = run(s, Failed(frozenset({3})))
    assert s.phase is Phase.COLLECT and run(s, Rebalance())[1] == []
    s, _ = run(start(), Rebalance(), Failed(frozenset({3})))
    assert not s.rebalancing
    s, actions = run(s, *(ready(r, after=0) for r in (0, 1, 2)))
    assert not of(actions, StartPlanning)[0].rebalance


def test_a_preemption_notice_stops_at_a_step_a_recovery_brings_everyone_to():
    s, actions = run(start(), Preempt())
    assert of(actions, Abort)[0].reason == "a preemption notice" and s.stopping
    s, actions = run(s, *(ready(r, after=0) for r in range(4)))
    (plan,) = of(actions, StartPlanning)
    assert plan.stop and plan.failed == ()
    s, actions = run(s, planned(1, LAYOUT), *(AppliedReported(r, 1) for r in range(4)))
    assert of(actions, Recovered) and s.phase is Phase.RUNNING
    assert run(s, Preempt())[1] == []  # once


def test_a_notice_during_a_recovery_stops_its_plan_or_the_next_one():
    # In COLLECT: the plan to come stops.
    s, _ = run(start(), Failed(frozenset({3})), Preempt())
    s, actions = run(s, *(ready(r, after=0) for r in (0, 1, 2)))
    assert of(actions, StartPlanning)[0].stop
    # In PLAN: the plan in flight was made without it; once it is applied, a recovery
    # whose plan stops follows at once.
    s, actions = run(start(), Failed(frozenset({3})), *(ready(r, after=0) for r in (0, 1, 2)))
    assert not of(actions, StartPlanning)[0].stop
    s, _ = run(s, Preempt())
    layout = {0: (0, 2), 1: (2, 4), 2: (0, 2)}
    s, actions = run(s, planned(1, layout), *(AppliedReported(r, 1) for r in (0, 1, 2)))
    assert of(actions, Recovered) and of(actions, Abort)[-1].reason == "a preemption notice"
    s, actions = run(s, *(ready(r, after=1, applied=1, layout=layout) for r in (0, 1, 2)))
    assert of(actions, StartPlanning)[0].stop


def test_a_recovery_says_where_its_time_went_and_who_answered_last():
    s, _ = decide(start(), Failed(frozenset({3})), 1.0)
    for rank, t in ((0, 1.1), (2, 1.2), (1, 4.0)):  # worker 1 answers late
        s, _ = decide(s, ready(rank, after=0), t)
    s, _ = decide(s, planned(1, THREE), 4.5)
    for rank in (0, 1, 2):
        s, actions = decide(s, AppliedReported(rank, 1), 5.0)
    (done,) = of(actions, Recovered)
    assert done.duration_s == 4.0 and done.last_answer == 1
    assert dict(done.phases_s) == {"collect": 3.0, "plan": 0.5, "confirm": 0.5}


def test_a_source_that_gave_its_layers_away_is_a_spare_once_the_plan_is_confirmed():
    """Worker 3 sent its layers and holds none in generation 1: it confirms with the
    others, then losing it aborts nothing (the demo's rebalance, then its kill)."""
    s, _ = run(start(), Failed(frozenset({1})))
    s, _ = run(s, *(ready(r, after=0) for r in (0, 2, 3)))
    moved = {0: (0, 2), 2: (2, 4)}  # worker 3 hands layers 2-4 to worker 2
    s, actions = run(s, planned(1, moved, extra_members={3}))
    s, actions = run(s, *(AppliedReported(r, 1) for r in (0, 2)))
    assert not of(actions, Recovered)  # the source has not confirmed yet
    s, actions = run(s, AppliedReported(3, 1))
    assert of(actions, Recovered) and s.members == frozenset({0, 2})
    s, actions = run(s, Failed(frozenset({3})))
    assert s.phase is Phase.RUNNING and not of(actions, Abort)
