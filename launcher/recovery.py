"""In-place recovery as a state machine: ``decide(state, event, now) -> (state, actions)``.

Pure: no store, no clock, no planner. The coordinator (launcher/coordinator.py) feeds it
events (failures, workers' reports, the planner's answers, the passing of time) and carries
out the actions it returns. Tests walk it through event sequences.

A recovery goes through three phases, each with a deadline, and any of them survives a
new failure:

- COLLECT: the running generation is aborted; every live worker answers with ``Ready``:
  the step it is at, the last generation it applied and the layers it holds. A worker
  lost meanwhile is dropped from the wait. At the deadline, workers that did not answer
  are killed as hung and the others go on without them.
- PLAN: the planner works (off the coordinator's thread) from what the survivors really
  hold: the layout of the newest generation any of them applied (an agreement is
  all-or-none, so all of that generation's members applied it), less every worker that
  is gone or no longer holds its stage there. A failure meanwhile starts planning again.
- CONFIRM: the plan is published as a new generation; it is recovered once every member
  has applied it. A member lost (or failing to apply it) meanwhile: that generation is
  aborted in turn, and COLLECT starts again from what the survivors hold.

Generation numbers only move forward: every plan computed gets a fresh one, published
or not, so no key of an abandoned generation is ever read as a later one's. Recoveries
that end without a new failure and without a step applied (a deadline, a plan a worker
could not apply) are counted; past ``max_futile`` in a row the job restarts instead of
looping.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from launcher.recovery_events import (
    Abort,
    Action,
    Admit,
    AppliedReported,
    Event,
    Failed,
    Forget,
    Grow,
    Kill,
    Layout,
    Note,
    Phase,
    PhaseChanged,
    Planned,
    Preempt,
    Publish,
    ReadyReported,
    Rebalance,
    Recovered,
    Replan,
    Report,
    Restart,
    StartPlanning,
    Tick,
    Timeouts,
)

__all__ = [  # the machine with its vocabulary: ``from launcher import recovery as rc``
    "Abort", "Action", "Admit", "AppliedReported", "Event", "Failed", "Forget", "Grow",
    "Kill", "Layout", "Note", "Phase", "PhaseChanged", "Planned", "Preempt", "Publish",
    "ReadyReported", "Rebalance", "Replan",
    "Recovered", "Report", "Restart", "StartPlanning", "State", "Tick", "Timeouts", "decide",
]  # fmt: skip


def _frozen(d: Mapping) -> Mapping:
    return MappingProxyType(dict(d))


def _enter(state: State, phase: Phase, now: float, **changes: object) -> State:
    """``state`` moved to ``phase`` at ``now``, the time spent in the phase it leaves
    added to that phase's total."""
    spent = dict(state.phases_s)
    if state.recovering:
        spent[state.phase.value] = spent.get(state.phase.value, 0.0) + now - state.entered_at
    else:
        spent = {}
    return replace(state, phase=phase, entered_at=now, phases_s=_frozen(spent), **changes)


