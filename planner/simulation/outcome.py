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
- failures survived in place (no restart), and restarts;
- with slowdowns in the trace: the time trained with a slow worker in the plan, and the
  moves to an uneven deal around one and back.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from pydantic import BaseModel

from planner.job.workload import Job
from planner.simulation.oracle import oracle
from planner.simulation.simulate import POLICIES, Simulator
from planner.simulation.state import State
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
    slowed_s: float = 0.0  # training with a slow worker in the plan
    deals: int = 0  # moves to an uneven deal around slow workers, and back
    series: list[tuple[float, float]]  # (t_s, samples/s) where the rate changes
    note: str = ""


class SimulationReport(BaseModel):
    config: str
    trace: str
    trace_source: str
    duration_s: float
    failures: int  # failure events in the trace
    slowdowns: int = 0  # slowdown events in the trace
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
        slowed_s=t.slowed_s,
        deals=t.deals,
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


# Policies whose runs share most of their answers (the oracle follows adaptive's states);
# with a second process, they run in one and every other policy in the other.
_TOGETHER = ("adaptive", "oracle")


def simulate(
    job: Job,
    trace: Trace,
    policies: Sequence[str] = POLICIES,
    *,
    config: str = "",
    sim: Simulator | None = None,
    progress: Callable[[str, float, int], None] | None = None,
    processes: int = 1,
) -> SimulationReport:
    """Every policy in ``policies`` over ``trace``; ``progress(policy, t_s, failures so
    far)`` after each event of each run (``chameleon simulate``'s progress bar; with two
    processes it is called from two threads of this one).

    ``processes`` 2 runs adaptive (and the oracle) in this process and the other policies
    in a forked one, each with its own cache of answers: a policy's run depends on no
    other's, and an answer on nothing cached before it (planner.simulation.answers), so
    the figures are the same bits as in one process."""
    started = time.perf_counter()
    sim = sim or Simulator(job)
    here = [p for p in policies if p in _TOGETHER]
    there = [p for p in policies if p not in _TOGETHER]
    with _cycle_collector_paused():
        if processes > 1 and here and there:
            outcomes, decisions = _in_two(sim, trace, here, there, progress)
        else:
            outcomes, decisions = _run(sim, trace, policies, progress), sim.decisions
    by_policy = {o.policy: o for o in outcomes}
    return SimulationReport(
        config=config,
        trace=trace.name,
        trace_source=trace.source,
        duration_s=trace.duration_s,
        failures=trace.failures,
        slowdowns=trace.slowdowns,
        workers=job.num_workers,
        failure_free=sim.rate0,
        step_s=sim.step0_s,
        outcomes=[by_policy[p] for p in policies],
        decisions=decisions,
        wall_s=time.perf_counter() - started,
    )


def _run(
    sim: Simulator,
    trace: Trace,
    policies: Sequence[str],
    progress: Callable[[str, float, int], None] | None,
) -> list[PolicyOutcome]:
    def reporter(policy: str) -> Callable[[float, int], None] | None:
        if progress is None:
            return None
        return lambda t_s, failures: progress(policy, t_s, failures)

    outcomes = []
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
    return outcomes


def _in_two(
    sim: Simulator,
    trace: Trace,
    here: list[str],
    there: list[str],
    progress: Callable[[str, float, int], None] | None,
) -> tuple[list[PolicyOutcome], int]:
    """``here`` in this process, ``there`` in a forked child (the warm Simulator is
    inherited, not rebuilt). The child sends JSON over a pipe: its progress, then its
    outcomes and how many answers it computed, or the error that stopped it."""
    context = multiprocessing.get_context("fork")
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(
        target=_child, args=(sim, trace, there, writer, progress is not None), daemon=True
    )
    child.start()
    writer.close()
    result: dict = {}
    failed: list[BaseException] = []

    def listen() -> None:
        # (a thread: the child's progress reaches the bar while this process runs its own)
        try:
            while True:
                message = json.loads(reader.recv_bytes())
                if "progress" in message:
                    if progress is not None:
                        progress(*message["progress"])
                    continue
                result.update(message)
                return
        except EOFError:
            return  # ended without an answer: said once it is reaped (its exit code)
        except BaseException as exc:  # the progress callback's: raised in the caller
            failed.append(exc)

    listener = threading.Thread(target=listen, name="simulate-child", daemon=True)
    listener.start()
    try:
        mine = _run(sim, trace, here, progress)
        listener.join()
    finally:
        if child.is_alive():
            child.terminate()
        child.join()
        listener.join()  # (the child's end of the pipe is closed: it returns)
        reader.close()
    if failed:
        raise failed[0]
    if "outcomes" not in result:
        why = result.get("error") or f"exited with code {child.exitcode} before it answered"
        raise RuntimeError(f"the simulation of {', '.join(there)}: {why}")
    theirs = [PolicyOutcome.model_validate(o) for o in result["outcomes"]]
    return mine + theirs, sim.decisions + result["decisions"]


def _child(sim: Simulator, trace: Trace, policies: list[str], pipe, report: bool) -> None:
    parent = os.getppid()

    def send(message: dict) -> None:
        # (JSON keeps an infinite or NaN figure, which pydantic's JSON mode makes null)
        pipe.send_bytes(json.dumps(message).encode())

    def progress(policy: str, t_s: float, failures: int) -> None:
        if os.getppid() != parent:  # the caller is gone (killed): nobody will read this
            os._exit(1)
        if report:
            send({"progress": [policy, t_s, failures]})

    before = sim.decisions
    try:
        outcomes = _run(sim, trace, policies, progress)
        send({"outcomes": [o.model_dump() for o in outcomes], "decisions": sim.decisions - before})
    except BaseException as exc:  # said to the parent, which raises it
        send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        pipe.close()
