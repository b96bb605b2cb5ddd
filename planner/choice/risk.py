"""What the layout a candidate leaves risks at the next failure.

A layout survives a failure in place as long as every layer keeps a holder: the reroute
or a re-partition takes over from the survivors. A failure that takes every holder of
some layer (a stage with one replica left and that worker lost, or all of a stage's
replicas on the node that fails) leaves nothing to recover from but the last checkpoint:
a restart, which costs its start-up and the work since that checkpoint. A plan that
keeps one fast pipeline takes that risk at every worker; one that keeps two copies of
every stage on two nodes takes none.

The next failure, in the planner's failure model (planner.job.failures): it hits a device of
the plan at random (D is over the plan's devices); a share of failures take its whole node
(network, host: 28% in Llama 3's cause mix, the prior, learned from the failures the run
sees) and the rest one worker (a GPU, a process). So the share of next failures that force
a restart is

    fatal = (1 - node_share) * (sole holders / W) + node_share * (workers on fatal nodes / W)

with W the plan's workers, and the next failure is expected to cost, beyond the in-place
recovery every layout pays alike,

    risk_s = fatal * (detection_s + restart_s + E[work since the checkpoint then])

where the work since the checkpoint is that of a Poisson arrival of mean D on checkpoints
every ``checkpoint_interval_s``, from where the interval stands (``expected_redo_s``).
planner.choice.selection charges it as it charges a transition: exp(-(transition + risk) / D).

One failure further: a failure that arrives while the recovery from the next one is still
under way (before the lost worker's layers have a second holder again) is fatal when it
takes the worker left holding them alone. With two replicas of every stage, a layout
that no single failure can wreck, each worker's loss leaves its partner the sole holder
until a spare has received the stage; on a cluster with D in hours that window is a
moment, but where failures come seconds apart (a soak, a failing rack) it is a real
share of them. For each worker w of the W, lost with probability 1/W, the window is
detection plus a recovery that copies w's stage to a new holder (its messages, a new
group, the copy; times the run's measured transition factor), T_w, and a second failure lands in it
with probability 1 - e^(-T_w / D); it is fatal when it hits one of w's partners (layers
whose two holders were w and one other) among the W - 1 left:

    follow_on = (1 - node_share) * sum_w (1/W) * (1 - e^(-T_w / D)) * partners_w / (W - 1)

charged as ``fatal`` is, at the same restart's cost (``risk_s``).
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

from planner.estimator.transition import build_s, protocol
from planner.job.cost import CostModel
from planner.job.failures import scope_shares
from planner.job.workload import Job
from planner.plans.matching import Transfer
from planner.plans.migration import transfer_s
from planner.plans.plan import Plan


@dataclass(frozen=True)
class Exposure:
    """Which losses of a plan force a restart."""

    workers: int
    sole_holders: tuple[int, ...]  # workers whose loss alone leaves a layer unheld
    fatal_nodes: tuple[int, ...]  # nodes whose loss leaves a layer unheld
    on_fatal_nodes: int  # the plan's workers on them

    def fatal_share(self, node_share: float | None = None) -> float:
        """The share of next failures that force a restart, when ``node_share`` of them
        take a whole node (default: Llama 3's mix)."""
        if not self.workers:
            return 0.0
        node = scope_shares()[1] if node_share is None else node_share
        share = (1 - node) * len(self.sole_holders) + node * self.on_fatal_nodes
        return min(1.0, share / self.workers)


def exposure(job: Job, plan: Plan) -> Exposure:
    key = ("exposure", job.cluster.devices_per_node, job.tp)  # what node_of depends on
    cached = plan.derived.get(key)
    if cached is None:
        cached = plan.derived[key] = _exposure(job, plan)
    return cached  # type: ignore[return-value]


def _exposure(job: Job, plan: Plan) -> Exposure:
    layers = plan.num_layers
    diff = [0] * (layers + 1)
    for s in plan.stages:
        diff[s.first_layer] += 1
        diff[s.end_layer] -= 1
    holders, running = [], 0
    for d in diff[:layers]:
        running += d
        holders.append(running)
    # sole[l]: layers below l held by one worker, so a stage holds one iff the count grows
    sole = [0]
    for h in holders:
        sole.append(sole[-1] + (h == 1))
    sole_holders = tuple(s.worker for s in plan.stages if sole[s.end_layer] > sole[s.first_layer])
    if job.cluster.devices_per_node == job.tp:
        # A node each (the 1,024 and 16,384 GPU configs): a node is fatal iff its one
        # worker is a sole holder (what the general case below finds, thousands of times
        # cheaper than grouping the stages by node).
        fatal = tuple(sorted(job.node_of(w) for w in sole_holders))
        return Exposure(len(plan.stages), sole_holders, fatal, len(fatal))

    by_node: dict[int, list] = {}
    for s in plan.stages:
        by_node.setdefault(job.node_of(s.worker), []).append(s)
    most_on_a_node = max((len(v) for v in by_node.values()), default=0)
    # Only a layer with no more holders than a node has workers can lose them all with it.
    thin = [layer for layer, h in enumerate(holders) if h <= most_on_a_node]
    fatal_nodes = []
    if thin:
        for node, stages in sorted(by_node.items()):
            local: dict[int, int] = {}
            for s in stages:
                lo, hi = (
                    bisect.bisect_left(thin, s.first_layer),
                    bisect.bisect_left(thin, s.end_layer),
                )
                for layer in thin[lo:hi]:
                    local[layer] = local.get(layer, 0) + 1
            if any(n == holders[layer] for layer, n in local.items()):
                fatal_nodes.append(node)
    on_fatal_nodes = sum(len(by_node[n]) for n in fatal_nodes)
    return Exposure(len(plan.stages), sole_holders, tuple(fatal_nodes), on_fatal_nodes)


@dataclass(frozen=True)
class Windows:
    """Per worker of a plan whose loss would leave some layer with one holder: how long
    until its layers have a second holder again, and how many workers are left sole
    holders meanwhile (module doc, "one failure further")."""

    workers: int
    windows: tuple[tuple[float, int], ...]  # (T_w seconds, partners_w)

    def follow_on_share(self, mtbf_s: float, node_share: float | None = None) -> float:
        """The share of next failures followed, inside their recovery, by a fatal one."""
        if not self.windows or self.workers < 2 or mtbf_s <= 0:
            return 0.0
        node = scope_shares()[1] if node_share is None else node_share
        total = sum(-math.expm1(-t / mtbf_s) * n for t, n in self.windows)
        return min(1.0, (1 - node) * total / (self.workers * (self.workers - 1)))


def windows(job: Job, plan: Plan) -> Windows:
    """Cached per plan for the ``job`` object it was computed with: every cost of the
    job (links, model, cluster) makes the windows, and hashing a whole job would cost
    more than the lookup saves (15 us on the 16,384-GPU config, per candidate scored)."""
    hit = plan.derived.get(("windows",))
    if hit is None or hit[0] is not job:  # type: ignore[index]
        hit = plan.derived[("windows",)] = (job, _windows(job, plan))
    return hit[1]  # type: ignore[index,return-value]


def _windows(job: Job, plan: Plan) -> Windows:
    # Most plans hold every layer three times or more: counted first (a difference array
    # over the stages), the holders are listed only where some layer has exactly two.
    diff = [0] * (plan.num_layers + 1)
    for s in plan.stages:
        diff[s.first_layer] += 1
        diff[s.end_layer] -= 1
    if 2 not in itertools.accumulate(diff):
        return Windows(len(plan.stages), ())
    holders: dict[int, list[int]] = {}
    for i, s in enumerate(plan.stages):
        for layer in range(s.first_layer, s.end_layer):
            holders.setdefault(layer, []).append(i)
    pairs = {layer: h for layer, h in holders.items() if len(h) == 2}
    if not pairs:
        return Windows(len(plan.stages), ())
    partners: dict[int, set[int]] = {}
    for a, b in pairs.values():
        partners.setdefault(a, set()).add(b)
        partners.setdefault(b, set()).add(a)
    costs = CostModel(job)
    c = job.cluster
    # A recovery that moves layers, its messages over the plan's workers (the same for
    # every w: computed once), then a new pair's group and the copy of w's stage.
    messages = protocol(job, plan, survivors=plan.workers, current=plan, moved=True).total_s
    out = []
    for i, others in partners.items():
        s = plan.stages[i]
        src = plan.stages[min(others)].worker
        copy = Transfer(src, s.worker, s.first_layer, s.end_layer,
                        costs.moved_bytes(s.first_layer, s.end_layer))  # fmt: skip
        work = messages + build_s(job, [frozenset({src, s.worker})]) + transfer_s(costs, copy)
        window = c.detection_s + c.transition_factor * work
        out.append((window, len(others)))
    return Windows(len(plan.stages), tuple(out))


def expected_redo_s(*, since_s: float, interval_s: float, mtbf_s: float) -> float:
    """E[work since the last checkpoint] at a failure arriving after T ~ Exp(mean D), with
    checkpoints every ``interval_s`` and ``since_s`` of the interval gone now.

    Before the next checkpoint (at a = interval - since, probability 1 - e^(-a/D)) it is
    since + E[T | T < a]; after it, by memorylessness, E[T mod interval] from 0."""
    if interval_s <= 0 or mtbf_s <= 0:
        return 0.0
    since_s = since_s % interval_s

    def truncated_mean(a: float) -> float:  # E[T | T < a]
        x = a / mtbf_s
        if x < 1e-9:
            return a / 2
        return mtbf_s - a * math.exp(-x) / -math.expm1(-x)

    a = interval_s - since_s
    before = -math.expm1(-a / mtbf_s)
    return before * (since_s + truncated_mean(a)) + (1 - before) * truncated_mean(interval_s)


def restart_share(job: Job, plan: Plan, *, mtbf_s: float, node_share: float | None) -> float:
    """The share of next failures that force a restart with ``plan``: by themselves
    (``Exposure``) or by a failure inside their recovery (``Windows``)."""
    return exposure(job, plan).fatal_share(node_share) + windows(job, plan).follow_on_share(
        mtbf_s, node_share
    )


def risk_s(
    job: Job,
    plan: Plan,
    *,
    mtbf_s: float,
    since_checkpoint_s: float,
    node_share: float | None = None,
) -> float:
    """What the next failure of ``plan`` is expected to cost beyond an in-place recovery
    (module doc). ``since_checkpoint_s``: the work since the checkpoint as the plan starts
    training (0 after a restart); ``node_share``: of failures, those that take a node."""
    fatal = restart_share(job, plan, mtbf_s=mtbf_s, node_share=node_share)
    if fatal == 0.0:
        return 0.0
    redo = expected_redo_s(
        since_s=since_checkpoint_s,
        interval_s=job.training.checkpoint_interval_s,
        mtbf_s=mtbf_s,
    )
    return fatal * (job.cluster.detection_s + job.cluster.restart_s + redo)
