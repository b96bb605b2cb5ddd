"""How a finished run looks: result, failures (earliest first: the root cause) and the
recovery timeline, as blocks for the output layer."""

from __future__ import annotations

from chameleon_cli.output import Block, Fields, Table
from chameleon_cli.units import fmt_s
from launcher.events import Record
from launcher.supervisor import Failure, describe, root_cause
from launcher.timeline import recoveries, start_time


def _rel(t: float | None, t0: float | None) -> str:
    return "-" if t is None or t0 is None else f"+{t - t0:.2f} s"


def timeline_table(events: list[Record]) -> Table:
    t0 = start_time(events)
    rows = []
    for r in recoveries(events):
        rows.append(
            [
                str(r.attempt),
                _rel(r.failed_at, t0),
                f"rank {r.rank} ({r.kind})",
                fmt_s(r.detection_s),
                r.policy or "-",
                fmt_s(r.planning_s),
                fmt_s(r.recovery_s),
                fmt_s(r.to_first_step_s),
                "-" if r.steps_lost is None else str(r.steps_lost),
                r.outcome,
            ]
        )
    return Table(
        "Recovery timeline (times from the failure; first good step counted from the failure)",
        [
            "attempt",
            "failure",
            "root cause",
            "detected in",
            "policy",
            "planning",
            "recovery",
            "first good step",
            "steps lost",
            "outcome",
        ],
        rows,
    )


def failures_table(failures: list[Failure], t0: float | None) -> Table:
    cause = root_cause(failures)
    rows = []
    for f in sorted(failures, key=lambda f: (f.failed_at, f.detected_at, f.rank)):
        rows.append(
            [
                ("* " if f is cause else "") + str(f.rank),
                str(f.node),
                str(f.attempt),
                _rel(f.failed_at, t0),
                describe(f),
                f.cause.value,
                (f.message or "-")[:90],
                f.log_file or "-",
            ]
        )
    return Table(
        "Failures (* = root cause: the earliest)",
        ["rank", "node", "attempt", "at", "what", "cause", "message", "log"],
        rows,
        highlight=frozenset({0}) if rows else frozenset(),
    )


def outcome_blocks(
    *,
    exit_code: int,
    reason: str,
    failures: list[Failure],
    events: list[Record],
    run_dir: str,
    events_path: str,
) -> list[Block]:
    blocks: list[Block] = [
        Fields(
            "Run finished",
            [
                ("exit code", str(exit_code)),
                ("reason", reason),
                ("logs", run_dir),
                ("events", events_path),
            ],
        )
    ]
    if failures:
        blocks.append(failures_table(failures, start_time(events)))
    if recoveries(events):
        blocks.append(timeline_table(events))
    return blocks
