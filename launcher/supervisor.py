"""What the job does next: a pure function of what the leader agent knows.

``decide(view)`` looks at one round (attempt) of the job — its failures, finished and lost
nodes, nodes waiting to join, a stop request — and returns continue, restart or finish,
with the reason. The agent (``launcher.agent``) gathers the view and carries the decision
out; tests drive this directly.

For a plain script the options are those of torchrun, made elastic: restart every worker
(its own checkpoint logic resumes it), shrink to the surviving nodes within --nnodes
MIN:MAX, admit waiting nodes up to MAX (not counted as a restart), or give up after
--max-restarts. The job's exit code is its root cause's (the earliest failure's) when it
had no restart budget, and GAVE_UP (93, "do not requeue") when it spent one or the same
failure ended several attempts in a row (launcher/exitcodes.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from launcher.exitcodes import GAVE_UP, JOB_FAILED, REQUEUE

# The same failure ending this many attempts in a row is a loop: the job gives up.
LOOP_ATTEMPTS = 3


class FailureKind(StrEnum):
    EXIT = "exit"  # non-zero exit code
    SIGNAL = "signal"  # killed by a signal
    HANG = "hang"  # stopped making progress; killed by us
    NODE_LOST = "node_lost"  # its agent stopped heartbeating
    UNHEALTHY = "unhealthy"  # not replaced: its node failed --health-check (launcher/health.py)


class Cause(StrEnum):
    """Who is to blame, for the summary (STYLE.md habit 8)."""

    USER_CODE = "user code"  # an exception or non-zero exit in the script
    HARDWARE = "hardware or OS"  # killed by a signal (OOM killer, kill -9, a crashed device)
    INFRASTRUCTURE = "infrastructure"  # a lost node, a hang in a collective


@dataclass(frozen=True)
class Failure:
    rank: int
    node: int
    kind: FailureKind
    attempt: int
    failed_at: float  # best known time of the failure itself (wall clock)
    detected_at: float
    exit_code: int | None = None  # the process's own code, negative for a signal
    message: str = ""
    log_file: str | None = None
    where: str | None = None  # the script's file and line that raised (launcher/rootcause.py)
    peer_error: bool = False  # the backend reporting a broken peer, not this rank's code

    @property
    def cause(self) -> Cause:
        if self.kind is FailureKind.EXIT:
            return Cause.INFRASTRUCTURE if self.peer_error else Cause.USER_CODE
        if self.kind in (FailureKind.SIGNAL, FailureKind.UNHEALTHY):
            return Cause.HARDWARE
        return Cause.INFRASTRUCTURE

    @property
    def signature(self) -> str | None:
        """What makes two attempts' failures the same bug: the script raising the same
        error from the same place. None for anything else: a kill, a hang, a lost node or
        a device error may recur on these nodes and not on the next allocation's."""
        if not self.script_error:
            return None
        return f"exit {self.exit_code}: {self.message} at {self.where}"

    @property
    def script_error(self) -> bool:
        """The script raised (a traceback from its own code, not the backend reporting a
        broken peer): an error of the job, which recovering in place would only meet
        again on the member that takes over the work."""
        return self.cause is Cause.USER_CODE and self.where is not None

    @property
    def job_exit_code(self) -> int:
        """The code the job exits with when this is its root cause (a worker's own 75 or
        93 would read as the launcher's "requeue" or "give up": 1 instead)."""
        if self.exit_code in (REQUEUE, GAVE_UP):
            return 1
        if self.exit_code is not None and self.exit_code > 0:
            return self.exit_code
        if self.exit_code is not None and self.exit_code < 0:
            return 128 - self.exit_code
        return JOB_FAILED

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "node": self.node,
            "kind": self.kind.value,
            "attempt": self.attempt,
            "failed_at": self.failed_at,
            "detected_at": self.detected_at,
            "exit_code": self.exit_code,
            "message": self.message,
            "log_file": self.log_file,
            "where": self.where,
            "peer_error": self.peer_error,
        }

    @classmethod
    def from_json(cls, data: dict) -> Failure:
        return cls(**{**data, "kind": FailureKind(data["kind"])})


def root_cause(failures: list[Failure] | tuple[Failure, ...]) -> Failure | None:
    """The earliest failure: later ones are usually its consequences (peers whose
    collectives broke when it died)."""
    return min(failures, key=lambda f: (f.failed_at, f.detected_at, f.rank), default=None)


class Action(StrEnum):
    CONTINUE = "continue"
    RESTART = "restart"
    FINISH = "finish"


