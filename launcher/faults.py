"""Fault injection: kill, hang or exit a chosen rank at a chosen time, step or moment of a
recovery.

    --inject-fault kill:rank=3,at=5             SIGKILL rank 3, 5 s after its workers start
    --inject-fault hang:rank=2,step=10          SIGSTOP rank 2 once it has run step 10
                                                (a spare rank: once the job has)
    --inject-fault exit:rank=1,at=4,code=7      rank 1 exits with code 7 (chameleon workers;
                                                a plain script gets SIGTERM instead)
    --inject-fault kill:rank=3,recovery=1       SIGKILL rank 3 during the first in-place
                                                recovery (any phase)
    --inject-fault kill:rank=3,phase=migrate    SIGKILL rank 3 while it moves layers in the
                                                first recovery (recovery=N for the N-th)
    --inject-fault kill:rank=3,phase=plan,after_ms=20
                                                ...20 ms after the planning began
    --inject-fault kill:rank=any,phase=groups   SIGKILL a rank of this node seen building
                                                groups (any: a working rank, not one starting
                                                up or idle, picked at random, seeded)
    --inject-fault slow:rank=2,factor=3,step=10,for=20
                                                from step 10, rank 2 runs at a third of its
                                                speed for 20 s (stopped from outside for
                                                twice the CPU time it runs:
                                                launcher/throttle.py; without for=, to the
                                                end of the round)

Phases: ``collect`` (survivors answer the abort), ``plan`` (the planner works), ``confirm``
(the plan is applied), and within it, as the rank itself reports them, ``groups`` (it has
not built the new generation's group yet: building it, or about to) and ``migrate`` (it
moves layers). ``attempt=N`` (default 0) picks
the restart attempt, so a restarted job is not killed again; ``attempt=any`` fires once in
the whole run, in whichever attempt reaches its moment first (a soak's schedule goes on
after a restart: a step fault at step N fires once the restarted job passes N, if it
has not fired before; ``recovery=N`` is the run's N-th in-place recovery, counted across
restarts). Step and phase faults need
workers that report (scripts using chameleon_runtime). For ``groups`` and ``migrate`` the
workers of the fault's node pause on entering the phase until the fault has fired (at
most 2 s): a migration of a few milliseconds would otherwise often end unseen. A step
fault of a named rank pauses that rank likewise once it has done step N (a fast model's
steps outran the agent's look: a kill meant for step 3 landed with one meant for 8).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from chameleon_runtime.protocol.messages import Keys, RecoveryPhase, WorkerStatus
from launcher.preload import package_of

PHASES = ("collect", "plan", "confirm", "groups", "migrate")
_WORKER_PHASES = ("groups", "migrate")  # reported by the rank itself, within confirm
_BEFORE = {"groups": ("ready", "groups"), "migrate": ("migrate",)}


class FaultKind(StrEnum):
    KILL = "kill"
    HANG = "hang"
    EXIT = "exit"
    SLOW = "slow"


ANY = -1  # rank=any: a working rank of this node in the fault's phase, picked at random
_WORKING = ("train", "checkpoint", "ready", "groups", "migrate")  # not starting, idle, done


@dataclass(frozen=True)
class FaultSpec:
    kind: FaultKind
    rank: int  # or ANY
    at_s: float | None = None
    step: int | None = None
    recovery: int | None = None  # during the N-th in-place recovery
    phase: str | None = None  # ...in this phase of it
    after_ms: float = 0.0  # ...this long after the phase began
    code: int = 1
    attempt: int = 0
    factor: float = 1.0  # slow: the worker runs at 1/factor of its speed
    for_s: float | None = None  # slow: for this long (None: to the round's end)

    def describe(self) -> str:
        if self.at_s is not None:
            when = f"at {self.at_s:g} s"
        elif self.step is not None:
            when = f"at step {self.step}"
        else:
            when = f"during recovery {self.recovery or 1}"
            if self.phase:
                when += f", phase {self.phase}"
            if self.after_ms:
                when += f" + {self.after_ms:g} ms"
        who = "any rank" if self.rank == ANY else f"rank {self.rank}"
        attempt = "any attempt" if self.attempt == ANY else f"attempt {self.attempt}"
        how = ""
        if self.kind is FaultKind.SLOW:
            how = f" {self.factor:g}x" + (f" for {self.for_s:g} s" if self.for_s else "")
        return f"{self.kind.value} {who}{how} {when} ({attempt})"

    def in_attempt(self, attempt: int) -> bool:
        return self.attempt in (attempt, ANY)


_SPEC = re.compile(r"^(kill|hang|exit|slow):(.+)$")
_KEYS = ("rank", "at", "step", "recovery", "phase", "after_ms", "code", "attempt", "factor", "for")


def parse_fault(text: str) -> FaultSpec:
    match = _SPEC.match(text.strip())
    if not match:
        raise ValueError(
            "expected KIND:rank=R,at=SECONDS|step=N|phase=PHASE with KIND kill, hang, exit or "
            "slow (slow:rank=R,factor=F,at=SECONDS|step=N[,for=SECONDS]); "
            f"got {text!r}"
        )
    fields: dict[str, str] = {}
    for part in match.group(2).split(","):
        if "=" not in part:
            raise ValueError(f"expected key=value in {text!r}, got {part!r}")
        key, value = (x.strip() for x in part.split("=", 1))
        if key not in _KEYS:
            raise ValueError(f"unknown key {key!r} in {text!r} ({', '.join(_KEYS)})")
        fields[key] = value
    if "rank" not in fields:
        raise ValueError(f"{text!r} names no rank")
    whens = sum(k in fields for k in ("at", "step")) + int(
        "phase" in fields or "recovery" in fields
    )
    if whens != 1:
        raise ValueError(
            f"{text!r} needs exactly one of at=SECONDS, step=N or phase=PHASE / recovery=N"
        )
    if "phase" in fields and fields["phase"] not in PHASES:
        raise ValueError(f"phase must be one of {', '.join(PHASES)}, in {text!r}")
    if "after_ms" in fields and not ("phase" in fields or "recovery" in fields):
        raise ValueError(f"after_ms goes with phase= or recovery=, in {text!r}")
    slow = match.group(1) == "slow"
    if slow != ("factor" in fields):
        raise ValueError(
            f"factor= goes with slow, and slow needs it (factor=3: a third of the speed), in "
            f"{text!r}"
        )
    if "for" in fields and not slow:
        raise ValueError(f"for= goes with slow, in {text!r}")
    if slow and ("phase" in fields or "recovery" in fields):
        raise ValueError(f"slow starts at=SECONDS or step=N, not in a recovery, in {text!r}")
    # ANY is -1 inside; a user's -1 is a mistake, not a way to say "any"
    for key in ("rank", "attempt"):
        if fields.get(key, "0").lstrip().startswith("-"):
            raise ValueError(f"{key} must be 0 or more, or any, in {text!r}")
    try:
        spec = FaultSpec(
            kind=FaultKind(match.group(1)),
            rank=ANY if fields["rank"] == "any" else int(fields["rank"]),
            at_s=float(fields["at"]) if "at" in fields else None,
            step=int(fields["step"]) if "step" in fields else None,
            recovery=int(fields["recovery"]) if "recovery" in fields else None,
            phase=fields.get("phase"),
            after_ms=float(fields.get("after_ms", "0")),
            code=int(fields.get("code", "1")),
            attempt=ANY if fields.get("attempt") == "any" else int(fields.get("attempt", "0")),
            factor=float(fields.get("factor", "1")),
            for_s=float(fields["for"]) if "for" in fields else None,
        )
    except ValueError:
        raise ValueError(
            f"rank and attempt (or any), step, recovery and code must be integers, at, "
            f"after_ms, factor and for numbers, in {text!r}"
        ) from None
    if slow and not (spec.factor > 1 and (spec.for_s is None or spec.for_s > 0)):
        raise ValueError(f"factor must be above 1 and for above 0, in {text!r}")
    if (
        spec.rank < ANY
        or (spec.at_s is not None and spec.at_s < 0)
        or (spec.step is not None and spec.step < 0)
        or (spec.recovery is not None and spec.recovery < 1)
        or spec.after_ms < 0
    ):
        raise ValueError(
            f"rank, at, step and after_ms must not be negative, recovery >= 1, in {text!r}"
        )
    return spec


@dataclass
class FaultLedger:
    """What an agent's rounds share of fault injection: the faults that fired (id() of
    each spec: one of any attempt fires once in the run), and the most in-place
    recoveries each attempt reached (a phase fault of any attempt counts recoveries over
    the whole run: ``recovery=12`` is the run's twelfth, whatever restarts came between)."""

    fired: set[int] = field(default_factory=set)
    recoveries: dict[int, int] = field(default_factory=dict)
    # the faults this node's rounds watched for (its ranks'; rank=any on the first node
    # only, where the rank is drawn once): those not fired are told at the end
    watched: set[int] = field(default_factory=set)

    def recoveries_before(self, attempt: int) -> int:
        return sum(n for a, n in self.recoveries.items() if a < attempt)


def unreported(faults: Sequence[FaultSpec], imports: Sequence[str]) -> list[FaultSpec]:
    """The faults that wait for what only a worker that reports can tell (a step, a
    recovery's phase, a working rank for ``rank=any``), given the script's top-level
    imports (launcher.preload): a script that does not import chameleon_runtime may
    never report one, and the fault would then never fire."""
    if any(package_of(name) == "chameleon_runtime" for name in imports):
        return []
    return [f for f in faults if f.at_s is None or f.rank == ANY]


class Injector:
    """Which of a node's faults are due now. A phase fault is armed when its phase is
    first seen and fires ``after_ms`` later, whatever the phase is by then."""

    def __init__(
        self,
        faults: list[FaultSpec],
        ranks: list[int],
        ledger: FaultLedger | None = None,
        attempt: int = 0,
    ) -> None:
        self.pending = list(faults)
        self.ranks = ranks  # this node's
        self.ledger = ledger if ledger is not None else FaultLedger()
        self.attempt = attempt
        self._armed: dict[int, tuple[float, int]] = {}  # id(spec) -> when armed, on which rank
        self._rng = random.Random(0)  # rank=any picks: seeded, so a run repeats

    def due(
        self,
        now: float,
        *,
        since_start_s: float,
        status: dict[int, WorkerStatus],
        phase: RecoveryPhase | None,
        alive: set[int] | None = None,
    ) -> list[FaultSpec]:
        """The faults due now, each with its rank resolved (``any`` becomes a rank)."""
        due = []
        # A spare's step stands still; a fault at step N of a rank the plan left spare
        # fires when the job (its node's working ranks) passes N, as a user would expect.
        job_step = max((s.step for s in status.values() if s.phase in _WORKING), default=None)
        reached = self.ledger.recoveries
        if phase is not None and phase.recovery > reached.get(self.attempt, 0):
            reached[self.attempt] = phase.recovery
        before = self.ledger.recoveries_before(self.attempt)
        for spec in list(self.pending):
            candidates = (
                [spec.rank]
                if spec.rank != ANY
                else [
                    r
                    for r in self.ranks
                    if (alive is None or r in alive)
                    and (s := status.get(r)) is not None
                    and s.phase in _WORKING
                ]
            )
            if id(spec) not in self._armed:
                offset = before if spec.attempt == ANY else 0
                hits = [
                    r
                    for r in candidates
                    if self._hit(spec, since_start_s, status.get(r), phase, job_step, offset)
                ]
                if not hits:
                    continue
                self._armed[id(spec)] = (now, self._rng.choice(hits))
            armed_at, rank = self._armed[id(spec)]
            if now - armed_at >= spec.after_ms / 1e3:
                self.pending.remove(spec)
                del self._armed[id(spec)]
                self.ledger.fired.add(id(spec))
                due.append(replace(spec, rank=rank))
        return due

    @staticmethod
    def _hit(
        spec: FaultSpec,
        since_start_s: float,
        status: WorkerStatus | None,
        phase: RecoveryPhase | None,
        job_step: int | None = None,
        recoveries_before: int = 0,
    ) -> bool:
        if spec.at_s is not None:
            hit = since_start_s >= spec.at_s
        elif spec.step is not None:
            spare = status is not None and status.phase == "spare" and job_step is not None
            step = job_step if spare else status.step if status is not None else None
            hit = step is not None and step > spec.step
        else:
            hit = phase is not None and recoveries_before + phase.recovery == (spec.recovery or 1)
            if spec.phase in _WORKER_PHASES:
                hit = hit and phase.phase == "confirm" and status is not None
                # A rank lost before its group is built fails the group building, as one
                # lost while building it (which lasts milliseconds here) does.
                hit = hit and status.phase in _BEFORE[spec.phase]
            elif spec.phase is not None:
                hit = hit and phase.phase == spec.phase
            else:
                hit = hit and phase.phase != "running"
        return hit

    def failpoints(self) -> list[str]:
        """The worker phases a pending fault waits for: the workers pause on entering
        them until it has fired (chameleon_runtime.control.Control.failpoint)."""
        phases = {f.phase for f in self.pending if f.phase in _WORKER_PHASES}
        # A step fault of a named rank waits for it at that step's end; one of any rank
        # (a rank drawn when it fires) or after a delay does not.
        steps = {
            Keys.step_failpoint(f.rank, f.step)
            for f in self.pending
            if f.step is not None and f.rank != ANY and not f.after_ms
        }
        return sorted(phases | steps)

    def watches_status(self) -> bool:
        """Whether a pending fault needs the workers' statuses read."""
        return any(
            f.step is not None or f.phase in _WORKER_PHASES or f.rank == ANY for f in self.pending
        )
