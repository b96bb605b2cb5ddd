"""The planner's answers to a simulated run's questions, each computed once.

``chameleon simulate`` asks the planner, at every failure of every policy's run (and of
every branch of the oracle), for the candidates ``chameleon run`` would weigh: the
reroute, the re-partitions, the restart (the parts of ``planner.choice.selection.gather``).
Runs that reach the same state ask the same question, so each part is cached apart,
keyed by what it depends on: a reroute by (plan, workers lost); the search's layouts by
that and the idle workers it could use; each re-partition by that, every idle worker and
which layout (one at a time: a caller plans only those that could be chosen, and
``computed`` counts each); a restart by those and the spares it would take.

Where workers are interchangeable (planner.simulation.symmetry), a question about a plan of whole
pipelines is asked under names drawn from the plan's structure, so that a failure at the
same place in any pipeline is answered once; the caller names the chosen answer back
(``Question.answer``).

A re-partition is not charged the time its search took here: that is this machine's and
this process's (a cached answer would take none), and a seed must replay the same run
anywhere. chameleon run charges its real search; at 16,384 GPUs it is 0.15-0.3 s of a
17 s transition (docs/simulate.md).

A slowdown is asked the same way (``slowed``), the slow workers marked where a failure's
lost ones are: its answer is figures (the step waiting for them, the uneven deal's step,
the moves there and back, the break-even horizon), the same under any renaming.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from planner.choice.policy import (
    Candidate,
    migrations_for,
    reparallelize_candidates,
    reroute_candidate,
    restart_candidate,
)
from planner.choice.selection import reparallelize_options
from planner.choice.stragglers import break_even_s, straggler_choice
from planner.estimator.estimate import estimate
from planner.job.workload import Job
from planner.plans.matching import every_layer_held
from planner.plans.migration import Migration, holdings_of
from planner.plans.plan import Plan
from planner.search.layouts import Layout, Proposal, Search
from planner.simulation.symmetry import Question, as_is, canonical, interchangeable


def _one(migrations: tuple[Migration, ...] | str) -> Migration | str:
    return migrations if isinstance(migrations, str) else migrations[0]


def _untimed() -> float:
    """The search's clock here (module doc): its time is not charged."""
    return 0.0


@dataclass(frozen=True)
class SlowAnswer:
    """A plan with slow workers, in figures (planner.choice.stragglers)."""

    step_s: float  # the plan as it is: every step waits for them
    dealt_step_s: float | None = None  # dealt unevenly around them (None: not asked, or no deal)
    there_s: float = 0.0  # the move to that deal
    back_s: float = 0.0  # and back to the even one
    break_even_s: float | None = None  # how long a slowdown must last for the deal to pay


