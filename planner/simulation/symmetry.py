"""Failures that are the same up to which workers they name, recognised as one.

On a cluster where every worker is interchangeable (a node each, one host each, every
link alike: the 1,024 and 16,384 GPU configs), what the planner proposes for a failure
depends on where the failure falls in the plan's structure, not on the workers' ids:
losing stage 3 of pipeline 5 is losing stage 3 of pipeline 77 with the pipelines renamed.
``canonical`` renames a state's workers (and its pipelines' shares of the step) in an
order drawn from the plan's structure, so that such states become equal; the simulator
(planner.simulation.answers) plans the renamed state once and names the answer back
(``Question.answer``) for each state that maps to it.

The renaming is a bijection, so the answer for the renamed state is the answer for an
isomorphic state: exactly right up to the planner's tie-breaks by worker id. It is not a
complete canonical form (two isomorphic states may still be named differently when their
structure ties in a way the ordering below does not resolve); that costs cache misses,
never a wrong answer. On a cluster whose workers are not interchangeable (several per
node, several nodes per host) ``interchangeable`` is false and nothing is renamed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from planner.choice.policy import Candidate
from planner.job.workload import Job
from planner.plans.matching import Transfer
from planner.plans.plan import Plan, Route, rename_workers


def interchangeable(job: Job) -> bool:
    """Whether any renaming of workers keeps every cost the same (Job.interchangeable_workers)."""
    return job.interchangeable_workers


@dataclass(frozen=True)
class Question:
    """A failure as the planner is asked it: a plan, the workers it lost, the live
    workers it leaves idle and the spares, each sorted; renamed by ``canonical`` (then
    ``back`` maps the names to the state's own) or as the state named them (``as_is``)."""

    plan: Plan
    lost: tuple[int, ...]
    idle: tuple[int, ...]
    spares: tuple[int, ...]
    back: Mapping[int, int] | None = None

    @property
    def survivors(self) -> list[int]:
        lost = set(self.lost)
        return [w for w in self.plan.workers if w not in lost] + list(self.idle)

    @property
    def pool(self) -> tuple[int, ...]:
        """Who may replace a lost worker at a restart, in the order it takes them."""
        return tuple(sorted((*self.idle, *self.spares)))

    def answer(self, c: Candidate) -> Candidate:
        """``c``, planned for this question, in the state's own names."""
        return c if self.back is None else renamed_candidate(c, self.back)


def as_is(plan: Plan, lost: Iterable[int], idle: Iterable[int], spares: Iterable[int]) -> Question:
    return Question(plan, tuple(sorted(lost)), tuple(sorted(idle)), tuple(sorted(spares)))


def canonical(
    plan: Plan, lost: Iterable[int], idle: Iterable[int], spares: Iterable[int]
) -> Question:
    """The state renamed in the order of its routes sorted by their structure (each
    hop's layers, load and whether it is lost), then the stages on no route, the idle
    workers and the spares. Pipelines' shares (homes) are renumbered in the order their
    routes come, and micro-batches in home order, keeping each one's position in its
    home (the order a worker runs them in)."""
    lost_set = set(lost)
    load = plan.load()
    stage_of = plan.stage_of

    def sig(w: int) -> tuple[int, int, int, bool]:
        s = stage_of[w]
        return (s.first_layer, s.end_layer, load[w], w in lost_set)

    routes = plan.routes
    order = sorted(
        range(len(routes)),
        key=lambda i: (len(routes[i].micro_batches), tuple(map(sig, routes[i].hops)), i),
    )
    name: dict[int, int] = {}
    for i in order:
        for w in routes[i].hops:
            if w not in name:
                name[w] = len(name)
    for w in sorted((w for w in plan.workers if w not in name), key=lambda w: (sig(w), w)):
        name[w] = len(name)
    idle_names = tuple(name.setdefault(w, len(name)) for w in sorted(idle))
    spare_names = tuple(name.setdefault(w, len(name)) for w in sorted(spares))

    homes: dict[int, int] = {}
    for i in order:
        homes.setdefault(routes[i].home, len(homes))
    mb_name: dict[int, int] = {}
    for home in sorted(homes, key=homes.__getitem__):
        for mb in plan.micro_batches_of_home[home]:
            mb_name[mb] = len(mb_name)
    new_routes = tuple(
        Route(
            homes[routes[i].home],
            tuple(name[w] for w in routes[i].hops),
            tuple(mb_name[mb] for mb in routes[i].micro_batches),
        )
        for i in order
    )
    pipelines = tuple(sorted(tuple(name[w] for w in p) for p in plan.pipelines))
    renamed = rename_workers(plan, name, routes=new_routes, pipelines=pipelines)
    return Question(
        plan=renamed,
        lost=tuple(sorted(name[w] for w in lost_set)),
        idle=idle_names,
        spares=spare_names,
        back={new: old for old, new in name.items()},
    )


def renamed_candidate(c: Candidate, name: Mapping[int, int]) -> Candidate:
    """``c`` with its workers renamed: its plan, its estimate's per-worker figures and its
    migration's transfers (a reason that names a worker keeps the name it was planned
    under)."""
    if c.plan is None:
        return c
    plan = rename_workers(c.plan, name)
    est = c.estimate
    if est is not None:
        est = replace(
            est,
            plan=plan,
            memory_bytes={name[w]: b for w, b in est.memory_bytes.items()},
            in_flight={name[w]: n for w, n in est.in_flight.items()},
        )

    def moved(transfers: tuple[Transfer, ...]) -> tuple[Transfer, ...]:
        return tuple(replace(t, src=name[t.src], dst=name[t.dst]) for t in transfers)

    m = c.migration
    migration = replace(m, transfers=moved(m.transfers), naive_transfers=moved(m.naive_transfers))
    return replace(c, plan=plan, estimate=est, migration=migration)
