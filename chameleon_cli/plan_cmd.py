"""``chameleon plan --dry-run``: what the planner would do for a set of failures."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Literal

import typer

from chameleon_cli.errors import UserError
from chameleon_cli.output import Output, choose_mode
from chameleon_cli.units import duration_flag, parse_int_list

# The planner (networkx, pydantic) is imported when the command runs, not when the CLI
# starts: `chameleon run` should not pay for it before its workers are up.
PolicyName = Literal["reroute", "reparallelize", "restart"]


def _ranks(values: list[str]) -> list[int]:
    try:
        return sorted({r for v in values for r in parse_int_list(v)})
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--fail") from None


def plan(
    config: Annotated[
        Path,
        typer.Option("--config", "-c", help="Job config (TOML), e.g. configs/cpu_testbed.toml."),
    ],
    fail: Annotated[
        list[str] | None, typer.Option("--fail", help="Ranks that fail: 3, 3,5 or 0-3. Repeatable.")
    ] = None,
    fail_node: Annotated[
        list[int] | None,
        typer.Option("--fail-node", min=0, help="A node that fails whole. Repeatable."),
    ] = None,
    policy: Annotated[
        PolicyName | None,
        typer.Option("--policy", help="Force a policy instead of the best score."),
    ] = None,
    mtbf: Annotated[
        str | None,
        typer.Option(
            "--mtbf",
            help="Mean time to the next failure D: 900s, 30m, 3h. Default: the config's "
            "mtbf_hours, else its device_mtbf_hours over the surviving devices.",
        ),
    ] = None,
    since_checkpoint: Annotated[
        str | None,
        typer.Option(
            "--since-checkpoint",
            help="Work a restart would redo. Default: half the checkpoint interval.",
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Required: plan without touching any job (live plans are made inside chameleon run).",
        ),
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    plain: Annotated[bool, typer.Option("--plain", help="Plain text even on a terminal.")] = False,
) -> None:
    """Show every recovery candidate for a failure and the one the planner picks."""
    from chameleon_cli.plan_view import decision_blocks
    from planner.choice.policy import Policy
    from planner.choice.report import report
    from planner.choice.selection import decide
    from planner.config import load_job
    from planner.plans.layout import failed_workers, initial_plan
    from planner.search.layouts import Search

    if not dry_run:
        raise typer.BadParameter(
            "chameleon plan only simulates; add --dry-run", param_hint="--dry-run"
        )
    mtbf_s = duration_flag(mtbf, "--mtbf")
    since_s = duration_flag(since_checkpoint, "--since-checkpoint")
    ranks = _ranks(fail or [])
    job = load_job(config)
    if not fail and not fail_node:
        # candidates are recoveries: without a failure there is nothing to recover from
        raise typer.BadParameter(
            "name the failure to plan for: --fail RANKS or --fail-node NODE",
            param_hint="--fail",
        )
    current = initial_plan(job)
    lost = failed_workers(job, ranks=ranks, nodes=fail_node or [])
    all_ranks = sorted({r for w in lost for r in job.ranks_of(w)})

    # Templates and the shape ranking depend on the job (and the survivor count) only:
    # the launcher prepares them at start, before any failure, so they are timed apart
    # from the search a failure pays for.
    t0 = time.perf_counter()
    search = Search(job).warm_up(failures=len(lost))
    templates_s = time.perf_counter() - t0
    forced = Policy(policy) if policy else None
    decision = decide(
        job, current, lost, policy=forced, mtbf_s=mtbf_s, since_checkpoint_s=since_s, search=search
    )
    out = report(job, decision, failed_ranks=all_ranks, templates_s=templates_s)
    Output(choose_mode(json=json_out, plain=plain)).show(
        decision_blocks(out, cluster=job.cluster.name, model=job.model.name), out
    )
    if decision.chosen is None:
        if forced is not None:
            candidate = next(c for c in decision.candidates if c.policy is forced)
            raise UserError(f"--policy {forced.value} is infeasible: {candidate.reason}")
        reasons = "; ".join(f"{c.policy.value}: {c.reason}" for c in decision.candidates)
        raise UserError(f"no feasible recovery: {reasons}")
