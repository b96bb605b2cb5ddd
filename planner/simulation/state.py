"""What a simulated run carries from one event of its trace to the next
(planner.simulation.simulate): its plan and step, when it trains again, which workers are
down, idle, spare or slow, what it has done so far, and the throughput over time."""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.choice.policy import Candidate, Transition
from planner.job.failures import FailureRate
from planner.plans.plan import Plan


@dataclass(frozen=True)
class Totals:
    """What a run has done so far, in seconds and samples (module doc)."""

    samples: float = 0.0
    useful_s: float = 0.0  # training on new work
    full_s: float = 0.0  # training at the failure-free rate
    transition_s: float = 0.0  # not training: detection to the first step
    redo_s: float = 0.0  # training again over work a restart lost
    degraded_s: float = 0.0  # training time lost to slower steps (equivalent seconds)
    post_s: float = 0.0  # training after the first recovery
    post_rate_s: float = 0.0  # ... weighted by its rate over failure-free
    in_place: int = 0  # failures recovered without a restart
    restarts: int = 0
    growths: int = 0  # repaired workers taken back in (``Simulator.grow``)
    stopped: bool = False  # no feasible recovery: the job stopped
    stopped_s: float = 0.0
    slowed_s: float = 0.0  # training with a slow worker in the plan
    deals: int = 0  # moves to an uneven deal around slow workers, and back


@dataclass(frozen=True)
class Deal:
    """Micro-batches dealt unevenly around slow workers: the step then, and the move back
    (planner.simulation.answers.SlowAnswer); pending until ``at_s``."""

    at_s: float
    around: tuple[int, ...]
    step_s: float
    there_s: float
    back_s: float


@dataclass(frozen=True)
class State:
    plan: Plan | None  # None: stopped
    step_s: float
    resume_s: float  # training resumes here
    redo_until_s: float  # training until here redoes lost work
    checkpoint_from_s: float  # checkpoints every interval from here
    down: frozenset[int] = frozenset()
    idle: frozenset[int] = frozenset()  # alive, in no plan
    spares: frozenset[int] = frozenset()
    rate: FailureRate | None = None  # adaptive's posterior
    observed_s: float = 0.0  # the posterior holds the exposure up to here
    lost_at_stop_s: float = 0.0  # stopped: the work since its last checkpoint, to redo
    slowdown: float = 1.0  # every step's cost over the plan's estimate (redundant's overhead)
    # Slow workers (the trace's, in the plan or not) with their factors, and since when
    # each is slow; the step with those of the plan at their speed (None: none in it); a
    # deal around them, in effect or pending (module doc).
    slow: tuple[tuple[int, float], ...] = ()
    slow_since: tuple[tuple[int, float], ...] = ()
    slowed_step_s: float | None = None
    deal: Deal | None = None
    pending: Deal | None = None
    t_s: float = 0.0  # the state's time
    totals: Totals = field(default_factory=Totals)
    points: tuple = ()  # ((t, samples/s), previous points): throughput over time, linked


@dataclass(frozen=True)
class Choice:
    candidate: Candidate  # its transition as this policy pays it
    step_s: float  # as this policy trains after it (redundant: with its overhead)

    @property
    def transition(self) -> Transition:
        return self.candidate.transition


def pace_s(state: State) -> float:
    """The step ``state`` trains at: its plan's, or held back by slow workers."""
    return state.slowed_step_s if state.slowed_step_s is not None else state.step_s
