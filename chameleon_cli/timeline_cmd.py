"""``chameleon timeline EVENTS``: the recovery timeline of a run, from its event log."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from pydantic import BaseModel

from chameleon_cli.errors import UserError
from chameleon_cli.output import Fields, Output, choose_mode
from chameleon_cli.run_view import stragglers_table, timeline_table
from launcher.events import read_events
from launcher.timeline import recoveries, slowdowns


class RecoveryOut(BaseModel):
    attempt: int
    rank: int | None
    kind: str
    policy: str | None
    failed_at: float
    detection_s: float
    planning_s: float | None
    recovery_s: float | None
    to_first_step_s: float | None
    steps_lost: int | None
    outcome: str


class SlowdownOut(BaseModel):
    rank: int
    found_at: float
    step: int | None
    factor: float
    back_at: float | None
    back_step: int | None
    worst: float | None = None


class TimelineOut(BaseModel):
    events: int
    exit_code: int | None
    recoveries: list[RecoveryOut]
    stragglers: list[SlowdownOut] = []


def timeline(
    events_path: Annotated[
        Path, typer.Argument(metavar="EVENTS", help="An events.jsonl written by chameleon run.")
    ],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    plain: Annotated[bool, typer.Option("--plain", help="Plain text even on a terminal.")] = False,
) -> None:
    """Show the recovery timeline of a run from its event log, and its stragglers."""
    if events_path.is_dir():
        raise UserError(f"event log is a directory, not a file: {events_path}")
    if not events_path.is_file():
        raise UserError(f"event log not found: {events_path}")
    try:
        records = read_events(events_path)
    except UnicodeDecodeError:
        raise UserError(f"{events_path} is not an event log (not text)") from None
    except ValueError as exc:
        raise UserError(str(exc)) from None
    rows = recoveries(records)
    exit_event = next((e for e in reversed(records) if e["event"] == "exit"), None)
    model = TimelineOut(
        events=len(records),
        exit_code=exit_event.get("exit_code") if exit_event else None,
        recoveries=[
            RecoveryOut(
                attempt=r.attempt,
                rank=r.rank,
                kind=r.kind,
                policy=r.policy,
                failed_at=r.failed_at,
                detection_s=r.detection_s,
                planning_s=r.planning_s,
                recovery_s=r.recovery_s,
                to_first_step_s=r.to_first_step_s,
                steps_lost=r.steps_lost,
                outcome=r.outcome,
            )
            for r in rows
        ],
        stragglers=[SlowdownOut(**vars(r)) for r in slowdowns(records)],
    )
    summary = Fields(
        f"Run {events_path}",
        [
            ("events", str(len(records))),
            ("recoveries", str(len(rows))),
            (
                "exit code",
                "running or killed" if exit_event is None else str(exit_event.get("exit_code")),
            ),
        ],
    )
    blocks = [summary, timeline_table(records)]
    slow = stragglers_table(records)
    if slow is not None:
        blocks.append(slow)
    Output(choose_mode(json=json_out, plain=plain)).show(blocks, model)
