"""Whole runs under a failure trace, policy by policy, on the planner's own costs.

A run is a sequence of states, one per event of the trace (planner.simulation.trace). Between events
a state trains at B / t_step samples per second, once its transition is over; at a failure
that hits a worker of its plan, its policy picks one of the planner's candidates for that
loss (the same reroute, re-partitions and restart that ``chameleon run`` weighs: the
parts of ``planner.choice.selection.gather``, asked one by one as the policy needs them), and
the state moves to that candidate's plan, training again after its transition. Nothing
is measured here: step times are ``planner.estimator.estimate``'s and transitions
``planner.choice.policy``'s, so a simulated run is as good as the cost model (the short real run
in tests/runtime/test_simulate_real.py keeps it honest).

Policies (``POLICIES``), each the real thing modelled with those costs:

- ``adaptive``: ``planner.choice.selection.choose`` at every failure, with the D that ``chameleon
  run`` would have: the config's prior updated by the failures the run has seen so far
  (planner.job.failures);
- ``reroute`` (ReCycle): always reroute, a restart when a stage has no replica left;
- ``reparallelize`` (Oobleck): always the fastest re-partition, its layers copied from
  the first surviving holder one transfer at a time (``Migration.naive``); a restart
  when none fits;
- ``restart`` (torchrun): relaunch from the last checkpoint (``restart_s``), redoing the
  work since it; on spares or repaired workers at the old size when there are enough;
- ``redundant`` (Bamboo): every step costs ``REDUNDANT_OVERHEAD`` more, failures or not;
  a failed worker's neighbour already holds its layers, so a takeover costs the
  recovery protocol's messages only and trains like a reroute (plus the overhead);
- ``oracle``: the best sequence of choices in hindsight (planner.simulation.oracle).

Every failure also costs the cluster's ``detection_s`` (until it is seen), and an in-place
recovery the half step it interrupted, on average. Checkpoints are written every
``checkpoint_interval_s`` of wall time from the last (re)start; a restart redoes the time since the last one. A failure during a transition
abandons it: the new decision starts from the plan being moved to. Repaired workers
return idle; a later re-partition or restart may use them, and the policies that grow
(``GROWS``: adaptive, as chameleon run takes rejoined workers in, and Oobleck's) move to
the fastest layout over every live worker at once when that pays before the next
failure (``Simulator.grow``; the oracle follows adaptive's growths). A job with no feasible recovery stops training until workers are back to
run it; then it restarts from its last checkpoint, as torchrun or a requeueing scheduler
would.

Slowdowns (a trace's ``slow`` and ``speed`` events: a worker that keeps training, slower)
hold every step back to the slow worker's pace, priced by the estimator at each worker's
speed. ``adaptive`` (and the oracle, whose choices are chameleon run's) plans around them
as chameleon run does (launcher/stragglers.py): once a slowdown has lasted as long as the
uneven deal needs to pay for its moves there and back (planner.choice.stragglers'
break-even horizon; never before the slow worker could be found, ``FOUND_AFTER_STEPS``),
its step is dealt unevenly, and evenly again when the worker has its speed back. The
other policies wait for it, as every launcher today does. A failure's plan replaces the
deal (the next look starts afresh), and a failure during a deal is answered as from the
even plan it came from: the micro-batches each pipeline runs are all that differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from planner.choice.policy import Candidate, Policy, Transition
from planner.choice.selection import (
    Outlook,
    best_bounded,
    choose,
    growth_choice,
    layout_risk_s,
    log_score,
    restart_variant,
    worth_growing,
)
from planner.job.workload import Job
from planner.plans.layout import initial_plan
from planner.search.layouts import Search
from planner.simulation.answers import Answers
from planner.simulation.state import Choice, Deal, State, pace_s
from planner.simulation.symmetry import Question
from planner.simulation.trace import Event, Trace

POLICIES = ("adaptive", "reroute", "reparallelize", "restart", "redundant", "oracle")
# Policies that take repaired workers back in when it pays: chameleon run (its rejoined
# replacements and nodes) and Oobleck (which re-instantiates pipelines on nodes that
# return). ReCycle keeps its layout, torchrun restarts only on a failure, Bamboo keeps
# its redundancy's layout.
GROWS = ("adaptive", "reparallelize")
# Policies that deal a slow worker fewer micro-batches (chameleon run's --stragglers);
# the oracle's states do as adaptive does.
PLANS_AROUND = ("adaptive", "oracle")
# chameleon run finds a straggler once the median of its pace window has moved: about
# half the window's steps after it slowed (launcher/stragglers.py, MIN_PACE_STEPS).
FOUND_AFTER_STEPS = 5
# Bamboo's redundant computation, as a share of a failure-free step. An assumption (the
# figure depends on the model and the bubbles it fills), stated in docs/simulate.md.
REDUNDANT_OVERHEAD = 0.25
_FULL = 1 - 1e-9  # a rate at least this share of failure-free counts as full speed


class Simulator:
    """One job's runs, its policies and the oracle's branches sharing the planner's
    answers (planner.simulation.answers; ``rename``: None to rename where workers are
    interchangeable, False never)."""

    def __init__(
        self,
        job: Job,
        *,
        redundant_overhead: float = REDUNDANT_OVERHEAD,
        rename: bool | None = None,
    ) -> None:
        self.job = job
        self.search = Search(job).warm_up()
        self.plan0 = initial_plan(job)
        self.step0_s = self.search.estimate(self.plan0).step_s
        self.rate0 = job.training.global_batch_size / self.step0_s
        self.redundant_overhead = redundant_overhead
        self.answers = Answers(job, self.search, rename=rename)

    @property
    def decisions(self) -> int:
        """Answers the planner computed (the rest were cached: planner.simulation.answers)."""
        return self.answers.computed

    def start(self, policy: str) -> State:
        spares = range(self.job.num_workers, self.job.num_workers + self.job.num_spare_workers)
        slowdown = 1 + self.redundant_overhead if policy == "redundant" else 1.0
        step = self.step0_s * slowdown
        return State(
            plan=self.plan0,
            step_s=step,
            slowdown=slowdown,
            resume_s=0.0,
            redo_until_s=0.0,
            checkpoint_from_s=0.0,
            spares=frozenset(spares),
            rate=self.job.failure_rate(),
            points=((0.0, self.rate_of(step)), ()),
        )

    def rate_of(self, step_s: float) -> float:
        """Samples per second at ``step_s`` a step."""
        return self.job.training.global_batch_size / step_s

    def since_checkpoint_s(self, state: State) -> float:
        """Training a restart at ``state``'s time would redo: since its last checkpoint."""
        return (state.t_s - state.checkpoint_from_s) % self.job.training.checkpoint_interval_s

    @staticmethod
    def training(state: State) -> bool:
        """Whether ``state`` is in a step (not stopped, not in a transition)."""
        return state.plan is not None and state.t_s >= state.resume_s

    # -- time passing -------------------------------------------------------------------

    def advance(self, state: State, t_s: float) -> State:
        """``state`` carried to ``t_s``: training where it may, counted."""
        if t_s <= state.t_s:
            return state
        t0, tot = state.t_s, state.totals
        dead = max(0.0, min(t_s, state.resume_s) - t0)
        train_from = max(t0, state.resume_s)
        train = max(0.0, t_s - train_from) if state.plan is not None else 0.0
        redo = max(0.0, min(t_s, state.redo_until_s) - train_from) if train else 0.0
        useful = train - redo
        rate = self.rate_of(pace_s(state))
        share = rate / self.rate0
        full = share >= _FULL
        recovered = tot.in_place + tot.restarts > 0
        # (post-recovery rates the recovery's plan: a straggler's toll is in degraded)
        planned = self.rate_of(state.step_s) / self.rate0
        tot = replace(
            tot,
            samples=tot.samples + rate * useful,
            useful_s=tot.useful_s + useful,
            full_s=tot.full_s + (useful if full else 0.0),
            transition_s=tot.transition_s + (dead if state.plan is not None else 0.0),
            stopped_s=tot.stopped_s + (t_s - t0 if state.plan is None else 0.0),
            redo_s=tot.redo_s + redo,
            degraded_s=tot.degraded_s + (0.0 if full else useful * (1 - share)),
            post_s=tot.post_s + (useful if recovered else 0.0),
            post_rate_s=tot.post_rate_s + (useful * planned if recovered else 0.0),
            slowed_s=tot.slowed_s + (useful if state.slowed_step_s is not None else 0.0),
        )
        return replace(state, t_s=t_s, totals=tot)

    # -- events ---------------------------------------------------------------------------

    def hit(self, state: State, event: Event) -> tuple[State, tuple[int, ...]]:
        """``state`` at a failure, before any recovery: the workers it loses from its plan."""
        state = self.advance(state, event.t_s)
        lost = frozenset(event.workers)
        in_use = state.plan.workers if state.plan is not None else ()
        hit = tuple(sorted(lost.intersection(in_use)))
        rate = state.rate
        if rate is not None:  # what chameleon run observes: its devices' time, its failures
            rate = rate.observe(
                devices=len(in_use) * self.job.tp,
                seconds=event.t_s - state.observed_s,
                failures=1 if hit else 0,
                node_failures=1 if hit and event.takes_node(self.job) else 0,
            )
        state = replace(
            state,
            down=state.down | lost,
            idle=state.idle - lost,
            spares=state.spares - lost,
            rate=rate,
            observed_s=event.t_s,
            # (a failed device is replaced, or back from repair, at its speed)
            slow=tuple((w, f) for w, f in state.slow if w not in lost),
            slow_since=tuple((w, t) for w, t in state.slow_since if w not in lost),
        )
        return state, hit

    def repair(self, state: State, event: Event, policy: str | None = None) -> State:
        """Workers back; a stopped job relaunched on them; one that ``policy`` grows
        (``GROWS``) takes them in when that pays (``grow``)."""
        state = self.advance(state, event.t_s)
        back = frozenset(event.workers) & state.down
        in_plan = set(state.plan.workers) if state.plan is not None else set()
        job_workers = {w for w in back if w < self.job.num_workers and w not in in_plan}
        state = replace(
            state,
            down=state.down - back,
            idle=state.idle | job_workers,
            spares=state.spares | {w for w in back if w >= self.job.num_workers},
        )
        if state.plan is None:
            return self.relaunch(state)
        return self.grow(state, policy) if policy in GROWS and job_workers else state

    def grow(self, state: State, policy: str = "adaptive") -> State:
        """Adaptive: the best-scoring layout over every live worker, risk included, when
        moving there pays before the next failure (``planner.choice.selection.growth_choice``),
        as ``chameleon run`` does when replacements rejoin (launcher/calibration.py).
        Oobleck (``reparallelize``) when nodes come back: the fastest layout, risk-blind,
        when it pays. Not a recovery: no detection, no step interrupted. Only while
        training."""
        if not self.training(state) or not state.idle or state.rate is None:
            return state
        assert state.plan is not None
        q = self.answers.question(state.plan, (), state.idle, state.spares)
        outlook = self.outlook(state)
        # Most repairs cannot pay: even the fastest layout the search finds, moved to for
        # free and with no risk, would not beat staying (worth_growing falls with the
        # grown step, its transition and its risk). Then no migration is planned at all.
        fastest_s = self.answers.fastest_step_s(q)
        if fastest_s is None or not worth_growing(
            current_s=state.step_s / state.slowdown,
            grown_s=fastest_s,
            transition_s=0.0,
            mtbf_s=outlook.mtbf_s,
            current_risk_s=(
                layout_risk_s(self.job, state.plan, outlook) if policy == "adaptive" else 0.0
            ),
        ):
            return state
        options = self._growth_options(q, outlook, policy)
        best = growth_choice(
            self.job, state.plan, state.step_s / state.slowdown, options, outlook,
            risk=policy == "adaptive",
        )  # fmt: skip
        if best is None or best.estimate is None:
            return state
        step = best.estimate.step_s * state.slowdown
        assert best.plan is not None
        t, used = state.t_s, set(best.plan.workers)
        resume = t + best.transition.total_s
        return replace(
            state,
            plan=best.plan,
            step_s=step,
            resume_s=resume,
            idle=frozenset((state.idle | set(state.plan.workers)) - used),
            totals=replace(state.totals, growths=state.totals.growths + 1),
            points=((resume, self.rate_of(step)), ((t, 0.0), state.points)),
            slowed_step_s=None,  # (``paced`` prices the new plan's slow workers)
            deal=None,
            pending=None,
        )

    def _growth_options(self, q: Question, outlook: Outlook, policy: str) -> list[Candidate]:
        """What ``grow`` weighs, in the state's names: adaptive's best-scoring re-partition
        over every live worker (``growth_choice`` takes the best: the others are not
        planned, as in ``_adaptive``), Oobleck's fastest."""
        if policy != "adaptive":
            fastest_rp = self.answers.fastest_reparallelize(q)
            return [q.answer(fastest_rp)] if fastest_rp is not None else []
        best_rp = best_bounded(
            (
                (rate, lambda i=i: q.answer(self.answers.repartition(q, i)))
                for i, rate in enumerate(self._rates(q))
            ),
            lambda c: log_score(self.job, c, outlook),
        )
        return [best_rp] if best_rp is not None else []

    def _rates(self, q: Question) -> list[float]:
        """``log(B / step)`` of each layout a re-partition could move to, in
        ``answers.layouts(q)``'s order (none where some layer lost every replica): the
        bound ``best_bounded`` needs of each re-partition's ``log_score``, and with a
        restart's transition of each restart variant's."""
        if not self.answers.movable(q):
            return []
        batch = self.job.training.global_batch_size
        return [math.log(batch / layout.step_s) for layout in self.answers.layouts(q)]

    def relaunch(self, state: State) -> State:
        """A stopped job started again from its last checkpoint once workers are back to
        run it (what torchrun, or a scheduler requeueing it, does when nodes return):
        the launch plan on them, else the fastest plan over them; still stopped when none
        fits."""
        if not state.idle and not state.spares:
            return state
        # a stopped job's live workers are all idle
        c = self.answers.relaunch(self.plan0, state.idle, state.spares)
        choice = self._restart(c, state.lost_at_stop_s, state.slowdown)
        return state if choice is None else self.recover(state, choice)

    def mtbf_s(self, state: State) -> float:
        assert state.rate is not None and state.plan is not None
        return state.rate.mtbf(len(state.plan.workers) * self.job.tp).seconds

    def outlook(self, state: State) -> Outlook:
        """What adaptive's choice sees of the failures to come, as chameleon run does:
        D and the share of failures that take a node, both learned; the checkpoint's
        phase."""
        assert state.rate is not None
        return Outlook(self.mtbf_s(state), self.since_checkpoint_s(state), state.rate.node_share())

    def choices(self, state: State, lost: Sequence[int], policy: str) -> list[Choice]:
        """The recoveries ``policy`` may pick for ``lost`` (several only for the oracle),
        empty when none is feasible."""
        assert state.plan is not None
        q = self.answers.question(state.plan, lost, state.idle, state.spares)
        return [
            replace(c, candidate=q.answer(c.candidate))
            for c in self._choices(q, state, lost, policy)
        ]

    def _choices(self, q: Question, state: State, lost: Sequence[int], policy: str) -> list[Choice]:
        def fallback() -> list[Choice]:
            since = self.since_checkpoint_s(state)
            restart = self._restart(self.answers.restart(q), since, state.slowdown)
            return [restart] if restart is not None else []

        def plain(c: Candidate) -> Choice:
            assert c.estimate is not None
            return Choice(c, c.estimate.step_s)

        if policy == "adaptive":
            chosen = self._adaptive(q, state)
            if chosen is None:
                return []
            if chosen.policy is Policy.RESTART:
                restart = self._restart(chosen, self.since_checkpoint_s(state), state.slowdown)
                return [restart] if restart is not None else []
            return [plain(chosen)]
        if policy in ("reroute", "redundant"):
            reroute = self.answers.reroute(q)
            if not reroute.feasible:
                return fallback()
            if policy == "reroute":
                return [plain(reroute)]
            takeover = Transition(protocol_s=reroute.transition.protocol_s)
            c = plain(replace(reroute, transition=takeover))
            return [Choice(c.candidate, c.step_s * state.slowdown)]
        if policy == "reparallelize":
            fastest = self.answers.fastest_reparallelize(q)
            if fastest is None:
                return fallback()
            naive = fastest.migration.naive()
            f = self.job.cluster.transition_factor
            tr = replace(fastest.transition, migration_s=f * naive.est_time_s)
            return [plain(replace(fastest, migration=naive, transition=tr))]
        if policy == "restart":
            return fallback()
        if policy == "oracle":
            reroute = self.answers.reroute(q)
            out = [plain(reroute)] if reroute.feasible else []
            out += [plain(c) for c in self.answers.reparallelize(q)]
            return out + fallback()
        raise ValueError(f"unknown policy {policy!r}")

    def _adaptive(self, q: Question, state: State) -> Candidate | None:
        """chameleon run's choice (``planner.choice.selection.choose``) among the reroute, the
        best-scoring re-partition and the restart on the best-scoring layout (risk
        included), in the question's names; None when none is feasible. The same choice
        as over every candidate (tests/test_simulate.py), but a re-partition's migration,
        or a restart's layout, is planned only when its step alone could still beat the
        best found (``best_bounded``): most searches' slower layouts never could."""
        job, outlook = self.job, self.outlook(state)

        def key(c: Candidate) -> float:
            return log_score(job, c, outlook)

        rates = self._rates(q)
        restart = self.answers.restart(q)
        variants: list[tuple[float, Callable[[], Candidate | None]]] = [(math.inf, lambda: restart)]
        if restart.feasible:  # (``restart_variants``)
            layouts = self.answers.layouts(q)
            variants += [
                (rate - restart.transition.total_s / outlook.mtbf_s,
                 lambda i=i: restart_variant(restart, layouts[i].proposal))
                for i, rate in enumerate(rates)
            ]  # fmt: skip
        best_restart = best_bounded(variants, key)
        assert best_restart is not None
        chosen_restart = self._restart(best_restart, self.since_checkpoint_s(state), state.slowdown)
        reroute = self.answers.reroute(q)
        others = [reroute] + ([chosen_restart.candidate] if chosen_restart is not None else [])
        above = max((key(c) for c in others if c.feasible), default=-math.inf)
        best_rp = best_bounded(
            ((rate, lambda i=i: self.answers.repartition(q, i)) for i, rate in enumerate(rates)),
            key,
            above=above,
        )
        restart_c = chosen_restart.candidate if chosen_restart is not None else None
        return choose(job, [c for c in (reroute, best_rp, restart_c) if c is not None], outlook)

    def _restart(self, c: Candidate, since_s: float, slowdown: float) -> Choice | None:
        """A restart that redoes ``since_s`` and then trains at ``slowdown`` times its
        plan's step (a redundant job relaunched still computes redundantly)."""
        if not c.feasible:
            return None
        assert c.estimate is not None
        return Choice(
            replace(c, transition=replace(c.transition, lost_work_s=since_s)),
            c.estimate.step_s * slowdown,
        )

    def recover(self, state: State, choice: Choice | None) -> State:
        """``state`` (at its failure) moved to ``choice``; stopped when there is none."""
        t, tot = state.t_s, state.totals
        training = self.training(state)
        if choice is None:
            return replace(
                state,
                plan=None,
                lost_at_stop_s=self.since_checkpoint_s(state) if training else state.lost_at_stop_s,
                totals=replace(tot, stopped=True),
                points=((t, 0.0), state.points),
            )
        c, tr = choice.candidate, choice.transition
        assert c.plan is not None
        restart = c.policy is Policy.RESTART
        used = set(c.plan.workers)
        old = set(state.plan.workers) if state.plan is not None else set()
        idle = (state.idle | (old - state.down)) - used  # the lost are down, never idle
        step = choice.step_s
        # Beyond its transition, a failure costs the time until it is seen, and one that
        # interrupts a step loses that step's work so far (half a step on average; a
        # restart's lost work since its checkpoint already holds it).
        interrupted = pace_s(state) / 2 if training and not restart else 0.0
        blocked = self.job.cluster.detection_s + interrupted + tr.total_s - tr.lost_work_s
        return replace(
            state,
            plan=c.plan,
            step_s=step,
            resume_s=t + blocked,
            redo_until_s=t + blocked + tr.lost_work_s if restart else state.redo_until_s,
            checkpoint_from_s=t + blocked if restart else state.checkpoint_from_s,
            idle=frozenset(idle),
            spares=state.spares - used,
            totals=replace(
                tot,
                in_place=tot.in_place + (0 if restart else 1),
                restarts=tot.restarts + (1 if restart else 0),
            ),
            points=(
                (t + blocked, self.rate_of(step)),
                ((t, 0.0), state.points),
            ),
            slowed_step_s=None,  # (``paced`` prices the new plan's slow workers)
            deal=None,
            pending=None,
        )

    # -- slowdowns ------------------------------------------------------------------------

    def speed_change(self, state: State, event: Event, policy: str) -> State:
        """Workers slowed (``slow``) or back to speed (``speed``), then ``paced``."""
        state = self.due(state, event.t_s, policy)
        state = self.advance(state, event.t_s)
        slow, since = dict(state.slow), dict(state.slow_since)
        for w in event.workers:
            if event.kind == "slow":
                slow[w] = event.factor
                since.setdefault(w, event.t_s)
            else:
                slow.pop(w, None)
                since.pop(w, None)
        state = replace(
            state, slow=tuple(sorted(slow.items())), slow_since=tuple(sorted(since.items()))
        )
        return self.paced(state, policy)

    def paced(self, state: State, policy: str) -> State:
        """``state``'s step at its slow workers' speed, and (``PLANS_AROUND``) the deal
        around them: kept while any worker it was made for is still slow, taken back
        once none is, and otherwise made pending from when it pays (module doc)."""
        if state.plan is None:
            return state
        if not state.slow and state.deal is None:
            if state.slowed_step_s is None and state.pending is None:
                return state
            return self._repaced(state, None, None)
        workers = set(state.plan.workers)
        slow = tuple((w, f) for w, f in state.slow if w in workers)
        if state.deal is not None:
            if any(w in dict(slow) for w in state.deal.around):
                return state  # still dealt around them
            state = self._dealt(state, None, state.deal.back_s)
        if not slow:
            return self._repaced(state, None, None)
        around = policy in PLANS_AROUND
        answer = self.answers.slowed(state.plan, slow, deal=around)
        pending = None
        if around and answer.dealt_step_s is not None and answer.break_even_s is not None:
            since = min(t for w, t in state.slow_since if w in workers)
            step = answer.step_s * state.slowdown
            at = max(since + answer.break_even_s, since + FOUND_AFTER_STEPS * step)
            pending = Deal(
                at_s=max(at, state.resume_s),
                around=tuple(w for w, _ in slow),
                step_s=answer.dealt_step_s * state.slowdown,
                there_s=answer.there_s,
                back_s=answer.back_s,
            )
        return self._repaced(state, answer.step_s * state.slowdown, pending)

    def _repaced(self, state: State, step_s: float | None, pending: Deal | None) -> State:
        before = pace_s(state)
        state = replace(state, slowed_step_s=step_s, pending=pending)
        if pace_s(state) != before and self.training(state):
            state = replace(state, points=((state.t_s, self.rate_of(pace_s(state))), state.points))
        return state

    def due(self, state: State, t_s: float, policy: str) -> State:
        """``state`` with its pending deal made, if it falls by ``t_s``."""
        deal = state.pending
        if deal is None or deal.at_s > t_s or state.plan is None:
            return state
        state = self.advance(state, deal.at_s)
        return self._dealt(state, deal, deal.there_s)

    def _dealt(self, state: State, deal: Deal | None, move_s: float) -> State:
        """A move at ``state``'s time to ``deal`` (None: back to the even deal): like a
        recovery's, at a step boundary, nothing lost; not training for ``move_s``."""
        t = state.t_s
        resume = max(state.resume_s, t + move_s)
        step = deal.step_s if deal is not None else state.step_s
        return replace(
            state,
            deal=deal,
            pending=None,
            slowed_step_s=step if deal is not None else None,
            resume_s=resume,
            totals=replace(state.totals, deals=state.totals.deals + 1),
            # (no stop in the series: a deal is not a recovery, and its move is seconds)
            points=((resume, self.rate_of(step)), state.points),
        )

    def run(
        self,
        trace: Trace,
        policy: str,
        on_event: Callable[[float, int], None] | None = None,
    ) -> State:
        """One policy over ``trace`` (not the oracle: planner.simulation.oracle); ``on_event(t_s,
        failures so far)`` after each event (a progress bar's)."""
        state, failures = self.start(policy), 0
        for event in trace.events:
            state = self.step(state, event, policy)
            failures += event.kind == "fail"
            if on_event is not None:
                on_event(event.t_s, failures)
        return self.finish(state, trace.duration_s, policy)

    def step(self, state: State, event: Event, policy: str) -> State:
        """``state`` through one event of its trace, as ``policy`` meets it."""
        state = self.due(state, event.t_s, policy)
        if event.kind in ("slow", "speed"):
            return self.speed_change(state, event, policy)
        if event.kind == "repair":
            state = self.repair(state, event, policy)
        else:
            state, lost = self.hit(state, event)
            if lost:
                options = self.choices(state, lost, policy)
                state = self.recover(state, options[0] if options else None)
        return self.paced(state, policy)

    def finish(self, state: State, duration_s: float, policy: str) -> State:
        return self.advance(self.due(state, duration_s, policy), duration_s)
