"""``chameleon simulate``: every policy over a whole failure trace, on the planner's costs."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from chameleon_cli.output import Output, choose_mode
from chameleon_cli.units import duration_flag

BUILTIN = ("oobleck-10m", "oobleck-30m", "oobleck-1h", "oobleck-3h", "oobleck-6h")


def _policies(text: str) -> list[str]:
    from planner.simulation.simulate import POLICIES

    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise typer.BadParameter(
            f"unknown policy {bad[0]!r}; choose from {','.join(POLICIES)}"
            if bad
            else "name at least one policy",
            param_hint="--policies",
        )
    return list(dict.fromkeys(names))


def simulate(
    config: Annotated[
        Path,
        typer.Option(
            "--config", "-c", help="Job config (TOML), e.g. configs/ascend910b_32_gpt13b.toml."
        ),
    ],
    trace: Annotated[
        str | None,
        typer.Option(
            "--trace",
            help="A trace file (JSON: docs/simulate.md) or a built-in one: "
            + ", ".join(BUILTIN)
            + ". Default: failures drawn from --mtbf, else from the config's device_mtbf_hours.",
        ),
    ] = None,
    mtbf: Annotated[
        str | None,
        typer.Option("--mtbf", help="Mean time between failures of the whole job: 30m, 3h."),
    ] = None,
    duration: Annotated[
        str, typer.Option("--duration", help="Length of the simulated run: 24h, 54d.")
    ] = "24h",
    repair: Annotated[
        str,
        typer.Option(
            "--repair", help="Time until failed hardware is back, or 'none' (drawn traces)."
        ),
    ] = "2h",
    seed: Annotated[int, typer.Option("--seed", help="Seed of drawn traces.")] = 0,
    slowdowns: Annotated[
        str | None,
        typer.Option(
            "--slowdowns",
            help="Drawn traces: stragglers beside the failures, one every this long on "
            "average (2h): one worker slowed --slow-factor times for --slow-for.",
        ),
    ] = None,
    slow_factor: Annotated[
        float, typer.Option("--slow-factor", help="How many times slower (with --slowdowns).")
    ] = 2.0,
    slow_for: Annotated[
        str,
        typer.Option(
            "--slow-for", help="Mean length of a slowdown, exponentially drawn (with --slowdowns)."
        ),
    ] = "30m",
    policies: Annotated[
        str | None,
        typer.Option(
            "--policies",
            help="Comma-separated: adaptive,reroute,reparallelize,restart,redundant,oracle. "
            "Default: all, the oracle only on jobs of at most 256 workers (past that it "
            "takes minutes per trace: name it to run it).",
        ),
    ] = None,
    calibration: Annotated[
        Path | None,
        typer.Option(
            "--calibration",
            help="A chameleon run --events log: replay on the costs that run measured "
            "(its failure-free step, transitions and restart), not the config's alone.",
        ),
    ] = None,
    plot_to: Annotated[
        Path | None,
        typer.Option("--plot", help="Write throughput over time to this PNG (needs matplotlib)."),
    ] = None,
    processes: Annotated[
        int | None,
        typer.Option(
            "--processes",
            min=1,
            max=2,
            help="1 or 2: with 2, adaptive (and the oracle) run in one process and the other "
            "policies in a second, with the same figures. Default: 2 where this process may use 2 CPUs.",
        ),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    plain: Annotated[bool, typer.Option("--plain", help="Plain text even on a terminal.")] = False,
) -> None:
    """Replay failures through every recovery policy and compare whole runs."""
    from chameleon_cli.errors import UserError
    from chameleon_cli.simulate_view import (
        SimulationProgress,
        plot,
        require_matplotlib,
        simulation_blocks,
    )
    from planner.config import load_job
    from planner.simulation import trace as traces
    from planner.simulation.oracle import MAX_WORKERS_BY_DEFAULT
    from planner.simulation.outcome import simulate as run_all
    from planner.simulation.simulate import POLICIES

    names = _policies(policies) if policies is not None else list(POLICIES)
    duration_s = duration_flag(duration, "--duration")
    assert duration_s is not None
    mtbf_s = duration_flag(mtbf, "--mtbf")
    repair_s = None if repair.strip().lower() == "none" else duration_flag(repair, "--repair")
    if trace is not None and mtbf is not None:
        raise typer.BadParameter("give --trace or --mtbf, not both", param_hint="--mtbf")
    drawn_slowdowns = None
    if slowdowns is not None:
        if trace is not None:
            raise typer.BadParameter(
                "a trace brings its own slowdowns (slow_ranks: docs/simulate.md)",
                param_hint="--slowdowns",
            )
        if slow_factor <= 1.0:
            raise typer.BadParameter(
                f"{slow_factor:g}: a slowdown is more than 1 times slower",
                param_hint="--slow-factor",
            )
        every_s = duration_flag(slowdowns, "--slowdowns")
        lasts_s = duration_flag(slow_for, "--slow-for")
        assert every_s is not None and lasts_s is not None
        drawn_slowdowns = traces.Slowdowns(every_s, slow_factor, lasts_s)
    if plot_to is not None and not plot_to.parent.is_dir():
        raise UserError(f"--plot: no such folder {plot_to.parent}")
    if plot_to is not None:
        require_matplotlib()
    job = load_job(config)
    if calibration is not None:
        from planner.simulation.calibration import from_events

        job = from_events(calibration).apply(job)
    if trace is None:
        tr = traces.generated(
            job, duration_s=duration_s, seed=seed, mtbf_s=mtbf_s, repair_s=repair_s,
            slowdowns=drawn_slowdowns,
        )  # fmt: skip
    elif trace in BUILTIN:
        interval = traces.OOBLECK_INTERVALS_S[trace.split("-", 1)[1]]
        tr = traces.oobleck(job, interval, duration_s=duration_s, seed=seed)
    else:
        path = Path(trace)
        if not path.is_file():
            raise UserError(
                f"--trace: {trace} is neither a file nor a built-in trace ({', '.join(BUILTIN)})"
            )
        tr = traces.load(path, job, duration_s=duration_s)
    if policies is None and job.num_workers > MAX_WORKERS_BY_DEFAULT:
        names.remove("oracle")
        print(
            f"chameleon: the oracle is left out on {job.num_workers:,} workers (it runs by "
            f"default up to {MAX_WORKERS_BY_DEFAULT}; here it can take tens of minutes): "
            f"--policies {','.join(POLICIES)} runs it",
            file=sys.stderr,
        )
    if processes is None:
        usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        processes = min(2, len(usable) if usable is not None else os.cpu_count() or 1)
    if sys.stderr.isatty() and not plain:
        with SimulationProgress(names, tr.duration_s, tr.failures) as bar:
            report = run_all(job, tr, names, config=str(config), progress=bar, processes=processes)
    else:
        report = run_all(job, tr, names, config=str(config), processes=processes)
    Output(choose_mode(json=json_out, plain=plain)).show(simulation_blocks(report), report)
    if plot_to is not None:
        plot(report, plot_to)
