"""Failure traces for ``chameleon simulate``: which workers fail when, and when they return;
which are slowed (stragglers), by how much, and when they have their speed back.

Three sources, one form (``Trace``: events in time order, each a set of workers lost,
back, slowed or back to speed):

- ``oobleck(job, interval_s)``: Oobleck's evaluation traces (PAPER.md): 30 nodes falling to
  15, one failure every 10 min, 30 min, 1 h, 3 h or 6 h, no repairs. Replayed on the job's
  own workers: half of them fall, one at a time, at that interval, in a seeded order.
- ``generated(job, duration_s)``: failures from statistics. Arrivals are a Poisson
  process at the job's rate (its devices over ``device_mtbf_hours``; Llama 3's 419
  interruptions in 54 days on 16,384 H100 by default: planner.job.failures), or at one per
  ``mtbf_s`` when given. Each takes a cause from Llama 3's mix (PAPER.md: 58.7% GPU,
  12.9% software, 8.4% network, the rest host and other), and the cause its scope: a GPU
  takes its worker until repaired; a software fault takes the worker's process, which is
  back at once (``PROCESS_RESTART_S``); network and host faults take a whole node until
  repaired. Repairs after ``repair_s`` (none when None). Slowdowns, when asked for
  (``Slowdowns``), arrive as a Poisson process of their own (another stream of the same
  seed, so a trace's failures are the same with or without them): one device's worker
  slowed by a factor for a time drawn around a mean (exponential: most are short, a few
  last long), as a throttled GPU or a noisy neighbour would.
- ``load(path, job)``: a JSON file (``TraceFile``), for traces from a real cluster.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from planner.job.errors import ConfigError
from planner.job.failures import CAUSES
from planner.job.workload import Job

_SCOPE = {name: scope for name, _, scope in CAUSES}

PROCESS_RESTART_S = 60.0  # a crashed process's worker is usable again after this
OOBLECK_INTERVALS_S = {"10m": 600.0, "30m": 1800.0, "1h": 3600.0, "3h": 10800.0, "6h": 21600.0}


@dataclass(frozen=True)
class Event:
    t_s: float
    kind: Literal["fail", "repair", "slow", "speed"]  # speed: a slowdown's end
    workers: tuple[int, ...]
    cause: str = ""
    factor: float = 1.0  # a slowdown's: 3 = a third of the worker's speed

    def takes_node(self, job: Job) -> bool:
        """Whether this failure took a whole node: by its cause where it names one of
        CAUSES, else when it took every worker of a node that has several."""
        if self.cause in _SCOPE:
            return _SCOPE[self.cause] == "node"
        lost = set(self.workers)
        nodes = {job.node_of(w) for w in lost}
        return any(
            len(on) > 1 and set(on) <= lost
            for on in ([w for w in job.workers_on_node(n) if w < job.num_workers] for n in nodes)
        )


@dataclass(frozen=True)
class Trace:
    name: str
    duration_s: float
    events: tuple[Event, ...]  # sorted by time, all before duration_s
    source: str  # where it came from, for the report

    @property
    def failures(self) -> int:
        return sum(1 for e in self.events if e.kind == "fail")

    @property
    def slowdowns(self) -> int:
        return sum(1 for e in self.events if e.kind == "slow")


def _sorted(events: list[Event], duration_s: float) -> tuple[Event, ...]:
    return tuple(sorted((e for e in events if e.t_s < duration_s), key=lambda e: e.t_s))


@dataclass(frozen=True)
class Slowdowns:
    """Stragglers to draw beside failures: one every ``every_s`` on average (the job's),
    each slowing one device's worker ``factor`` times for ``for_s`` on average."""

    every_s: float
    factor: float = 2.0
    for_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.every_s <= 0 or self.for_s <= 0:
            raise ConfigError("slowdowns need a positive interval and duration")
        if self.factor <= 1.0:
            raise ConfigError(f"a slowdown factor must be above 1 (got {self.factor:g})")


def _slowdowns(job: Job, spec: Slowdowns, duration_s: float, seed: int) -> list[Event]:
    # (a stream of its own: the failures drawn from ``seed`` stay the same)
    rng = random.Random(f"slowdowns-{seed}")
    events: list[Event] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / spec.every_s)
        if t >= duration_s:
            return events
        worker = (job.worker_of(rng.randrange(job.cluster.num_devices)),)
        lasts = rng.expovariate(1.0 / spec.for_s)
        events.append(Event(t, "slow", worker, "slowdown", spec.factor))
        events.append(Event(t + lasts, "speed", worker, "slowdown"))


