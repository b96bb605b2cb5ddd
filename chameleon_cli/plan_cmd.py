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


def _slow(values: list[str]) -> dict[int, float]:
    """``RANK=FACTOR`` flags: each rank's slowdown (3 = a third of its speed)."""
    out: dict[int, float] = {}
    for value in values:
        rank, sep, factor = value.partition("=")
        try:
            r, f = int(rank), float(factor)
        except ValueError:
            r, f = -1, 0.0
        if not sep or r < 0 or not f > 1.0 or f != f or f == float("inf"):
            raise typer.BadParameter(
                f"{value!r}: expected RANK=FACTOR, a rank and how many times slower it "
                "runs (a number over 1), e.g. 3=2.5",
                param_hint="--slow",
            )
        out[r] = f
    return out


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
    slow: Annotated[
        list[str] | None,
        typer.Option(
            "--slow",
            help="Plan for a slow rank instead of a failure: RANK=FACTOR (3=2.5: rank 3 "
            "takes 2.5x as long). Repeatable.",
        ),
    ] = None,
    slow_for: Annotated[
        str | None,
        typer.Option(
            "--slow-for",
            help="How long the slowdown is expected to last (with --slow): 90s, 10m. Default 10m.",
        ),
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
    """Show every recovery candidate for a failure (or every option for a slow rank) and
    the one the planner picks."""
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
    slowed = _slow(slow or [])
    horizon_s = duration_flag(slow_for, "--slow-for")
    if slowed and (fail or fail_node):
        raise typer.BadParameter(
            "plan for a failure or for a slowdown, not both", param_hint="--slow"
        )
    if horizon_s is not None and not slowed:
        raise typer.BadParameter("--slow-for needs --slow RANK=FACTOR", param_hint="--slow-for")
    job = load_job(config)
    if slowed:
        _plan_slow(job, slowed, horizon_s or DEFAULT_SLOW_FOR_S, json_out=json_out, plain=plain)
        return
    if not fail and not fail_node:
        # candidates are recoveries: without a failure there is nothing to recover from
        raise typer.BadParameter(
            "name the failure to plan for: --fail RANKS or --fail-node NODE "
            "(or a slow rank: --slow RANK=FACTOR)",
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


DEFAULT_SLOW_FOR_S = 600.0


def _plan_slow(job, slowed: dict[int, float], horizon_s: float, *, json_out: bool, plain: bool):  # noqa: ANN001, ANN202
    """``--slow``: the straggler options on the job's launch plan (planner.choice.stragglers)."""
    from dataclasses import replace

    from chameleon_cli.plan_view import slow_choice_blocks, slow_choice_out
    from planner.choice.stragglers import straggler_choice
    from planner.plans.layout import initial_plan

    workers = job.num_workers * job.tp
    bad = [r for r in slowed if r >= workers]
    if bad:
        raise UserError(f"--slow: rank {bad[0]} is not in the job (ranks 0-{workers - 1})")
    by_worker: dict[int, float] = {}
    for rank, factor in slowed.items():  # a worker is as slow as its slowest device
        w = job.worker_of(rank)
        by_worker[w] = max(by_worker.get(w, 1.0), factor)
    current = initial_plan(job)
    choice = straggler_choice(
        replace(job, slow=tuple(sorted(by_worker.items()))), current, horizon_s
    )
    out = slow_choice_out(choice)
    Output(choose_mode(json=json_out, plain=plain)).show(
        slow_choice_blocks(out, cluster=job.cluster.name, model=job.model.name), out
    )
