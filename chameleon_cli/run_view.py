"""How a finished run looks: result, failures (earliest first: the root cause) and the
recovery timeline, as blocks for the output layer."""

from __future__ import annotations

from pydantic import BaseModel

from chameleon_cli.output import Block, Fields, Table
from chameleon_cli.units import fmt_s
from launcher.events import Record
from launcher.supervisor import Failure, describe, root_cause
from launcher.timeline import recoveries, slowdowns, start_time


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


def _in_order(failures: list[Failure]) -> list[Failure]:
    """As they happened: when each failed, then when it was seen, then by rank."""
    return sorted(failures, key=lambda f: (f.failed_at, f.detected_at, f.rank))


def failures_table(failures: list[Failure], t0: float | None) -> Table:
    cause = root_cause(failures)
    rows = []
    for f in _in_order(failures):
        rows.append(
            [
                ("* " if f is cause else "") + str(f.rank),
                str(f.node),
                str(f.attempt),
                _rel(f.failed_at, t0),
                describe(f),
                f.cause.value,
                (f.message or "-")[:90],
                f.where or "-",
                f.log_file or "-",
            ]
        )
    return Table(
        "Failures (* = root cause: the earliest)",
        ["rank", "node", "attempt", "at", "what", "cause", "message", "where", "log"],
        rows,
    )


def plans_table(events: list[Record]) -> Table | None:
    """Every plan the planner chose during the run, with the alternatives it weighed."""
    rows = []
    for e in events:
        if e["event"] == "launch_planned":  # the layout the planner started on ("auto")
            rows.append(
                [
                    "0",
                    "-",
                    "launch",
                    f"{e.get('layout', '-')}"
                    + (f", {e['spares']} spare(s)" if e.get("spares") else ""),
                    fmt_s(e.get("estimated_step_s")),
                    "-",
                    f"{1e3 * e.get('search_s', 0):.1f} ms",
                    "-",
                ]
            )
            continue
        if e["event"] != "plan_chosen":
            continue
        c = e.get("candidates", {})

        def score(policy: str, c: dict = c) -> str:
            if not c:  # a healthy job's move (slow workers): no failure's candidates
                return "-"
            x = c.get(policy, {})
            return f"{x['score']:.1f}" if x.get("score") is not None else "infeasible"

        estimated, base = e.get("estimated_step_s"), e.get("failure_free_step_s")
        rows.append(
            [
                str(e.get("generation", "-")),
                ",".join(map(str, e.get("failed", [])))
                or " ".join(f"+{r}" for r in e.get("joined", []))
                or ("calibrated" if e.get("rebalance") else "")
                or (" ".join(f"slow {r}" for r in e["slow"]) if e.get("slow") else "")
                or ("back to speed" if e.get("slow") == {} else ""),
                e["policy"],
                e.get("label", "-") or "-",
                fmt_s(estimated)
                + (
                    f" (throughput {base / estimated:.0%} of failure-free)"
                    if estimated and base
                    else ""
                ),
                fmt_s(e.get("transition_s")),
                f"{e.get('search_ms', 0):.1f} ms",
                f"{score('reroute')} / {score('reparallelize')} / {score('restart')}",
            ]
        )
    if not rows:
        return None
    return Table(
        "Plans chosen (scores: expected samples/s until the next failure; +R: rank R rejoined)",
        [
            "gen",
            "failed",
            "policy",
            "plan",
            "est. step",
            "transition",
            "search",
            "reroute / reparallelize / restart",
        ],
        rows,
    )


def replacements_table(events: list[Record]) -> Table | None:
    """Failed ranks started again while the job trained (launcher/rejoin.py)."""
    t0 = start_time(events)
    rows = []
    for e in events:
        if e["event"] != "worker_respawned":
            continue
        rank = e["rank"]
        later = [x for x in events if x["t"] >= e["t"] and rank in x.get("ranks", ())]
        joined = next((x for x in later if x["event"] == "rejoined"), None)
        plan = next(
            (
                x
                for x in events
                if x["event"] == "plan_chosen" and x["t"] >= e["t"] and rank in x.get("joined", ())
            ),
            None,
        )
        if joined is None:
            outcome = "did not join before the end"
        elif joined.get("taken_in"):
            outcome = f"taken in: {plan['label'] if plan else 're-partitioned'}"
        else:
            outcome = "spare (no faster layout with it)"
        rows.append(
            [
                str(rank),
                _rel(e["t"], t0),
                _rel(joined["t"], t0) if joined else "-",
                outcome,
            ]
        )
    if not rows:
        return None
    return Table("Replacements", ["rank", "started", "joined", "outcome"], rows)


def stragglers_table(events: list[Record]) -> Table | None:
    """Workers found slower than their peers: when, by how much, and when they were back
    to their peers' speed."""
    t0 = start_time(events)
    rows = [
        [
            str(r.rank),
            _rel(r.found_at, t0),
            "-" if r.step is None else str(r.step),
            f"{r.factor:.2f}x",
            "-" if r.worst is None else f"{r.worst:.2f}x",
            _rel(r.back_at, t0),
            "-" if r.back_step is None else str(r.back_step),
        ]
        for r in slowdowns(events)
    ]
    if not rows:
        return None
    return Table(
        "Stragglers (x: its passes' time per micro-batch over its peers' median)",
        ["rank", "found", "at step", "slower", "worst", "back", "at step"],
        rows,
    )


def faults_not_fired(events: list[Record]) -> list[str]:
    """The --inject-fault faults this node watched for and never fired."""
    return [f for e in events if e["event"] == "faults_not_fired" for f in e["faults"]]


class RunOutcome(BaseModel):
    """``chameleon run --json``: how the run ended, on stdout."""

    exit_code: int
    reason: str
    logs: str
    events: str
    failures: list[dict]
    faults_not_fired: list[str]
    recovered_in_place: int


def outcome_model(
    *, exit_code: int, reason: str, failures: list[Failure], events: list[Record],
    run_dir: str, events_path: str,
) -> RunOutcome:  # fmt: skip
    return RunOutcome(
        exit_code=exit_code,
        reason=reason,
        logs=run_dir,
        events=events_path,
        failures=[
            {
                "rank": f.rank,
                "node": f.node,
                "attempt": f.attempt,
                "what": describe(f),
                "cause": f.cause.value,
                "message": f.message,
                "exit_code": f.exit_code,
            }  # fmt: skip
            for f in _in_order(failures)
        ],
        faults_not_fired=faults_not_fired(events),
        recovered_in_place=sum(1 for e in events if e["event"] == "recovered"),
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
    plans = plans_table(events)
    if plans is not None:
        blocks.append(plans)
    if recoveries(events):
        blocks.append(timeline_table(events))
    replaced = replacements_table(events)
    if replaced is not None:
        blocks.append(replaced)
    slow = stragglers_table(events)
    if slow is not None:
        blocks.append(slow)
    never = faults_not_fired(events)
    if never:
        blocks.append(
            Table(
                "Faults asked for that never fired (--inject-fault)",
                ["fault"],
                [[f] for f in never],
            )
        )
    hint = next((e for e in events if e["event"] == "layout_hint"), None)
    if hint is not None:
        blocks.append(
            Fields(
                "Note",
                [
                    (
                        "faster layout",
                        f"the planner estimates {hint['label']} at {fmt_s(hint['best_step_s'])} "
                        f"a step, {hint['launched_step_s'] / hint['best_step_s']:.2f}x the "
                        f"launched layout ({fmt_s(hint['launched_step_s'])}); a recovery may "
                        "switch to such a layout, so steps can get faster after a failure",
                    )
                ],
            )
        )
    return blocks
