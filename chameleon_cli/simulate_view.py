"""How a simulation looks: blocks for the output layer, and the optional PNG."""

from __future__ import annotations

import sys
from pathlib import Path

from chameleon_cli.errors import UserError
from chameleon_cli.output import Block, Fields, Table
from chameleon_cli.units import fmt_s
from planner.simulation.outcome import SimulationReport


def simulation_blocks(r: SimulationReport) -> list[Block]:
    best = max(r.outcomes, key=lambda o: o.throughput)
    adaptive = next((o for o in r.outcomes if o.policy == "adaptive"), None)
    slowed = r.slowdowns > 0
    rows = []
    for o in r.outcomes:
        over = (
            f"{adaptive.throughput / o.throughput:.3f}x"
            if adaptive is not None and o.throughput > 0
            else "-"
        )
        rows.append(
            [
                o.policy,
                f"{o.throughput:.4g}",
                f"{o.vs_failure_free:.3f}",
                f"{o.full_speed_share:.1%}",
                fmt_s(o.transition_s),
                fmt_s(o.redo_s),
                fmt_s(o.degraded_s),
                "-" if o.first_recovery is None else f"{o.first_recovery:.3f}",
                "-" if o.post_recovery is None else f"{o.post_recovery:.3f}",
                f"{o.in_place}",
                f"{o.restarts}",
                *([fmt_s(o.slowed_s), f"{o.deals}"] if slowed else []),
                over,
                (f"stopped {fmt_s(o.stopped_s)}: no feasible recovery; " if o.stopped else "")
                + o.note,
            ]
        )
    return [
        Fields(
            "Simulation",
            [
                ("config", r.config),
                ("trace", f"{r.trace}: {r.trace_source}"),
                (
                    "length",
                    f"{fmt_s(r.duration_s)}, {r.failures} failure(s), "
                    + (f"{r.slowdowns} slowdown(s), " if slowed else "")
                    + f"{r.workers} workers",
                ),
                ("failure-free", f"{r.failure_free:.4g} samples/s (step {fmt_s(r.step_s)})"),
                (
                    "simulated in",
                    f"{r.wall_s:.2f} s ({r.decisions} planner answers, the rest cached)",
                ),
            ],
        ),
        Table(
            "Policies (throughput in samples/s; lost time in wall time)",
            [
                "policy",
                "throughput",
                "vs failure-free",
                "full speed",
                "transitions",
                "redone",
                "degraded",
                "after 1st",
                "post-recovery",
                "in place",
                "restarts",
                *(["slowed", "deals"] if slowed else []),
                "adaptive over it",
                "note",
            ],  # fmt: skip
            rows,
            highlight=frozenset(i for i, o in enumerate(r.outcomes) if o is best),
        ),
    ]


def require_matplotlib() -> None:
    """Checked before simulating, so a missing extra costs no wait."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError(
            "--plot needs matplotlib: pip install matplotlib (chameleon-ft's plot extra)"
        ) from None


def plot(r: SimulationReport, path: Path) -> None:
    """Throughput over time, one line per policy (matplotlib: the ``plot`` extra)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    hours = r.duration_s / 3600
    for o in r.outcomes:
        xs, ys = [], []
        for (t, rate), nxt in zip(o.series, [*o.series[1:], (r.duration_s, None)], strict=True):
            xs += [t / 3600, nxt[0] / 3600]
            ys += [rate, rate]
        ax.plot(xs, ys, label=f"{o.policy} ({o.vs_failure_free:.3f})", drawstyle="default")
    ax.axhline(r.failure_free, color="grey", linestyle=":", label="failure-free")
    ax.set_xlim(0, hours)
    ax.set_xlabel("hours")
    ax.set_ylabel("samples/s")
    ax.set_title(f"{r.config}: {r.trace}")
    ax.legend(loc="lower left", fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:
        raise UserError(f"--plot: cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


class SimulationProgress:
    """A rich progress bar on stderr while policies replay a trace: one line per policy,
    its simulated time over the trace's length and the failures it has been through.
    Redrawn at most ten times a second, however fast the events come."""

    def __init__(self, policies: list[str], duration_s: float, failures: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.duration_s, self.failures = duration_s, failures
        self._progress = Progress(
            TextColumn("{task.description:14}"),
            BarColumn(),
            TextColumn("{task.fields[at]:>9} of {task.fields[length]}"),
            TextColumn("{task.fields[done]:>6}/{task.fields[total_failures]} failures"),
            TimeElapsedColumn(),
            console=Console(file=sys.stderr),
            transient=True,
            refresh_per_second=10,
        )
        length = fmt_s(duration_s)
        self._tasks = {
            p: self._progress.add_task(
                p,
                total=duration_s,
                at=fmt_s(0.0),
                length=length,
                done=0,
                total_failures=failures,
                start=False,
            )  # fmt: skip
            for p in policies
        }

    def __enter__(self) -> SimulationProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)

    def __call__(self, policy: str, t_s: float, failures: int) -> None:
        task = self._tasks[policy]
        self._progress.start_task(task)
        self._progress.update(task, completed=t_s, at=fmt_s(t_s), done=failures)
