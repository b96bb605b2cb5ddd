"""The compact live view while a job runs (a terminal only): workers, their state and
step, the attempt, and the last events. Its state is a pure fold over the event stream
(``LiveState.apply``); the rich rendering redraws it a few times a second."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from launcher.events import Record


@dataclass
class WorkerRow:
    rank: int
    pid: int | None = None
    state: str = "starting"
    step: int | None = None


@dataclass
class LiveState:
    attempt: int = 0
    started: float = field(default_factory=time.time)
    workers: dict[int, WorkerRow] = field(default_factory=dict)
    recent: deque = field(default_factory=lambda: deque(maxlen=5))

    def apply(self, e: Record) -> None:
        name = e["event"]
        if name == "start":
            self.started = e["t"]
        elif name == "workers_started":
            self.attempt = e["attempt"]
            for rank, pid in zip(e["ranks"], e["pids"], strict=True):
                self.workers[rank] = WorkerRow(rank, pid, "running")
        elif name == "failure" and e.get("rank") in self.workers:
            self.workers[e["rank"]].state = f"failed ({e['kind']})"
        elif name == "step" and e.get("rank") in self.workers:
            self.workers[e["rank"]].step = e.get("step")
        elif name in (
            "restart",
            "decision",
            "recovered",
            "fault_injected",
            "node_lost",
            "plan_chosen",
            "launch_planned",
        ):
            detail = e.get("reason") or e.get("detail") or e.get("policy") or e.get("layout") or ""
            self.recent.append(f"+{e['t'] - self.started:6.1f}s  {name}  {detail}"[:110])
        elif name in ("straggler", "straggler_recovered"):
            detail = f"rank {e['rank']} at {e['factor']:.2f}x its peers' time, step {e.get('step')}"
            self.recent.append(f"+{e['t'] - self.started:6.1f}s  {name}  {detail}"[:110])

    def render(self) -> Group:
        table = Table(
            title=f"attempt {self.attempt}, {time.time() - self.started:.0f} s",
            title_justify="left",
        )
        for column in ("rank", "pid", "state", "step"):
            table.add_column(column)
        for row in sorted(self.workers.values(), key=lambda r: r.rank):
            table.add_row(
                str(row.rank),
                str(row.pid or "-"),
                row.state,
                "-" if row.step is None else str(row.step),
            )
        return Group(table, *self.recent)


class LiveView:
    """A rich Live region at the bottom of the terminal; worker lines print above it."""

    def __init__(self, console: Console) -> None:
        self.state = LiveState()
        self._live = Live(
            self.state.render(),
            console=console,
            refresh_per_second=4,
            transient=True,
            get_renderable=self.state.render,
        )

    def __enter__(self) -> LiveView:
        self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._live.__exit__(*exc)

    def on_event(self, e: Record) -> None:
        self.state.apply(e)

    def print_line(self, line: str, is_err: bool) -> None:
        self._live.console.print(line, markup=False, highlight=False, soft_wrap=True)
