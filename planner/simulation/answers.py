"""The planner's answers to a simulated run's questions, each computed once.

``chameleon simulate`` asks the planner, at every failure of every policy's run (and of
every branch of the oracle), for the candidates ``chameleon run`` would weigh: the
reroute, the re-partitions, the restart (the parts of ``planner.choice.selection.gather``).
Runs that reach the same state ask the same question, so each part is cached apart,
keyed by what it depends on: a reroute by (plan, workers lost); the re-partitions by that
and the idle workers; a restart by those and the spares it would take.

Where workers are interchangeable (planner.simulation.symmetry), a question about a plan of whole
pipelines is asked under names drawn from the plan's structure, so that a failure at the
same place in any pipeline is answered once; the caller names the chosen answer back
(``Question.answer``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from planner.choice.policy import Candidate, reroute_candidate, restart_candidate
from planner.choice.selection import reparallelize_options, search_repartitions
from planner.job.workload import Job
from planner.plans.plan import Plan
from planner.search.layouts import Proposal, Search
from planner.simulation.symmetry import Question, as_is, canonical, interchangeable


class Answers:
    def __init__(self, job: Job, search: Search, *, rename: bool | None = None) -> None:
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

    def _cached(self, key: tuple, answer: Callable[[], Any]) -> Any:
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = answer()
            self.computed += 1
        return hit

    def reroute(self, q: Question) -> Candidate:
        """In the question's names."""
        return self._cached(
            ("reroute", q.plan, q.lost), lambda: reroute_candidate(self.search, q.plan, q.lost)
        )

    def _repartitions(self, q: Question) -> tuple[tuple[Candidate, ...], Proposal | None, float]:
        survivors = q.survivors
        searched = self._cached(
            self._search_key(q), lambda: search_repartitions(self.search, q.plan, survivors)
        )
        return self._cached(
            ("reparallelize", q.plan, q.lost, q.idle),
            lambda: reparallelize_options(
                self.search, q.plan, q.lost, survivors, searched=searched
            ),
        )

    def _search_key(self, q: Question) -> tuple:
        """What the search over ``q``'s survivors depends on. Renamed, idle workers come
        after every worker of the plan and the search takes the first it needs (the
        matching breaks ties to the lower name: planner.plans.matching), so beyond the shapes
        it ranks for that many workers, only the idle workers its widest shape could
        take matter: a search with a few more idle workers is the same search. Its
        candidates' protocol still counts every survivor (``_repartitions``)."""
        if q.back is None:  # as named: an idle worker may come before the plan's
            return ("search", q.plan, q.lost, q.idle)
        kept = len(q.plan.workers) - len(q.lost)
        ranked = self.search.rank_shapes(kept + len(q.idle))
        widest = max((sum(n * c for n, c in shape) for _t, shape, _c in ranked), default=0)
        shapes = tuple(shape for _t, shape, _c in ranked)
        return ("search", q.plan, q.lost, shapes, q.idle[: max(0, widest - kept)])

    def reparallelize(self, q: Question) -> list[Candidate]:
        """The feasible re-partitions, in the question's names."""
        return [c for c in self._repartitions(q)[0] if c.feasible]

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
                best_over_survivors=self._repartitions(q)[1],
                since_checkpoint_s=0.0, spares=pool,
            ),
        )  # fmt: skip

    def relaunch(self, launch: Plan, alive: Sequence[int], spares: Sequence[int]) -> Candidate:
        """A stopped job started again on ``alive`` workers and ``spares``: ``launch`` on
        them, else the fastest plan over them (in the state's own names)."""
        alive, spares = tuple(sorted(alive)), tuple(sorted(spares))

        def answer() -> Candidate:
            back = set(alive)
            failed = [w for w in launch.workers if w not in back]
            best = reparallelize_options(self.search, launch, failed, alive)[1]
            return restart_candidate(
                self.search, launch, failed, alive, best_over_survivors=best,
                since_checkpoint_s=0.0, spares=spares,
            )  # fmt: skip

        return self._cached(("relaunch", launch, alive, spares), answer)
