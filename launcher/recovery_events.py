"""The vocabulary of the recovery state machine (launcher/recovery.py): the events it is
fed and the actions it returns. Plain frozen data; the transitions are all in
launcher/recovery.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

Layout = Mapping[int, tuple[int, int]]  # worker -> [first, end) layers of its stage


@dataclass(frozen=True)
class Timeouts:
    """Each phase's deadline, and how many plans in a row may apply no step."""

    collect_s: float = 60.0  # every survivor answers an abort (a compute in flight ends)
    plan_s: float = 120.0
    confirm_s: float = 60.0  # groups built, layers moved, agreed (plus 3x the estimate)
    max_futile: int = 3


class Phase(StrEnum):
    RUNNING = "running"
    COLLECT = "collect"
    PLAN = "plan"
    CONFIRM = "confirm"
    ENDED = "ended"  # handed to a checkpoint restart


@dataclass(frozen=True)
class Report:
    """A worker's ``Ready`` (chameleon_runtime.protocol.messages)."""

    after: int  # the generation it left
    applied: int  # the last generation it applied
    step: int | None  # the next step it would run; None for a spare
    held: tuple[int, ...]
    reason: str = ""
    # A ring's commit (chameleon_runtime.protocol.messages.Ready): posted for ``step`` and not seen to end;
    # what step - 1's commit summed.
    pending: bool = False
    committed: tuple[float, ...] | None = None


# -- events ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Failed:
    ranks: frozenset[int]
    reason: str = ""


@dataclass(frozen=True)
class ReadyReported:
    rank: int
    report: Report


@dataclass(frozen=True)
class AppliedReported:
    rank: int
    generation: int
    # How long before the leader read the report the worker applied the plan and went
    # back to training: on a host whose cores the training workers saturate, the
    # leader's reads lag by many milliseconds, and the transition ends for the job when
    # its last member trains again, not when the leader gets around to reading it.
    lag_s: float = 0.0


@dataclass(frozen=True)
class Planned:
    """The planner's answer for generation ``generation``: a plan (its layout, members
    and estimated transition), or a restart with its reason."""

    generation: int
    restart: bool = False
    reason: str = ""
    layout: Layout | None = None
    members: frozenset[int] = frozenset()
    transition_s: float = 0.0


@dataclass(frozen=True)
class Tick:
    pass


@dataclass(frozen=True)
class Grow:
    """Replacements (spares already live) are worth taking into the plan."""

    ranks: frozenset[int]


@dataclass(frozen=True)
class Rebalance:
    """The layout the planner launched on, chosen before any step was measured
    (``pipeline_stages="auto"``), is worth leaving for one the planner prefers now that
    it is calibrated: a re-partition over the live workers, as a growth is."""


@dataclass(frozen=True)
class Replan:
    """A healthy job moves to another plan over the same workers, at a step boundary, as
    a recovery does but with nothing lost: around slow workers (``slow``: worker and how
    many times slower, launcher/stragglers.py; ``horizon_s`` how long the slowdown is
    expected to last: planner.choice.stragglers), or, ``slow`` empty, back to an even
    deal once they have their speed back."""

    slow: tuple[tuple[int, float], ...] = ()
    horizon_s: float = 0.0


@dataclass(frozen=True)
class Preempt:
    """A preemption notice: the next plan, the same layout, tells the members to save at
    the step they resume at and stop (a pipeline's members cannot agree on that step in
    a step of theirs: a recovery brings them to one)."""


@dataclass(frozen=True)
class Admit:
    """Replacements that are up as spares of the current generation."""

    ranks: frozenset[int]


Event = (
    Failed
    | ReadyReported
    | AppliedReported
    | Planned
    | Tick
    | Grow
    | Rebalance
    | Replan
    | Preempt
    | Admit
)

# -- actions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Abort:
    generation: int
    reason: str
    recovery: int
    lost: tuple[int, ...] = ()


@dataclass(frozen=True)
class StartPlanning:
    """Plan generation ``generation`` from the layout of ``base``: ``failed`` are its
    workers that are gone or no longer hold their stage, ``idle`` live workers that hold
    nothing it needs; ``joining`` replacements to take in (a growth)."""

    generation: int
    base: int
    failed: tuple[int, ...]
    idle: tuple[int, ...]
    resume_step: int
    reached: int
    joining: tuple[int, ...] = ()
    rebalance: bool = False  # no failure: a calibrated re-partition (Rebalance)
    replan: Replan | None = None  # no failure: around slow workers, or back (Replan)
    stop: bool = False  # a preemption notice: the plan keeps the layout and stops (Preempt)
    # Step resume_step - 1 was committed without some survivors seeing it end: they apply
    # it with these sums first (chameleon_runtime.protocol.wire.RollForwardWire).
    roll_forward: tuple[int, tuple[float, ...]] | None = None
    # Joiners and idle workers were left out because of roll_forward (launcher/recovery.py):
    # the plan keeps whom it has, and the joiners come in by a recovery of their own.
    deferred: bool = False


@dataclass(frozen=True)
class Publish:
    generation: int
    after: int  # the generation its workers are leaving


@dataclass(frozen=True)
class Kill:
    ranks: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class Restart:
    reason: str
    reached: int


@dataclass(frozen=True)
class Recovered:
    generation: int
    resume_step: int
    steps_lost: int  # measured: the most steps any survivor applied, less the resume step
    joined: tuple[int, ...]
    duration_s: float
    phases_s: Mapping[str, float]  # time spent in each phase, summed over restarts of it
    last_answer: int | None  # the last worker to answer the last abort (a slow one shows)


@dataclass(frozen=True)
class Forget:
    """Every key of generations before ``below`` may go: no worker reads them again."""

    below: int


@dataclass(frozen=True)
class PhaseChanged:
    phase: Phase
    recovery: int
    generation: int


@dataclass(frozen=True)
class Note:
    """An event for the log that changes nothing (a spare lost, a stale message)."""

    name: str
    fields: Mapping[str, object]


Action = Abort | StartPlanning | Publish | Kill | Restart | Recovered | Forget | PhaseChanged | Note
