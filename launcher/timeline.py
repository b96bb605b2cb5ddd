"""Recoveries, reconstructed from the event log: when each failure happened, how long
detection, planning and recovery took, when the first good step came, and how many steps
were lost. Pure: events in, rows out; the end-of-run summary and ``chameleon timeline``
both render these rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from launcher.events import Record


@dataclass(frozen=True)
class Recovery:
    attempt: int  # the attempt (round or plan generation) the failure hit
    rank: int | None  # root cause
    kind: str
    failed_at: float
    detected_at: float
    decided_at: float | None
    policy: str | None
    recovered_at: float | None  # workers running again (restart) or the new plan applied
    first_step_at: float | None  # the first step completed after recovery
    steps_lost: int | None
    outcome: str  # "recovered", "gave up", "in progress"

    @property
    def detection_s(self) -> float:
        return self.detected_at - self.failed_at

    @property
    def planning_s(self) -> float | None:
        return None if self.decided_at is None else self.decided_at - self.detected_at

    @property
    def recovery_s(self) -> float | None:
        if self.recovered_at is None or self.decided_at is None:
            return None
        return self.recovered_at - self.decided_at

    @property
    def to_first_step_s(self) -> float | None:
        return None if self.first_step_at is None else self.first_step_at - self.failed_at


def recoveries(events: Iterable[Record]) -> list[Recovery]:
    events = sorted(events, key=lambda e: e["t"])
    out: list[Recovery] = []
    previous: dict[int, float] = {}  # attempt -> time of its last decision
    for i, decision in enumerate(events):
        if decision["event"] != "decision" or (
            decision.get("action") == "finish" and not decision.get("exit_code")
        ):
            continue
        attempt = decision.get("attempt", 0)
        since = previous.get(attempt, float("-inf"))
        previous[attempt] = decision["t"]
        # The failures this decision answered: those of its attempt detected since the
        # attempt's previous decision (in-place recoveries share an attempt). A restart or
        # a final decision also owns the attempt's later failures: a lost node is often
        # noticed only when its peers have crashed, or when it fails to rejoin.
        closing = decision.get("action") in ("restart", "finish")
        failures = [
            e
            for e in events
            if e["event"] == "failure"
            and e.get("attempt") == attempt
            and e["detected_at"] > since
            and (e["detected_at"] <= decision["t"] or closing)
        ]
        if not failures:
            continue
        root = min(failures, key=lambda f: (f["failed_at"], f["detected_at"], f["rank"]))
        later = events[i + 1 :]
        recovered = next((e for e in later if e["event"] == "recovered"), None)
        first_step = None
        if recovered is not None:
            first_step = next(
                (e for e in later if e["event"] == "step" and e["t"] >= recovered["t"]), None
            )
        # Steps lost: the last step reached before the failure against the step work
        # resumed at (in-place recoveries report it; a restart's workers report where their
        # checkpoint put them). Reached: measured from the survivors' reports when an
        # in-place recovery fell back to the restart, else the aborts and step events.
        reached = [
            e.get("last_step")
            for e in events[:i]
            if e["event"] == "abort" and e.get("attempt") == attempt
        ]
        reached += [e.get("step") for e in events[:i] if e["event"] == "step"]
        reached += [
            e["reached_step"] - 1
            for e in events[:i]
            if e["event"] == "abandoned" and e.get("attempt") == attempt
        ]
        step_before = max((s for s in reached if s is not None and s >= 0), default=None)
        resumed = next(
            (
                e
                for e in later
                if e["event"] in ("resumed", "recovered") and e.get("resume_step") is not None
            ),
            None,
        )
        steps_lost = None
        if recovered is not None and recovered.get("steps_lost") is not None:
            steps_lost = recovered["steps_lost"]
        elif resumed is not None and step_before is not None:
            steps_lost = max(0, step_before + 1 - resumed["resume_step"])
        action = decision.get("action")
        outcome = "gave up" if action == "finish" else "recovered" if recovered else "in progress"
        out.append(
            Recovery(
                attempt=attempt,
                rank=root.get("rank"),
                kind=root.get("kind", "?"),
                failed_at=root["failed_at"],
                detected_at=min(f["detected_at"] for f in failures),
                decided_at=decision["t"],
                policy=decision.get("policy"),
                recovered_at=recovered["t"] if recovered else None,
                first_step_at=first_step["t"] if first_step else None,
                steps_lost=steps_lost,
                outcome=outcome,
            )
        )
    return out


def start_time(events: Iterable[Record]) -> float | None:
    return next((e["t"] for e in events if e["event"] == "start"), None)


@dataclass(frozen=True)
class Slowdown:
    """A worker found slower than its peers (launcher/stragglers.py), and when it was
    back to their speed (None: not before the end)."""

    rank: int
    found_at: float
    step: int | None
    factor: float  # its passes' time per micro-batch over its peers' median, when found
    back_at: float | None
    back_step: int | None
    worst: float | None = None  # the largest such factor while it was slow (once back)


def slowdowns(events: list[Record]) -> list[Slowdown]:
    rows = []
    for i, e in enumerate(events):
        if e["event"] != "straggler":
            continue
        back = next(
            (
                x
                for x in events[i + 1 :]
                if x["event"] == "straggler_recovered" and x.get("rank") == e["rank"]
            ),
            None,
        )
        rows.append(
            Slowdown(
                rank=e["rank"],
                found_at=e["t"],
                step=e.get("step"),
                factor=e["factor"],
                back_at=back["t"] if back else None,
                back_step=back.get("step") if back else None,
                worst=back.get("worst_factor") if back else None,
            )
        )
    return rows