@dataclass(frozen=True)
class State:
    phase: Phase
    generation: int  # the newest published generation
    confirmed: int  # the newest generation every member applied
    members: frozenset[int]  # members of ``generation``: its workers and transfer sources
    live: frozenset[int]  # ranks that answer: members and spares
    layouts: Mapping[int, Layout]  # of ``confirmed`` and newer published generations
    next_id: int  # the next generation number to hand out
    timeouts: Timeouts = field(default_factory=Timeouts)
    aborted: int = -1  # the generation being left (COLLECT, PLAN)
    reports: Mapping[int, Report] = field(default_factory=lambda: _frozen({}))
    confirmations: frozenset[int] = frozenset()
    resumed_at: float = 0.0  # when the last confirmation so far went back to training
    planning: int | None = None  # the generation number of the plan being computed
    deadline: float | None = None
    recovery: int = 0  # recoveries started in this attempt
    joining: frozenset[int] = frozenset()  # replacements being taken in (a growth)
    rebalancing: bool = False  # a calibrated re-partition of a healthy job (Rebalance)
    replanning: Replan | None = None  # a healthy job's move around slow workers (Replan)
    stopping: bool = False  # a preemption notice came: every plan from now on stops (Preempt)
    stop_plans: frozenset[int] = frozenset()  # generations planned with stop, this recovery
    resume_step: int = 0  # where the current (or last) recovery resumes
    reached: int = 0  # the most steps any report showed applied, this recovery
    futile: int = 0  # plans in a row with no step applied and no worker lost before them
    failures: int = 0  # failure events handled so far
    failures_planned: int = 0  # ``failures`` when the last plan was started
    started_at: float = 0.0  # when the current recovery began
    entered_at: float = 0.0  # when the current phase began
    phases_s: Mapping[str, float] = field(default_factory=lambda: _frozen({}))
    last_answer: int | None = None
    # Joiners left out of a plan that rolls a step forward, taken in by a recovery of
    # their own once it is applied (``_plan``); a failure meanwhile drops only the lost.
    deferred: frozenset[int] = frozenset()

    @classmethod
    def initial(
        cls,
        *,
        world: frozenset[int],
        layout: Layout,
        resume_step: int,
        timeouts: Timeouts,
        generation: int = 0,  # a successor leader starts from the last settled one
    ) -> State:
        return cls(
            phase=Phase.RUNNING,
            generation=generation,
            confirmed=generation,
            members=frozenset(layout),
            live=world,
            layouts=_frozen({generation: _frozen(layout)}),
            next_id=generation + 1,
            timeouts=timeouts,
            resume_step=resume_step,
        )

    @property
    def recovering(self) -> bool:
        return self.phase in (Phase.COLLECT, Phase.PLAN, Phase.CONFIRM)


# -- the function ----------------------------------------------------------------------------


Result = tuple["State", list[Action]]


def decide(state: State, event: Event, now: float) -> Result:
    if state.phase is Phase.ENDED:
        return state, []
    if isinstance(event, Failed):
        return _failed(state, event, now)
    if isinstance(event, ReadyReported):
        return _ready(state, event, now)
    if isinstance(event, AppliedReported):
        return _applied(state, event, now)
    if isinstance(event, Planned):
        return _planned(state, event, now)
    if isinstance(event, Grow):
        return _grow(state, event, now)
    if isinstance(event, Rebalance):
        if state.phase is not Phase.RUNNING:
            return state, []  # a recovery re-plans anyway
        state = replace(state, rebalancing=True)
        return _begin(state, now, reason="a faster layout, calibrated", lost=frozenset())
    if isinstance(event, Replan):
        if state.phase is not Phase.RUNNING or state.stopping:
            return state, []  # a recovery re-plans anyway; a stopping job stops
        state = replace(state, replanning=event)
        why = "slow workers planned around" if event.slow else "slow workers back to speed"
        return _begin(state, now, reason=why, lost=frozenset())
    if isinstance(event, Preempt):
        if state.stopping:
            return state, []
        state = replace(state, stopping=True)
        if state.phase is not Phase.RUNNING:
            return state, []  # the recovery's plan, still to come, stops
        return _begin(state, now, reason="a preemption notice", lost=frozenset())
    if isinstance(event, Admit):
        if state.phase is not Phase.RUNNING:
            return state, []  # offered again once the recovery is over
        new = event.ranks - state.live
        return replace(state, live=state.live | new), [Note("admitted", {"ranks": sorted(new)})]
    return _tick(state, now)


def _begin(state: State, now: float, *, reason: str, lost: frozenset[int]) -> Result:
    """Abort the newest generation and collect the survivors' reports."""
    recovery = state.recovery + (0 if state.recovering else 1)
    state = _enter(
        state,
        Phase.COLLECT,
        now,
        aborted=state.generation,
        reports=_frozen({}),
        confirmations=frozenset(),
        resumed_at=0.0,
        planning=None,
        deadline=now + state.timeouts.collect_s,
        recovery=recovery,
        started_at=state.started_at if state.recovering else now,
    )
    actions: list[Action] = [
        Abort(state.generation, reason, recovery, tuple(sorted(lost))),
        PhaseChanged(Phase.COLLECT, recovery, state.generation),
    ]
    return _collected(state, now, actions)


