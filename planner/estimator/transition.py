"""What a recovery in place pays in communicators: the groups it must build.

The runtime keeps every communicator that still works and builds only the ones it lacks;
this module says which those are, so that the transition the planner charges a policy is
the one the runtime will pay.

- point to point (activations, gradients, migrations): one group over the generation's
  members. A gloo group whose member died still carries point-to-point traffic between
  the others (measured on torch 2.13: pending operations with the dead member fail with
  "connection closed", sends and receives between survivors go on). So a new plan whose
  members all belong to the group in use keeps it, whatever the policy: a reroute or a
  re-partition over survivors builds nothing, and only a plan that takes in a worker
  outside the group (a replacement, a spare) builds a new one over all its members.
- ``exchange`` (chameleon_runtime's exact mode): buckets are summed point to point over
  that same group, so nothing else is built.
- ``ring`` (chameleon_runtime's default, and NCCL's or HCCL's collectives): a collective
  group per set of workers that sum a bucket together (the data-parallel groups). One
  whose holders all survive is kept (an aborted step's collectives are drained, so it is
  left settled: chameleon_runtime.comm), and the others are built. A reroute rebuilds
  nothing (the failed stage's survivors lose their group's dead member, and a stage held
  by one worker needs none); a re-partition builds every group whose holders changed.

The recovery protocol itself (launcher/recovery.py, chameleon_runtime/membership.py) costs
what its messages cost, phase by phase (``protocol``): a worker blocked in a store wait
is woken (the host's fitted wake-up wait, ``planner.plans.load.wake_s``, plus a round trip), the
leader's agent notices a report within half its poll period on average
(``RECOVERY_POLL_S``), and each store operation on the path is a round trip:

- collect: the abort to every member's mailbox, one wake-up, the ``Ready`` report, the
  poll, and the leader reading every report;
- plan: its three keys published, the moment the decision is made (the planner's thread
  wakes the leader's loop; the decision's own time is measured by the planner and added
  to it);
- confirm: one wake-up for the plan (read in two round trips), the ``groups`` agreement
  (the offer, the arrival, a wake-up, the others' offers), the ``migrated`` agreement
  (an arrival and a wake-up; held whether or not anything moved) and, where layers
  moved, the ``installed`` one, the ``Applied`` report.
  Each member trains again as it sends that report, and the phase ends for the job when
  the last one does (it says when: launcher/recovery.py); the leader may read the
  reports later, which costs the job nothing.

Building a group of n costs ``pg_init_base_s + pg_init_per_worker_s * n`` (every member
publishes its address and connects). A worker builds its groups one after another and
workers build theirs side by side, so the cost is the busiest worker's sum, plus the
store's share: one store serves every member's registration in turn, so rebuilding many
groups at once costs a round trip per member of each.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from planner.job.cost import CostModel
from planner.job.workload import Job
from planner.plans.load import busiest_host, wake_s
from planner.plans.plan import Plan
from planner.plans.program import buckets_of

# How often the leader's agent looks at its inbox while a recovery is under way
# (launcher/agent.py polls at it); the planner charges half of it per message the leader
# waits for.
RECOVERY_POLL_S = 0.005

Group = frozenset[int]


def collective_groups(job: Job, plan: Plan) -> set[Group]:
    """A ring's collective groups for ``plan``: one per set of bucket holders (module
    doc); none for an exchange."""
    if job.cluster.allreduce == "exchange":
        return set()
    return {frozenset(b.holders) for b in buckets_of(plan, job.model.layer_params)}


def plan_groups(job: Job, plan: Plan) -> set[Group]:
    """The communicators the runtime uses for ``plan`` (module doc)."""
    return {frozenset(plan.workers)} | collective_groups(job, plan)


def groups_to_build(
    job: Job, current: Plan, new: Plan, failed: Collection[int], *, members: Iterable[int] = ()
) -> list[Group]:
    """Groups of ``new`` that the current generation does not already have intact.
    ``members``: every worker the new generation involves beyond the plan's (transfer
    sources that hold no stage any more)."""
    lost = set(failed)
    everyone = frozenset(new.workers) | frozenset(members)
    build = [] if everyone <= frozenset(current.workers) else [everyone]
    kept = {g for g in collective_groups(job, current) if not g & lost}
    return build + sorted(
        (g for g in collective_groups(job, new) if g not in kept), key=lambda g: sorted(g)
    )


def build_s(job: Job, groups: Iterable[Group]) -> float:
    """Time to build ``groups``: the busiest worker's groups one after another, plus a
    store round trip per member of each (module doc)."""
    cluster = job.cluster
    busy: dict[int, float] = {}
    registrations = 0
    for group in groups:
        cost = cluster.pg_init_base_s + cluster.pg_init_per_worker_s * len(group)
        registrations += len(group)
        for w in group:
            busy[w] = busy.get(w, 0.0) + cost
    return max(busy.values(), default=0.0) + registrations * cluster.store_round_trip_s


def groups_s(
    job: Job, current: Plan, new: Plan, failed: Collection[int], *, members: Iterable[int] = ()
) -> float:
    return build_s(job, groups_to_build(job, current, new, failed, members=members))


@dataclass(frozen=True)
class Protocol:
    """The recovery protocol's own time per phase, beside the decision, the groups and
    the migration (module doc)."""

    collect_s: float
    plan_s: float
    confirm_s: float
    agreement_s: float  # one all-or-none agreement (part of confirm's)
    after_moves_s: float  # the agreements that follow the transfers (part of confirm's)

    @property
    def total_s(self) -> float:
        return self.collect_s + self.plan_s + self.confirm_s


def plan_phase_s(job: Job, decision_s: float) -> float:
    """The plan phase of a recovery whose decision took ``decision_s``: the planner's
    thread wakes the leader's loop the moment it is done (launcher/planning.py), which
    publishes its three keys. (A candidate's ``Protocol.plan_s`` charges the keys alone:
    the decision's own time is not known before it is made.)"""
    return decision_s + 3 * job.cluster.store_round_trip_s


def protocol(
    job: Job,
    new: Plan,
    *,
    survivors: Collection[int],
    members: Iterable[int] = (),
    current: Plan | None = None,
    moved: bool = False,
) -> Protocol:
    """What the protocol's messages cost for a recovery of the live ``survivors`` into
    ``new`` (``members``: transfer sources beyond its workers; module doc). Wake-ups in
    collect wait behind every survivor; in confirm, behind the new generation's members
    (a worker the plan leaves out blocks, idle). With ``current`` (the plan the failure
    hit), collect also waits for the survivors to finish the pass each is in. ``moved``:
    layers move, so the members agree once more once installed."""
    joined = set(new.workers) | set(members)
    rt = job.cluster.store_round_trip_s
    # The leader notices the Ready reports within half its poll, then reads every one.
    reports = RECOVERY_POLL_S / 2 + (len(survivors) + 1) * rt
    wake_collect = wake_s(job, survivors) + rt
    wake = wake_s(job, joined) + rt
    agreement = rt + wake
    busy = in_pass_s(job, current, survivors) if current is not None else 0.0
    after_moves = agreement * (2 if moved else 1)
    return Protocol(
        collect_s=len(survivors) * rt + max(wake_collect, busy) + rt + reports,
        plan_s=3 * rt,
        confirm_s=wake + 2 * rt + (2 * rt + agreement) + after_moves + rt,
        agreement_s=agreement,
        after_moves_s=after_moves,
    )


def in_pass_s(job: Job, current: Plan, survivors: Collection[int]) -> float:
    """How long the last of ``survivors`` takes to finish the pass it is in when the
    abort comes: a worker notices it only between operations (a blocked receive is
    interrupted, a running pass is not). A failure lands at a uniform point of each
    survivor's pass, so the last of k finishes k / (k + 1) of a mean pass later. On a
    host whose workers share its cores a pass runs at the share every runnable worker
    gets."""
    costs = CostModel(job)
    ranges = {s.worker: (s.first_layer, s.end_layer) for s in current.stages}
    per_range: dict[tuple[tuple[int, int], float], float] = {}  # (thousands share a few)
    passes = []
    for w in survivors:
        if w in ranges:
            key = (ranges[w], job.slowdown(w))
            mean = per_range.get(key)
            if mean is None:
                mean = per_range[key] = (
                    costs.forward_s(*ranges[w], w) + costs.backward_s(*ranges[w], w)
                ) / 2
            passes.append(mean)
    if not passes:
        return 0.0
    k = len(passes)
    mean = sum(passes) / k
    cores = job.cluster.host_cores
    if cores:
        mean *= max(1.0, busiest_host(job, current) / cores)
    return k / (k + 1) * mean
