"""``chameleon profile``: measure a training script's layers, links and store into a cost
table for the planner. The script runs under the launcher with CHAMELEON_PROFILE set; its
chameleon_runtime Trainer measures instead of training (docs/runtime.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import typer

from chameleon_cli.errors import JobFailed, UsageError, UserError, check_script, writable_dir
from chameleon_cli.output import Fields, Output, Table, choose_mode, error
from chameleon_cli.units import fmt_bytes, fmt_s

CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}
HELP = """usage: chameleon profile --out TABLE.json [--nproc-per-node N] [--plain] SCRIPT [SCRIPT_ARGS...]

Run 40 real steps of SCRIPT's own layout, then measure its layers (forward, backward,
optimizer time, parameters, activation and stashed bytes), the link between two workers
(latency, bandwidth, CPU per byte), the store, and the CPU of moving a layer and of a
step's tail, into a cost table that a config names with [model] cost_table = "...".
SCRIPT must train with chameleon_runtime.
Every worker measures every layer at once, so run as many workers as the job will run on
a shared host (the contention is part of a step's cost).
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise UsageError(message)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog="chameleon profile", add_help=False, allow_abbrev=False)
    p.add_argument("--out", required=True)
    p.add_argument("--nproc-per-node", "--nproc_per_node", default="2")
    p.add_argument("--plain", action="store_true")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p.parse_args(argv)


def profile(ctx: typer.Context) -> None:
    """Measure a chameleon_runtime script into a cost table for the planner."""
    from launcher.agent import Agent, JobError  # here: other commands start without it
    from launcher.args import ArgsError, parse_run_args
    from launcher.workers import Console

    argv = list(ctx.args)
    if argv[:1] in (["-h"], ["--help"]):
        sys.stdout.write(HELP)
        return
    if not argv:
        raise UsageError(
            "--out TABLE.json and a training script are needed (chameleon profile --help)"
        )
    ns = _parse(argv)
    out = Path(ns.out).resolve()
    if out.is_dir():
        raise UserError(f"--out {ns.out} is a folder: name the cost table's file")
    writable_dir("--out", str(out.parent))
    try:
        args = parse_run_args(
            ["--standalone", "--nproc-per-node", ns.nproc_per_node, ns.script, *ns.script_args]
        )
    except ArgsError as exc:
        raise UsageError(str(exc)) from None
    check_script(args.script)
    out.unlink(missing_ok=True)
    os.environ["CHAMELEON_PROFILE"] = str(out)
    agent = Agent(args, console=Console())
    error(f"chameleon: profiling {args.script} on {args.nproc_per_node} workers into {out}")
    try:
        outcome = agent.run()
    except JobError as exc:
        raise UserError(str(exc)) from None
    if outcome.exit_code != 0:
        raise JobFailed(
            f"the script failed while profiling ({outcome.reason}); logs in {outcome.run_dir}",
            outcome.exit_code,
        )
    if not out.exists():
        raise UserError(
            f"{args.script} wrote no cost table: does it train with chameleon_runtime.Trainer?"
        )
    table = json.loads(out.read_text())
    rows = [
        [c["name"], f"{c['num_params']:,}", fmt_s(c["forward_s"]), fmt_s(c["backward_s"]), fmt_s(c["optimizer_s"]),
         fmt_bytes(c["activation_bytes"]), fmt_bytes(c["stash_bytes"])]
        for c in table["layers"]
    ]  # fmt: skip
    link = table.get("intra_node")
    fields = [
        ("cost table", str(out)),
        ("micro-batch", str(table["micro_batch_size"])),
        ("workers measuring at once", str(table["concurrent_workers"])),
        (
            "link",
            f"{link['bandwidth_gb_per_s']:.2f} GB/s, {link['latency_us']:.0f} us"
            if link
            else "not measured (one worker)",
        ),
        ("store round trip", fmt_s(table["store_round_trip_s"])),
        ("group creation", fmt_s(table["pg_init_base_s"])),
        (
            "CPU per MiB messaged",
            fmt_s(table["message_cpu_s_per_byte"] * 2**20)
            if table.get("message_cpu_s_per_byte") is not None
            else "not measured (one worker)",
        ),
        ("step tail CPU per 1M params", fmt_s((table.get("tail_cpu_s_per_param") or 0) * 1e6)),
    ]
    Output(choose_mode(json=False, plain=ns.plain)).show(
        [
            Fields("Profile", fields),
            Table(
                "Layers (one micro-batch)",
                ["layer", "params", "forward", "backward", "optimizer", "output", "stashed"],
                rows,
            ),
        ]
    )
