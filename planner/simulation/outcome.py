"""What each policy made of a trace: the figures ``chameleon simulate`` reports.

``simulate(job, trace, policies)`` runs them (planner.simulation.simulate, planner.simulation.oracle) and sums
each run up as a pydantic model, which is also the command's ``--json``:

- throughput: samples per second averaged over the whole trace, and over failure-free;
- full speed: the share of the trace spent training at the failure-free rate;
- lost to transitions (not training), to redone work (a restart's lost steps) and to
  degraded steps (training time times the share of the failure-free rate it missed);
- post-recovery: the rate after recoveries over failure-free, averaged over the time spent
  training then; and the rate right after the first recovery, one failure's cost (what
  PAPER.md's "within 11% of failure-free" measures);
- failures survived in place (no restart), and restarts.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from pydantic import BaseModel

from planner.job.workload import Job
from planner.simulation.oracle import oracle
from planner.simulation.simulate import POLICIES, Simulator, State
from planner.simulation.trace import Trace


class PolicyOutcome(BaseModel):
    policy: str
    throughput: float  # samples/s over the whole trace
    vs_failure_free: float
    full_speed_share: float
    transition_s: float
    redo_s: float
    degraded_s: float
    post_recovery: float | None  # rate over failure-free after recoveries; None: none
    first_recovery: float | None  # rate over failure-free right after the first one
    in_place: int
    restarts: int
    stopped: bool  # no feasible recovery at some point
    stopped_s: float  # time spent so, until workers came back to restart it
    series: list[tuple[float, float]]  # (t_s, samples/s) where the rate changes
    note: str = ""


class SimulationReport(BaseModel):
    config: str
    trace: str
    trace_source: str
    duration_s: float
    failures: int  # failure events in the trace
    workers: int
    failure_free: float  # samples/s
    step_s: float  # failure-free
    outcomes: list[PolicyOutcome]
    decisions: (
        int  # answers the planner computed (the rest were cached: planner.simulation.simulate)
    )
    wall_s: float

    def outcome(self, policy: str) -> PolicyOutcome:
        return next(o for o in self.outcomes if o.policy == policy)


def _series(state: State) -> list[tuple[float, float]]:
    out = []
    node = state.points
    while node:
        out.append(node[0])
        node = node[1]
    return sorted(out)


def _first_recovery(series: list[tuple[float, float]]) -> float | None:
    """The first rate above 0 after the first stop: the plan the first recovery chose."""
    stopped = False
    for _t, rate in series:
        if rate == 0.0:
            stopped = True
        elif stopped:
            return rate
    return None


def outcome(
    sim: Simulator, policy: str, state: State, duration_s: float, note: str = ""
) -> PolicyOutcome:
    t = state.totals
    series = _series(state)
    first = _first_recovery(series)
    return PolicyOutcome(
        policy=policy,
        throughput=t.samples / duration_s,
        vs_failure_free=t.samples / duration_s / sim.rate0,
        full_speed_share=t.full_s / duration_s,
        transition_s=t.transition_s,
        redo_s=t.redo_s,
        degraded_s=t.degraded_s,
        post_recovery=t.post_rate_s / t.post_s if t.post_s > 0 else None,
        first_recovery=first / sim.rate0 if first is not None else None,
        in_place=t.in_place,
        restarts=t.restarts,
        stopped=t.stopped,
        stopped_s=t.stopped_s,
        series=series,
        note=note,
    )


@contextmanager
def _cycle_collector_paused() -> Iterator[None]:
    """The simulator's cached answers are millions of small tuples that live to the end
    of the run, and Python's cycle collector walks them all again and again: on the
    54-day trace at 16,384 GPUs it took 11 of 54 s and found some 700 objects in cycles.
    Reference counting still frees everything else; the collector resumes afterwards."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def simulate(
    job: Job,
    trace: Trace,
    policies: Sequence[str] = POLICIES,
    *,
    config: str = "",
    sim: Simulator | None = None,
    progress: Callable[[str, float, int], None] | None = None,
) -> SimulationReport:
    """Every policy in ``policies`` over ``trace``; ``progress(policy, t_s, failures so
    far)`` after each event of each run (``chameleon simulate``'s progress bar)."""
    started = time.perf_counter()
    sim = sim or Simulator(job)
    outcomes = []

    def reporter(policy: str) -> Callable[[float, int], None] | None:
        if progress is None:
            return None
        return lambda t_s, failures: progress(policy, t_s, failures)

    with _cycle_collector_paused():
        for policy in policies:
            if policy == "oracle":
                run = oracle(sim, trace, on_event=reporter(policy))
                note = (
                    f"best of {run.states_max} states at most; beam cut some (a lower bound)"
                    if run.pruned
                    else "exact"
                )
                outcomes.append(outcome(sim, policy, run.best, trace.duration_s, note))
            else:
                state = sim.run(trace, policy, on_event=reporter(policy))
                outcomes.append(outcome(sim, policy, state, trace.duration_s))
            if progress is not None:  # the rest of the trace, after its last event
                progress(policy, trace.duration_s, trace.failures)
    return SimulationReport(
        config=config,
        trace=trace.name,
        trace_source=trace.source,
        duration_s=trace.duration_s,
        failures=trace.failures,
        workers=job.num_workers,
        failure_free=sim.rate0,
        step_s=sim.step0_s,
        outcomes=outcomes,
        decisions=sim.decisions,
        wall_s=time.perf_counter() - started,
    )