def _failed(state: State, event: Failed, now: float) -> Result:
    lost = event.ranks & state.live
    if not lost:
        return state, []  # not ours: already handled, or a replacement not yet admitted
    state = replace(
        state,
        live=state.live - lost,
        joining=frozenset(),
        deferred=state.deferred - lost,
        rebalancing=False,
        replanning=None,  # the failure's plan first; the coordinator may replan again
        failures=state.failures + 1,
    )
    reports = {r: v for r, v in state.reports.items() if r not in lost}
    reason = event.reason or f"ranks {sorted(lost)} failed"
    if state.phase is Phase.RUNNING:
        if not lost & state.members:  # spares run no step: nothing to abort
            return state, [Note("spare_lost", {"ranks": sorted(lost)})]
        return _begin(state, now, reason=reason, lost=lost)
    if state.phase is Phase.CONFIRM:
        if not lost & state.members:
            return state, [Note("spare_lost", {"ranks": sorted(lost)})]
        return _begin(state, now, reason=reason, lost=lost)
    state = replace(state, reports=_frozen(reports), planning=None)
    if state.phase is Phase.PLAN:  # the plan in flight counted on them: plan again
        return _plan(_enter(state, Phase.COLLECT, now), now, [])
    return _collected(state, now, [])


def _ready(state: State, event: ReadyReported, now: float) -> Result:
    rank, report = event.rank, event.report
    if rank not in state.live:
        return state, []
    if state.phase in (Phase.RUNNING, Phase.CONFIRM):
        if report.after >= state.generation and rank in state.members:
            # A member left the generation by itself: a broken transfer, or a plan it
            # could not apply. Abort it for everyone and start from the reports.
            begun, actions = _begin(
                state, now, reason=report.reason or f"rank {rank} left", lost=frozenset()
            )
            return _collected(_with_report(begun, rank, report), now, actions)
        return state, []
    if state.phase is Phase.COLLECT and report.after >= state.aborted:
        return _collected(_with_report(state, rank, report), now, [])
    return state, []  # stale: an answer to an earlier abort


def _with_report(state: State, rank: int, report: Report) -> State:
    return replace(state, reports=_frozen({**state.reports, rank: report}), last_answer=rank)


def _collected(state: State, now: float, actions: list[Action]) -> Result:
    """Plan once every live worker has answered."""
    if state.phase is Phase.COLLECT and state.live <= set(state.reports):
        return _plan(state, now, actions)
    return state, actions


