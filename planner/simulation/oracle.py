"""The oracle: the best sequence of recoveries for one trace, known in hindsight.

Dynamic programming over the failures. What a run does after an event depends only on
its state then (its plan, when it trains again, which workers are down, idle or spare,
where its checkpoints fall), not on how it got there, so runs that reach the same state
are merged and only the one with the most samples so far is kept. At each failure every
surviving state branches into every feasible recovery (the reroute, each re-partition the
search proposes, the restart); at each repair into staying and taking the repaired
workers in (as the growing policies would, when it pays: planner.simulation.simulate.GROWS);
between events they only train.

Merging alone keeps the search exact. The number of distinct states can still grow with
every failure, so at most ``beam`` are carried, ranked by what they could reach at best
(their samples plus the rest of the trace at their current rate): with a beam the oracle
is a lower bound on the true best, and ``OracleRun.pruned`` says whether it ever cut. The
runs of the policies in ``FOLLOW`` (each a sequence of choices the oracle could make) are
always carried beside the beam, so the oracle is never below any of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from planner.simulation.simulate import Simulator
from planner.simulation.state import State, pace_s
from planner.simulation.trace import Trace

BEAM = 12
FOLLOW = ("adaptive", "reroute", "restart")
# Past this many workers the oracle is not run unless asked for: each failure asks the
# search for every branch's re-partitions, and on 2,048 workers (the 16,384-GPU config)
# that is about 70 new questions per failure, 528 s for a 54-day trace where every other
# policy together took under a minute.
MAX_WORKERS_BY_DEFAULT = 256


@dataclass(frozen=True)
class OracleRun:
    best: State
    states_max: int  # most states carried after any event
    pruned: bool  # whether the beam ever dropped a state


def _key(state: State) -> tuple:
    return (
        state.plan,
        state.step_s,
        round(state.resume_s, 6),
        round(state.redo_until_s, 6),
        round(state.checkpoint_from_s, 6),
        state.down,
        state.idle,
        state.spares,
        state.totals.stopped,
        state.slow,
        state.slow_since,
        state.slowed_step_s,
        state.deal,
        state.pending,
    )


def _keep(merged: dict[tuple, State], state: State) -> None:
    """Of runs in the same state, the one with the most samples."""
    k = _key(state)
    if k not in merged or merged[k].totals.samples < state.totals.samples:
        merged[k] = state


def _bound(sim: Simulator, state: State, duration_s: float) -> float:
    if state.plan is None:
        return state.totals.samples
    return state.totals.samples + sim.rate_of(pace_s(state)) * max(
        0.0, duration_s - max(state.t_s, state.resume_s)
    )


def oracle(
    sim: Simulator,
    trace: Trace,
    *,
    beam: int = BEAM,
    on_event: Callable[[float, int], None] | None = None,
) -> OracleRun:
    """``on_event(t_s, failures so far)`` after each event (a progress bar's)."""
    states = [sim.start("oracle")]
    followers = {p: sim.start(p) for p in FOLLOW}
    most, pruned, failures = 1, False, 0
    for event in trace.events:
        merged: dict[tuple, State] = {}
        for state in states:
            state = sim.due(state, event.t_s, "oracle")
            if event.kind in ("slow", "speed"):
                # (planned around as chameleon run would: no branch)
                branches = [sim.speed_change(state, event, "oracle")]
            elif event.kind == "repair":
                # workers back: stay, or take them in as the growing policies would
                branches = [sim.repair(state, event), sim.repair(state, event, "adaptive")]
            else:
                state, lost = sim.hit(state, event)
                branches = [state]
                if lost:
                    choices = sim.choices(state, lost, "oracle")
                    branches = [sim.recover(state, c) for c in choices] or [
                        sim.recover(state, None)
                    ]
            for b in branches:
                _keep(merged, sim.paced(b, "oracle"))
        for p, state in followers.items():
            followers[p] = state = sim.step(state, event, p)
            _keep(merged, state)
        ranked = sorted(
            merged.values(), key=lambda s: _bound(sim, s, trace.duration_s), reverse=True
        )
        most = max(most, len(ranked))
        pruned = pruned or len(ranked) > beam
        kept = ranked[:beam]
        kept_keys = {_key(s) for s in kept}
        kept += [s for s in followers.values() if _key(s) not in kept_keys]
        states = kept
        failures += event.kind == "fail"
        if on_event is not None:
            on_event(event.t_s, failures)
    finished = [sim.finish(s, trace.duration_s, "oracle") for s in states]
    best = max(finished, key=lambda s: s.totals.samples)
    return OracleRun(best=best, states_max=most, pruned=pruned)