class Answers:
    def __init__(self, job: Job, search: Search, *, rename: bool | None = None) -> None:
        self.job = job
        self.search = search
        self.rename = interchangeable(job) if rename is None else rename
        self._cache: dict[tuple, Any] = {}
        self.computed = 0  # answers computed (cache misses)

    def question(
        self, plan: Plan, lost: Iterable[int], idle: Iterable[int], spares: Iterable[int]
    ) -> Question:
        """The failure as the planner is asked it (module doc). A plan with rerouted
        pipelines is asked as named: after a few reroutes no two such states are alike, so
        renaming (its thousands of routes sorted by structure) would cost more than the
        answers it could share."""
        whole = len(plan.routes) == len(plan.pipelines)
        return (canonical if self.rename and whole else as_is)(plan, lost, idle, spares)

    def _cached(self, key: tuple, answer: Callable[[], Any], *, counted: bool = True) -> Any:
        """``counted``: whether this is an answer of its own (a search's proposals are
        the first half of the search answer)."""
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = answer()
            self.computed += counted
        return hit

    def reroute(self, q: Question) -> Candidate:
        """In the question's names."""
        return self._cached(
            ("reroute", q.plan, q.lost),
            # (its plans come from valid ones: not checked again, thousands at 16k workers)
            lambda: reroute_candidate(self.search, q.plan, q.lost, validate=False),
        )

    def layouts(self, q: Question) -> tuple[Layout, ...]:
        """The search's layouts over ``q``'s survivors, in the question's names, fastest
        first, each placed on workers only when a caller needs it
        (``planner.search.layouts.Search.layouts``): most questions need the fastest
        alone, or those whose step could still win (``repartition``)."""
        return self._cached(
            ("layouts", *self._search_key(q)),
            lambda: tuple(self.search.layouts(q.plan, q.survivors)) if q.survivors else (),
            counted=False,
        )

    def fastest(self, q: Question) -> Proposal | None:
        """The fastest of the search's proposals (the first of equal ones): what a restart
        over the survivors runs (``fastest_proposal``); None when none fits."""
        layouts = self.layouts(q)
        return layouts[0].proposal if layouts else None

    def fastest_step_s(self, q: Question) -> float | None:
        """The step of ``fastest(q)`` without placing it (None: none fits): what
        ``Simulator.grow`` asks at every repair, where most growths are ruled out on it."""
        layouts = self.layouts(q)
        return layouts[0].step_s if layouts else None

    def _migration(self, q: Question, i: int) -> Migration | str:
        """The migration to ``layouts(q)[i]`` from what ``q``'s survivors hold, or why
        none can move the layers (``migrations_for``; that one layer lost every replica
        holds for every layout alike). Keyed by the search, which leaves out idle workers
        it could not use: idle workers hold no layers, so the holdings are the same."""
        return self._cached(
            ("migration", *self._search_key(q), i),
            lambda: _one(
                migrations_for(self.job, (self.layouts(q)[i].proposal,), q.plan, q.survivors)
            ),
            counted=False,
        )

    def movable(self, q: Question) -> bool:
        """Whether a re-partition can move the layers at all: some layout fits and every
        layer still has a surviving holder (else every layout's migration fails alike)."""
        held = self._cached(
            ("held", q.plan, q.lost),
            lambda: every_layer_held(holdings_of(q.plan, set(q.survivors)), q.plan.num_layers),
            counted=False,
        )
        return held and bool(self.layouts(q))

    def repartition(self, q: Question, i: int) -> Candidate:
        """The re-partition to ``layouts(q)[i]``, in the question's names (infeasible, with
        the reason, when the layers cannot move)."""

        def answer() -> Candidate:
            migration = self._migration(q, i)
            (c,) = reparallelize_candidates(
                self.search, (self.layouts(q)[i].proposal,), q.plan, q.survivors,
                failed=q.lost, search_s=0.0,
                migrations=migration if isinstance(migration, str) else (migration,),
            )  # fmt: skip
            return c

        return self._cached(("reparallelize", q.plan, q.lost, q.idle, i), answer)

    def _search_key(self, q: Question) -> tuple:
        """What the search over ``q``'s survivors depends on. Renamed, idle workers come
        after every worker of the plan and the search takes the first it needs (the
        matching breaks ties to the lower name: planner.plans.matching), so beyond the shapes
        it ranks for that many workers, only the idle workers its widest shape could
        take matter: a search with a few more idle workers is the same search. Its
        candidates' protocol still counts every survivor (``repartition``)."""
        if q.back is None:  # as named: an idle worker may come before the plan's
            return ("search", q.plan, q.lost, q.idle)
        kept = len(q.plan.workers) - len(q.lost)
        ranked = self.search.rank_shapes(kept + len(q.idle))
        widest = max((sum(n * c for n, c in shape) for _t, shape, _c in ranked), default=0)
        shapes = tuple(shape for _t, shape, _c in ranked)
        return ("search", q.plan, q.lost, shapes, q.idle[: max(0, widest - kept)])

    def reparallelize(self, q: Question) -> list[Candidate]:
        """Every feasible re-partition, in the question's names (the oracle weighs them
        all; adaptive's choice makes only those that could win: ``Simulator._adaptive``)."""
        if not self.movable(q):
            return []
        return [c for i in range(len(self.layouts(q))) if (c := self.repartition(q, i)).feasible]

    def fastest_reparallelize(self, q: Question) -> Candidate | None:
        """The re-partition to the fastest proposal (the first of equal ones), in the
        question's names; None when none fits. What ``reparallelize`` gives, less the
        re-partitions it would not pick: Oobleck's policy moves to the fastest, whatever
        the move costs."""
        if not self.layouts(q):
            return None
        c = self.repartition(q, 0)
        return c if c.feasible else None

    def restart(self, q: Question) -> Candidate:
        """In the question's names: the faster of the plan on the first spares (idle
        workers first), when there are enough, and the fastest plan over the survivors
        (planner.choice.policy.restart_candidate)."""
        pool = q.pool
        enough = len(pool) >= len(q.lost)
        key = ("restart", q.plan, q.lost, q.idle, pool[: len(q.lost)] if enough else q.spares)
        return self._cached(
            key,
            lambda: restart_candidate(
                self.search, q.plan, q.lost, q.survivors,
                best_over_survivors=self.fastest(q), since_checkpoint_s=0.0, spares=pool,
            ),
        )  # fmt: skip

    def slowed(self, plan: Plan, slow: Sequence[tuple[int, float]], *, deal: bool) -> SlowAnswer:
        """``plan`` with workers ``slow`` (each with its factor) at their speed; with
        ``deal``, also what chameleon run weighs for them: the uneven deal and from how
        long a slowdown on it pays (a live run never leaves a slow worker out: it could
        not tell when to take it back)."""
        q = self.question(plan, [w for w, _ in slow], (), ())
        name = {old: new for new, old in q.back.items()} if q.back is not None else None
        marked = tuple(sorted((name[w] if name else w, f) for w, f in slow))

        def answer() -> SlowAnswer:
            job = replace(self.job, slow=marked)
            if not deal:
                return SlowAnswer(estimate(job, q.plan).step_s)
            choice = straggler_choice(job, q.plan, 1.0, leave_out=False, repartition=False)
            stay, uneven = choice.stay, choice.options[1]
            assert stay.estimate is not None
            if not uneven.feasible or uneven.estimate is None:
                return SlowAnswer(stay.estimate.step_s)
            return SlowAnswer(
                stay.estimate.step_s,
                uneven.estimate.step_s,
                there_s=uneven.transition_s - uneven.back_s,
                back_s=uneven.back_s,
                break_even_s=break_even_s(choice),
            )

        return self._cached(("slowed", q.plan, marked, deal), answer)

    def relaunch(self, launch: Plan, alive: Sequence[int], spares: Sequence[int]) -> Candidate:
        """A stopped job started again on ``alive`` workers and ``spares``: ``launch`` on
        them, else the fastest plan over them (in the state's own names)."""
        alive, spares = tuple(sorted(alive)), tuple(sorted(spares))

        def answer() -> Candidate:
            back = set(alive)
            failed = [w for w in launch.workers if w not in back]
            best = reparallelize_options(self.search, launch, failed, alive, clock=_untimed)[1]
            return restart_candidate(
                self.search, launch, failed, alive, best_over_survivors=best,
                since_checkpoint_s=0.0, spares=spares,
            )  # fmt: skip

        return self._cached(("relaunch", launch, alive, spares), answer)