def _plan(state: State, now: float, actions: list[Action]) -> Result:
    reports = state.reports
    base = max((r.applied for r in reports.values()), default=state.confirmed)
    layout = state.layouts.get(base)
    if layout is None or not reports:
        return _restart(state, "no worker that held state survived", actions)
    holders = {
        w
        for w, (first, end) in layout.items()
        if w in reports and reports[w].held == tuple(range(first, end))
    }
    reached = max((r.step for r in reports.values() if r.step is not None), default=0)
    reached = max(reached, state.reached if state.recovering else 0)
    if not holders:
        return _restart(
            replace(state, reached=reached), "no worker that held state survived", actions
        )
    roll_forward = _roll_forward({w: reports[w] for w in holders})
    steps = {reports[w].step for w in holders}
    if roll_forward is not None:
        steps = {roll_forward[0] + 1}
    if len(steps) != 1:
        return _restart(
            replace(state, reached=reached),
            f"survivors disagree on the step to resume ({sorted(s for s in steps if s is not None)})",
            actions,
        )
    resume = steps.pop()
    assert resume is not None
    # Futile: nothing applied since the last plan, and no worker lost to explain it.
    futile = 0 if resume > state.resume_step else state.futile
    if resume <= state.resume_step and state.failures == state.failures_planned:
        futile += 1
    if futile > state.timeouts.max_futile:
        return _restart(
            replace(state, reached=reached),
            f"{futile} recoveries in a row made no progress ({_why(reports)})",
            actions,
        )
    # A worker behind rolls the step forward inside the script's optimizer.step(), before
    # the script's own code after it (a schedule's step, a scaler's update) has run: what
    # it would send a worker that holds nothing (a replacement, a worker taken back) is a
    # step behind there, and the receiver trains on with it. So nothing is healed whole
    # in such a plan: the survivors roll forward alone, and a recovery of its own takes
    # the rest in once every one of them is back in the loop.
    idle = tuple(sorted(r for r in reports if r not in holders))
    defer = roll_forward is not None and bool(state.joining or idle)
    # (not deferred: the joiners held back before are among the idle this plan is offered)
    deferred = (state.joining | state.deferred) & state.live if defer else frozenset()
    generation = state.next_id
    state = _enter(
        state,
        Phase.PLAN,
        now,
        stop_plans=state.stop_plans | ({generation} if state.stopping else set()),
        planning=generation,
        next_id=generation + 1,
        deadline=now + state.timeouts.plan_s,
        resume_step=resume,
        reached=reached,
        futile=futile,
        failures_planned=state.failures,
        deferred=deferred,
    )
    start = StartPlanning(
        generation=generation,
        base=base,
        failed=tuple(sorted(w for w in layout if w not in holders)),
        idle=() if defer else idle,
        resume_step=resume,
        reached=reached,
        joining=() if defer else tuple(sorted(state.joining)),
        rebalance=state.rebalancing,
        replan=state.replanning,
        roll_forward=roll_forward,
        stop=state.stopping,
        deferred=defer,
    )
    return state, [*actions, PhaseChanged(Phase.PLAN, state.recovery, generation), start]


def _roll_forward(holders: Mapping[int, Report]) -> tuple[int, tuple[float, ...]] | None:
    """A ring's commit is a collective (chameleon_runtime.step): a failure during it can
    leave holders one step apart, those behind having posted the commit that those ahead
    saw end. Then the step was committed, everyone behind holds its final gradients, and
    they apply it with the sums a holder ahead reports: (that step, its sums). None when
    the holders agree, or differ in any other way (the caller restarts)."""
    steps = {r.step for r in holders.values()}
    if len(steps) != 2 or None in steps:
        return None
    low, high = sorted(steps)  # type: ignore[type-var]
    if high != low + 1:
        return None
    behind = [r for r in holders.values() if r.step == low]
    ahead = [r.committed for r in holders.values() if r.step == high and r.committed]
    if not ahead or not all(r.pending for r in behind):
        return None
    return low, ahead[0]


def _planned(state: State, event: Planned, now: float) -> Result:
    if state.phase is not Phase.PLAN or event.generation != state.planning:
        return state, []  # an answer nobody waits for any more
    if event.restart or event.layout is None:
        return _restart(state, event.reason or "the planner chose restart")
    keep = {g: v for g, v in state.layouts.items() if g >= state.confirmed}
    state = _enter(
        state,
        Phase.CONFIRM,
        now,
        generation=event.generation,
        members=event.members,
        layouts=_frozen({**keep, event.generation: _frozen(event.layout)}),
        planning=None,
        confirmations=frozenset(),
        resumed_at=0.0,
        deadline=now + state.timeouts.confirm_s + 3 * event.transition_s,
    )
    return state, [
        Publish(event.generation, after=state.aborted),
        PhaseChanged(Phase.CONFIRM, state.recovery, event.generation),
    ]