def oobleck(job: Job, interval_s: float, *, duration_s: float, seed: int = 0) -> Trace:
    """Half the job's workers fall one at a time, every ``interval_s`` (module doc)."""
    order = list(range(job.num_workers))
    random.Random(seed).shuffle(order)
    falls = order[: job.num_workers // 2]
    events = [Event((i + 1) * interval_s, "fail", (w,), "oobleck") for i, w in enumerate(falls)]
    label = next((k for k, v in OOBLECK_INTERVALS_S.items() if v == interval_s), f"{interval_s:g}s")
    return Trace(
        name=f"oobleck-{label}",
        duration_s=duration_s,
        events=_sorted(events, duration_s),
        source=f"Oobleck's trace: {job.num_workers} workers to {job.num_workers - len(falls)}, "
        f"one failure every {label}",
    )


def generated(
    job: Job,
    *,
    duration_s: float,
    seed: int = 0,
    mtbf_s: float | None = None,
    repair_s: float | None = None,
    slowdowns: Slowdowns | None = None,
) -> Trace:
    """Failures, and slowdowns when given, drawn from statistics (module doc)."""
    rng = random.Random(seed)
    c = job.cluster
    rate = 1.0 / mtbf_s if mtbf_s else c.num_devices / c.device_mtbf_s
    names, weights, scopes = zip(*CAUSES, strict=True)
    events: list[Event] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            break
        k = rng.choices(range(len(names)), weights=weights)[0]
        rank = rng.randrange(c.num_devices)
        if scopes[k] == "node":
            node = job.node_of(job.worker_of(rank))
            workers = tuple(w for w in job.workers_on_node(node) if w < job.num_workers)
        else:
            workers = (job.worker_of(rank),)
        events.append(Event(t, "fail", workers, names[k]))
        back = PROCESS_RESTART_S if scopes[k] == "process" else repair_s
        if back is not None:
            events.append(Event(t + back, "repair", workers, names[k]))
    if slowdowns is not None:
        events += _slowdowns(job, slowdowns, duration_s, seed)
    source = (
        f"generated: one failure per {mtbf_s / 3600:.3g} h"
        if mtbf_s
        else f"generated: {c.num_devices} devices, one failure per "
        f"{c.device_mtbf_s / 3600:.3g} device-hours"
    )
    repairs = f"repaired after {repair_s / 3600:.3g} h" if repair_s is not None else "no repairs"
    slow = (
        f"; a worker slowed {slowdowns.factor:g}x every {slowdowns.every_s / 3600:.3g} h "
        f"for {slowdowns.for_s / 60:.3g} min on average"
        if slowdowns is not None
        else ""
    )
    return Trace(
        name=f"generated-seed{seed}",
        duration_s=duration_s,
        events=_sorted(events, duration_s),
        source=f"{source}; Llama 3's cause mix; {repairs}{slow}",
    )


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TraceEventFile(_Strict):
    t_hours: Annotated[float, Field(ge=0)]
    fail_ranks: list[Annotated[int, Field(ge=0)]] = []
    fail_nodes: list[Annotated[int, Field(ge=0)]] = []
    repair_ranks: list[Annotated[int, Field(ge=0)]] = []
    repair_nodes: list[Annotated[int, Field(ge=0)]] = []
    # A slowdown: these ranks' (or nodes') workers ``factor`` times slower for ``for_hours``.
    slow_ranks: list[Annotated[int, Field(ge=0)]] = []
    slow_nodes: list[Annotated[int, Field(ge=0)]] = []
    factor: Annotated[float, Field(gt=1.0)] | None = None
    for_hours: Annotated[float, Field(gt=0)] | None = None
    cause: str = ""

    @model_validator(mode="after")
    def _slowdown_whole(self) -> TraceEventFile:
        slowed = bool(self.slow_ranks or self.slow_nodes)
        if slowed and (self.factor is None or self.for_hours is None):
            raise ValueError("a slowdown (slow_ranks, slow_nodes) needs factor and for_hours")
        if not slowed and (self.factor is not None or self.for_hours is not None):
            raise ValueError("factor and for_hours belong to a slowdown (slow_ranks, slow_nodes)")
        return self


class TraceFile(_Strict):
    """A trace as JSON: ``{"name": ..., "events": [{"t_hours": 1.5, "fail_nodes": [3]},
    {"t_hours": 4, "repair_nodes": [3]}, {"t_hours": 5, "slow_ranks": [9], "factor": 2,
    "for_hours": 0.5}]}``; ranks are device ranks."""

    name: str = ""
    events: list[TraceEventFile]


def load(path: Path, job: Job, *, duration_s: float) -> Trace:
    try:
        data = TraceFile.model_validate(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not a JSON trace ({exc})") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ConfigError(f"{path}: {where}: {first['msg']}") from None
    c = job.cluster
    events: list[Event] = []
    for n, e in enumerate(data.events):
        for kind, ranks, nodes in (
            ("fail", e.fail_ranks, e.fail_nodes),
            ("repair", e.repair_ranks, e.repair_nodes),
            ("slow", e.slow_ranks, e.slow_nodes),
        ):
            bad = [r for r in ranks if r >= c.num_devices] + [x for x in nodes if x >= c.num_nodes]
            if bad:
                raise ConfigError(
                    f"{path}: event {n}: {bad[0]} is not in the cluster "
                    f"({c.num_devices} devices on {c.num_nodes} nodes)"
                )
            workers = {job.worker_of(r) for r in ranks}
            workers |= {w for x in nodes for w in job.workers_on_node(x)}
            workers = {w for w in workers if w < job.num_workers}
            if not workers:
                continue
            t_s, these = e.t_hours * 3600, tuple(sorted(workers))
            if kind == "slow":
                assert e.factor is not None and e.for_hours is not None
                events.append(Event(t_s, "slow", these, e.cause, e.factor))
                events.append(Event(t_s + e.for_hours * 3600, "speed", these, e.cause))
            else:
                events.append(Event(t_s, kind, these, e.cause))  # type: ignore[arg-type]
    return Trace(
        name=data.name or path.stem,
        duration_s=duration_s,
        events=_sorted(events, duration_s),
        source=f"file {path}",
    )
