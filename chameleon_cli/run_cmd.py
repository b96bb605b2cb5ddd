"""``chameleon run``: the launcher, as a torchrun replacement (arguments parsed by
launcher.args so that torchrun's spellings and pass-through semantics hold exactly)."""

from __future__ import annotations

import os
import sys

import typer

from chameleon_cli.errors import UsageError, UserError, check_script, writable_dir
from chameleon_cli.output import Mode, Output, choose_mode, error

CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def run(ctx: typer.Context) -> None:
    """Launch and supervise a training job (torchrun-compatible flags; see chameleon run --help)."""
    # The launcher is imported here, not at the top: every other command (plan, simulate,
    # timeline) starts without it. The flags are read first, and the agent (torch, 0.8 s)
    # imported only once they are good: a usage error or --help answers without it.
    from launcher.args import ArgsError, parse_run_args, run_help

    argv = list(ctx.args)
    if argv[:1] in (["-h"], ["--help"]):
        sys.stdout.write(run_help())
        return
    if not argv:
        raise UsageError("no training script given (chameleon run --help shows the flags)")
    try:
        args = parse_run_args(argv)
    except ArgsError as exc:
        raise UsageError(str(exc)) from None
    if not (args.module or args.no_python):
        check_script(args.script)
    if args.log_dir:
        writable_dir("--log-dir", args.log_dir)
    if args.events:
        writable_dir("--events", os.path.dirname(os.path.abspath(args.events)))
    from rich.console import Console as RichConsole

    from chameleon_cli.live_view import LiveView
    from chameleon_cli.run_view import outcome_blocks, outcome_model
    from launcher.agent import Agent, JobError
    from launcher.workers import Console

    console = Console()
    console.stdout_to_stderr = args.json  # (stdout: the outcome's JSON object alone)
    mode = choose_mode(json=args.json, plain=args.plain, stream=sys.stderr)
    live = LiveView(RichConsole(file=sys.stderr)) if mode is Mode.RICH else None
    agent = Agent(args, console=console, events_listener=live.on_event if live else None)
    error(f"chameleon: run {agent.run_id}: logs in {agent.run_dir}, events in {agent.events.path}")
    if args.from_env:
        error(f"chameleon: from the environment: {', '.join(args.from_env)}")
    try:
        if live is None:
            outcome = agent.run()
        else:
            console.write = live.print_line
            with live:
                outcome = agent.run()
    except JobError as exc:
        raise UserError(str(exc)) from None
    ended = {
        "exit_code": outcome.exit_code,
        "reason": outcome.reason,
        "failures": outcome.failures,
        "events": agent.events.records,
        "run_dir": str(outcome.run_dir),
        "events_path": str(agent.events.path),
    }
    Output(mode, stream=sys.stdout if mode is Mode.JSON else sys.stderr).show(
        outcome_blocks(**ended), outcome_model(**ended)
    )
    raise typer.Exit(outcome.exit_code)