def _applied(state: State, event: AppliedReported, now: float) -> Result:
    if state.phase is not Phase.CONFIRM or event.generation != state.generation:
        return state, []
    # When this member went back to training, never before the phase began nor after
    # the leader read it (event.lag_s is on the member's clock).
    resumed = min(now, max(state.entered_at, now - event.lag_s))
    state = replace(
        state,
        confirmations=state.confirmations | {event.rank},
        resumed_at=max(state.resumed_at, resumed),
    )
    if not state.members <= state.confirmations:
        return state, []
    end = max(state.entered_at, min(now, state.resumed_at))  # the job trains again
    spent = _enter(state, Phase.RUNNING, end).phases_s
    recovered = Recovered(
        generation=state.generation,
        resume_step=state.resume_step,
        steps_lost=state.reached - state.resume_step,
        joined=() if state.deferred else tuple(sorted(state.joining)),
        duration_s=end - state.started_at,
        phases_s=spent,
        last_answer=state.last_answer,
    )
    # A plan made before the notice came (it was in flight) did not say stop: another
    # recovery does, at once.
    stop_missed = state.stopping and state.generation not in state.stop_plans
    # (none while stopping: the members are saving for the preemption)
    layout = state.layouts[state.generation]
    deferred = frozenset() if state.stopping else state.deferred & (state.live - set(layout))
    state = _enter(
        state,
        Phase.RUNNING,
        now,
        stop_plans=frozenset(),
        confirmed=state.generation,
        layouts=_frozen({state.generation: state.layouts[state.generation]}),
        # Sources that gave their layers away and hold none in the plan idle as spares
        # from now on: losing one interrupts no step (it used to abort the generation
        # for a recovery with nothing to recover: "peers take over", no change).
        members=frozenset(state.layouts[state.generation]),
        reports=_frozen({}),
        joining=frozenset(),
        rebalancing=False,
        replanning=None,
        deadline=None,
        deferred=frozenset(),
    )
    actions: list[Action] = [
        recovered,
        Forget(below=state.generation),
        PhaseChanged(Phase.RUNNING, state.recovery, state.generation),
    ]
    if stop_missed:
        begun, more = _begin(state, now, reason="a preemption notice", lost=frozenset())
        return begun, [*actions, *more]
    if deferred:  # (the idle left out wait as spares for the next plan)
        state = replace(state, joining=deferred)
        begun, more = _begin(
            state,
            now,
            reason=f"ranks {sorted(state.joining)} rejoin after the step rolled forward",
            lost=frozenset(),
        )
        return begun, [*actions, *more]
    return state, actions


def _grow(state: State, event: Grow, now: float) -> Result:
    ranks = event.ranks & state.live
    if state.phase is not Phase.RUNNING or not ranks:
        return state, []
    state = replace(state, joining=frozenset(ranks))
    return _begin(state, now, reason=f"ranks {sorted(ranks)} rejoin", lost=frozenset())


def _tick(state: State, now: float) -> Result:
    if state.deadline is None or now < state.deadline:
        return state, []
    waited = state.timeouts
    if state.phase is Phase.COLLECT:
        missing = state.live - set(state.reports)
        state = replace(state, live=state.live - missing)
        kill = Kill(
            tuple(sorted(missing)),
            f"did not answer the abort of generation {state.aborted} within {waited.collect_s:g} s",
        )
        return _collected(state, now, [kill])
    if state.phase is Phase.PLAN:
        return _restart(state, f"no plan within {waited.plan_s:g} s")
    # CONFIRM: a member is still building, moving or waiting: start over from what is held
    return _begin(
        state,
        now,
        reason=f"generation {state.generation} was not applied in time",
        lost=frozenset(),
    )


def _why(reports: Mapping[int, Report]) -> str:
    reasons = sorted({r.reason for r in reports.values() if r.reason})
    return "; ".join(reasons)[:300] or "no reason given"


def _restart(state: State, reason: str, actions: list[Action] | None = None) -> Result:
    state = replace(state, phase=Phase.ENDED, deadline=None, planning=None)
    return state, [*(actions or []), Restart(reason, state.reached)]
