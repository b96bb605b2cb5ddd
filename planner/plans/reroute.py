"""Data rerouting (PAPER.md; ReCycle): keep every surviving worker's layers where they are
and send a failed worker's micro-batches through its same-stage peers in other pipelines.

A peer is a surviving worker that holds exactly the failed worker's layer range. Each
rerouted micro-batch goes to the peer with the least work so far, which spreads F failed
replicas' work evenly over the N_dp - F survivors: the hottest stage then runs
m * N_dp / (N_dp - F) micro-batches. No weights move. It works on any current plan,
including one already rerouted, so a second failure reroutes again.

Among equally loaded peers, one whose routes are the least loaded goes first (then the
lower worker): a second failure elsewhere is served by pipelines that serve no one yet,
so each broken pipeline and its peers stay a small group apart from the others (their
steps do not wait on each other's extra work), and the choice follows the plan's
structure rather than worker ids wherever the structure decides (planner.simulation.symmetry asks
a reroute under other names and gets the same answer, renamed).
"""

from __future__ import annotations

from collections.abc import Iterable

from planner.plans.plan import Plan, Route, unchecked_plan
from planner.plans.program import position_in_home


class RerouteInfeasible(ValueError):
    pass


def reroute_plan(plan: Plan, failed: Iterable[int], *, validate: bool = True) -> Plan:
    """``plan`` with ``failed``'s micro-batches sent through same-stage peers (module
    doc). ``validate=False``: the result is not checked again, for a caller that makes
    thousands and whose input was valid (the simulator): it is valid by construction
    (the survivors' stages are the plan's, each new hop holds the lost one's layers, and
    every micro-batch keeps exactly one route; tests/test_reroute.py validates chains of
    reroutes)."""
    lost = set(failed)
    survivors = tuple(s for s in plan.stages if s.worker not in lost)
    peers: dict[tuple[int, int], list[int]] = {}
    for s in survivors:
        peers.setdefault((s.first_layer, s.end_layer), []).append(s.worker)
    for s in plan.stages:
        if s.worker in lost and (s.first_layer, s.end_layer) not in peers:
            raise RerouteInfeasible(
                f"layers {s.first_layer}..{s.end_layer - 1} lost every replica "
                f"(worker {s.worker} had no surviving peer)"
            )
    load = {w: 0 for w in (s.worker for s in survivors)}
    intact = [r for r in plan.routes if not lost.intersection(r.hops)]
    for route in intact:
        n = len(route.micro_batches)
        for w in route.hops:
            load[w] += n
    # Each survivor's busiest route: the most work on any worker of a route through it.
    busiest = dict.fromkeys(load, 0)
    for route in intact:
        peak = max(map(load.__getitem__, route.hops))
        for w in route.hops:
            if busiest[w] < peak:
                busiest[w] = peak
    stage_of = plan.stage_of
    position = position_in_home(plan)
    broken = [
        (position[mb], route.home, mb, route.hops)
        for route in plan.routes
        if lost.intersection(route.hops)
        for mb in route.micro_batches
    ]
    # Interleave broken pipelines' micro-batches by position, so early ones go first.
    new_routes: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for _q, home, mb, hops in sorted(broken):
        new_hops = []
        for w in hops:
            if w in lost:
                stage = stage_of[w]
                w = min(
                    peers[(stage.first_layer, stage.end_layer)],
                    key=lambda p: (load[p], busiest[p], p),
                )
            new_hops.append(w)
        for w in new_hops:
            load[w] += 1
        new_routes.setdefault((home, tuple(new_hops)), []).append(mb)
    routes = list(intact)
    routes.extend(Route(home, hops, tuple(mbs)) for (home, hops), mbs in new_routes.items())
    routes.sort(key=lambda r: (r.home, r.micro_batches[:1]))
    fields = dict(
        num_layers=plan.num_layers,
        num_micro_batches=plan.num_micro_batches,
        stages=survivors,
        routes=tuple(routes),
        pipelines=tuple(p for p in plan.pipelines if not lost.intersection(p)),
    )
    return Plan(**fields) if validate else unchecked_plan(**fields)
