"""A new leader takes over a round in place (``--rdzv-backend etcd``).

The in-place coordinator's state lives in the leader's memory and in the worker store it
hosts, and both go with its node. So while the job trains, the leader mirrors into etcd
what a successor needs to go on from the last settled generation (``snapshot``): that
generation's plan and the first, which ranks are live and which are gone with their node,
where the last recovery resumed, the job's description that the workers wrote, how
many failures were handled, and what the planner's model has learned (its fit to the
measured steps, the transitions' factor, the failure posterior), so that the successor
plans on the same costs. Before publishing any plan it also writes the generation's
number, so that a successor never hands out a number a worker may have seen.

The successor (launcher/agent.py ``_take_over``) serves a new worker store, publishes its
address (the agents write it to their workers' store file: chameleon_runtime.storeaddr),
and starts its coordinator from the snapshot (``resume``): the old leader's ranks are
then lost like any node's, the survivors, who lost their store, report Ready to the new
one, and the recovery runs as for any other node loss. Without a snapshot (the old
leader died before the first one, or the job is not a chameleon_runtime job), the round
is restarted, as on the TCPStore backends.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from launcher import recovery as rc
from launcher.supervisor import Failure

if TYPE_CHECKING:
    from launcher.coordinator import Coordinator


def snapshot(c: Coordinator) -> dict[str, Any] | None:
    """What a successor needs, taken when a generation has settled (None otherwise)."""
    state = c.state
    if state is None or state.phase is not rc.Phase.RUNNING or state.confirmed != state.generation:
        return None
    c._described()  # the workers wrote it before their first step; read it if not yet
    description = c.model.description
    return {
        "generation": state.generation,
        "plan": c.plans[state.generation].model_dump_json(),
        "plan0": c.plans[0].model_dump_json(),
        "live": sorted(state.live),
        "gone": sorted(c.gone),
        "resume_step": state.resume_step,
        "next_id": state.next_id,
        "recovery": state.recovery,
        "failures": len(c.failures),
        "description": description.model_dump_json() if description is not None else None,
        # the planner's costs as this run has learned them: a successor plans on them
        "calibration": c.model.snapshot(),
    }


def resume(c: Coordinator, snap: dict[str, Any], known: list[Failure], next_gen: int) -> None:
    """Start ``c`` (a successor's coordinator) where the snapshot left off. ``known``: the
    round's failures the old leader had handled; ``next_gen``: the newest generation
    number it wrote before publishing."""
    from chameleon_runtime.protocol.wire import JobDescription, PlanMessage

    current = PlanMessage.model_validate_json(snap["plan"])
    c.plans = {0: PlanMessage.model_validate_json(snap["plan0"]), current.generation: current}
    plan = current.plan.to_plan()
    layout = {s.worker: (s.first_layer, s.end_layer) for s in plan.stages}
    generation = int(snap["generation"])
    state = rc.State.initial(
        world=frozenset(snap["live"]),
        layout=layout,
        resume_step=int(snap["resume_step"]),
        timeouts=c._timeouts,
        generation=generation,
    )
    c.state = replace(
        state,
        next_id=max(int(snap["next_id"]), next_gen + 1, state.next_id),
        recovery=int(snap["recovery"]),
    )
    c.gone |= set(snap["gone"])  # the planner holds this set: updated in place
    c.failures = list(known)
    c.recovered = len(known)
    c._settled_generation = generation
    c._gen_start = int(snap["resume_step"])
    if snap.get("description"):
        c.model.description = JobDescription.model_validate_json(snap["description"])
    if snap.get("calibration"):
        c.model.restore(snap["calibration"])
    c.model.expose(time.monotonic(), len(plan.workers))
    c.emit(
        "taken_over",
        attempt=c.attempt,
        generation=generation,
        live=sorted(snap["live"]),
        resume_step=int(snap["resume_step"]),
    )