@dataclass(frozen=True)
class RoundView:
    attempt: int
    restarts_used: int
    max_restarts: int
    min_nodes: int
    max_nodes: int
    nodes: int  # in this round
    nodes_lost: int = 0
    nodes_done: int = 0
    nodes_waiting: int = 0
    failures: tuple[Failure, ...] = ()
    stop_signal: int | None = None  # a signal the leader received
    # The root causes of the attempts before this one (``Failure.signature``), in order.
    earlier_causes: tuple[str | None, ...] = ()
    preempted: str | None = None  # a preemption notice a node got (its signal's name)
    preempt_overdue: bool = False  # ... and its grace period is over


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    exit_code: int = 0
    counts_as_restart: bool = False
    next_nodes: int | None = field(default=None)  # nodes expected in the next round


def decide(view: RoundView) -> Decision:
    if view.stop_signal is not None:
        return Decision(
            Action.FINISH, f"stopped by signal {view.stop_signal}", exit_code=128 + view.stop_signal
        )
    if view.preempted is not None:
        # The workers save and stop; a failure meanwhile is no reason to restart: the job
        # is leaving anyway, and its requeue resumes from what was saved.
        finished = view.nodes_done and view.nodes_done == view.nodes - view.nodes_lost
        if finished or view.preempt_overdue or view.failures:
            how = (
                "the workers stopped"
                if finished
                else "stopped at the end of the grace period"
                if view.preempt_overdue
                # (the earliest failure, named as everywhere, may predate the notice: a
                # recovery in progress when it came, cut short by a second failure)
                else "the save did not finish on every node; the first failure: "
                f"{summary(root_cause(view.failures))}"  # type: ignore[arg-type]
            )
            return Decision(
                Action.FINISH, f"preempted ({view.preempted}): {how}", exit_code=REQUEUE
            )
        return Decision(Action.CONTINUE, "saving for a preemption")
    if view.failures:
        cause = root_cause(view.failures)
        assert cause is not None
        survivors = view.nodes - view.nodes_lost + view.nodes_waiting
        what = summary(cause)
        if view.restarts_used >= view.max_restarts:
            return Decision(
                Action.FINISH,
                f"{what}; no restarts left (--max-restarts {view.max_restarts})",
                exit_code=GAVE_UP if view.max_restarts else cause.job_exit_code,
            )
        last = view.earlier_causes[-(LOOP_ATTEMPTS - 1) :]
        if cause.signature is not None and last == (cause.signature,) * (LOOP_ATTEMPTS - 1):
            return Decision(
                Action.FINISH,
                f"{what}; the same failure ended the last {LOOP_ATTEMPTS} attempts: a "
                "restart will not help",
                exit_code=GAVE_UP,
            )
        if survivors < view.min_nodes:
            return Decision(
                Action.FINISH,
                f"{what}; {survivors} node(s) left, fewer than --nnodes minimum {view.min_nodes}",
                exit_code=cause.job_exit_code,
            )
        next_nodes = min(survivors, view.max_nodes)
        how = "shrink to" if next_nodes < view.nodes else "restart on"
        return Decision(
            Action.RESTART,
            f"{what}; {how} {next_nodes} node(s) (restart {view.restarts_used + 1} of {view.max_restarts})",
            counts_as_restart=True,
            next_nodes=next_nodes,
        )
    # Nodes lost and recovered from in place are not waited for: they will not finish.
    if view.nodes_done and view.nodes_done == view.nodes - view.nodes_lost:
        return Decision(Action.FINISH, "all workers finished", exit_code=0)
    if view.nodes_waiting and view.nodes < view.max_nodes:
        grown = min(view.nodes + view.nodes_waiting, view.max_nodes)
        return Decision(
            Action.RESTART,
            f"{view.nodes_waiting} node(s) waiting: grow to {grown}",
            next_nodes=grown,
        )
    return Decision(Action.CONTINUE, "running")


def summary(f: Failure) -> str:
    return f"rank {f.rank} {describe(f)}"


def describe(f: Failure) -> str:
    if f.kind is FailureKind.EXIT:
        return f"exited with code {f.exit_code}"
    if f.kind is FailureKind.SIGNAL:
        return f"was killed by signal {-(f.exit_code or 0)}"
    if f.kind is FailureKind.HANG:
        return f"hung ({f.message})" if f.message else "hung"
    if f.kind is FailureKind.UNHEALTHY:
        return "was not replaced: its node failed --health-check"
    return "was lost with its node"
