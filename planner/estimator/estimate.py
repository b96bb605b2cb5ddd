"""Time and memory of one plan: the estimator of PAPER.md, as one pure function.

``estimate(job, plan)`` times the plan's step graph (``planner.plans.program`` builds the same
per-worker sequences the runtime executes) and sizes every worker's memory from it: the
in-flight count is read off that same sequence. A plan over any worker's memory is
infeasible, and the estimate says which worker and by how many bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.estimator.sharing import simulate_shared
from planner.estimator.timing import finish_step, simulate_pipeline
from planner.estimator.wavefront import time_routes
from planner.job.cost import CostModel
from planner.job.workload import Job
from planner.plans.load import at_load
from planner.plans.plan import Plan, Route
from planner.plans.program import (
    Allreduce,
    Bucket,
    StepProgram,
    bucket_split,
    buckets_of,
    build_program,
    norm_owners,
    position_in_home,
    tie_rank,
)


@dataclass(frozen=True)
class Overflow:
    worker: int
    need_bytes: int
    limit_bytes: int

    @property
    def over_bytes(self) -> int:
        return self.need_bytes - self.limit_bytes


@dataclass(frozen=True)
class Estimate:
    plan: Plan
    step_s: float
    memory_bytes: dict[int, int]  # peak per worker
    in_flight: dict[int, int]  # most micro-batches stashed at once, per worker
    limit_bytes: int

    @property
    def peak_memory_bytes(self) -> int:
        return max(self.memory_bytes.values(), default=0)

    @property
    def overflow(self) -> Overflow | None:
        """The worker furthest over its memory, if any."""
        worst = max(self.memory_bytes.items(), key=lambda kv: (kv[1], -kv[0]), default=None)
        if worst is None or worst[1] <= self.limit_bytes:
            return None
        return Overflow(worker=worst[0], need_bytes=worst[1], limit_bytes=self.limit_bytes)

    @property
    def feasible(self) -> bool:
        return self.overflow is None


Memo = dict[tuple, tuple[list[float], list[int]]]


def estimate(job: Job, plan: Plan, *, memo: Memo | None = None) -> Estimate:
    """Time and memory of ``plan``. ``memo`` may be shared by estimates of one job: it
    holds the timing of each distinct pipeline, which plans of one search share."""
    job, load = at_load(job, plan)  # a shared host at this plan's load (planner.plans.load)
    if memo is not None and load is not None:
        memo = memo.setdefault(("load", load), {})  # type: ignore[assignment]
    costs = CostModel(job)
    ranges = {s.worker: (s.first_layer, s.end_layer) for s in plan.stages}
    ring = job.cluster.allreduce == "ring"
    buckets = job_buckets(job, plan)
    if job.cluster.host_cores:
        # The whole program is simulated there; its in-flight counts are read off it.
        program = job_program(job, plan)
        step_s = shared_host_step_s(job, plan, costs, program)
        in_flight = {w.worker: w.max_in_flight for w in program.workers}
    else:
        compute_end, in_flight = _compute_phase(
            job, plan, costs, ranges, {} if memo is None else memo
        )
        owners = set(norm_owners(plan)) if job.training.global_norm else None
        step_s = finish_step(
            compute_end, buckets, ranges, costs, plan.num_layers, owners, ring=ring
        ).step_s
    exchange: dict[int, int] = {}
    for b in () if ring else buckets:  # a ring sums in the gradients' own buffers
        need = costs.exchange_bytes(len(b.holders), b.first_layer, b.end_layer)
        for h in b.holders:
            exchange[h] = max(exchange.get(h, 0), need)
    # Thousands of workers, a few distinct (range, in flight, exchange): size each once.
    sized: dict[tuple[int, int, int, int], int] = {}
    memory = {}
    for w, (first, end) in ranges.items():
        key = (first, end, in_flight.get(w, 0), exchange.get(w, 0))
        need = sized.get(key)
        if need is None:
            need = sized[key] = costs.memory_bytes(*key)
        memory[w] = need
    shards = job.training.shards
    for group in plan.replica_groups:  # re-sharded over fewer: a larger share each
        if 0 < len(group) < shards:
            for w in group:
                first, end = ranges[w]
                memory[w] += costs.state_bytes(first, end) * (shards - len(group)) // len(group)
    return Estimate(
        plan=plan,
        step_s=step_s,
        memory_bytes=memory,
        in_flight=in_flight,
        limit_bytes=job.worker_memory_bytes,
    )


def job_program(job: Job, plan: Plan) -> StepProgram:
    """``plan``'s step program as ``job``'s runtime runs it (its all-reduce, gradient
    dtype and global norm)."""
    return build_program(
        plan, job.model.layer_params, global_norm=job.training.global_norm,
        allreduce=_allreduce(job), grad_bytes=job.training.grad_bytes,
    )  # fmt: skip


def job_buckets(job: Job, plan: Plan) -> tuple[Bucket, ...]:
    """The buckets of ``job_program``."""
    split = bucket_split(_allreduce(job), job.training.grad_bytes)
    return buckets_of(plan, job.model.layer_params, split=split)


def _allreduce(job: Job) -> Allreduce:
    return "exchange" if job.cluster.allreduce == "exchange" else "ring"


def shared_host_step_s(job: Job, plan: Plan, costs: CostModel, program: StepProgram) -> float:
    """On hosts whose workers share CPU cores: ``plan``'s step program run with each
    host's runnable workers sharing its cores (planner.estimator.sharing)."""
    assert job.cluster.host_cores
    return simulate_shared(
        program,
        costs,
        cores=job.cluster.host_cores,
        host_of={w.worker: job.host_of(w.worker) for w in program.workers},
        own_cpu_s=runtime_cpu_s(job, plan, costs),
    )


def runtime_cpu_s(
    job: Job, plan: Plan, costs: CostModel, ranges: dict[int, tuple[int, int]] | None = None
) -> dict[int, float]:
    """Each worker's CPU per step beyond its passes and optimizer, on a shared host: a
    base, each message, each byte messaged, each parameter's share of the tail."""
    cluster = job.cluster
    if ranges is None:
        ranges = {s.worker: (s.first_layer, s.end_layer) for s in plan.stages}
    ops = (
        message_ops(plan, job.model.layer_params, cluster.allreduce)
        if cluster.message_cpu_s
        else {}
    )
    sent = message_bytes(plan, costs, ranges) if cluster.message_cpu_s_per_byte else {}
    return {
        w: cluster.worker_overhead_s
        + cluster.message_cpu_s * ops.get(w, 0)
        + cluster.message_cpu_s_per_byte * sent.get(w, 0)
        + cluster.tail_cpu_s_per_param * job.model.total("num_params", first, end)
        for w, (first, end) in ranges.items()
    }


def message_ops(
    plan: Plan, layer_params: Sequence[int], allreduce: str = "exchange"
) -> dict[int, int]:
    """Sends and receives per worker in one step: activations and their gradients along
    every route, and each bucket's exchange with its other holders (a ring's all-reduce
    among n: a send and a receive in each of its 2(n - 1) steps)."""
    ops: dict[int, int] = {}
    for route in plan.routes:
        n, m = len(route.hops), len(route.micro_batches)
        for k, w in enumerate(route.hops):
            neighbours = (k > 0) + (k < n - 1)
            ops[w] = ops.get(w, 0) + 2 * neighbours * m
    per_peer = 4 if allreduce == "ring" else 2
    for bucket in buckets_of(plan, layer_params):
        for w in bucket.holders:
            ops[w] = ops.get(w, 0) + per_peer * (len(bucket.holders) - 1)
    return ops


def message_bytes(
    plan: Plan, costs: CostModel, ranges: dict[int, tuple[int, int]]
) -> dict[int, int]:
    """Bytes each worker sends and receives in one step, the messages of ``message_ops``:
    an activation and its gradient across each boundary per micro-batch, a bucket's
    gradient sums to and from each other holder (a ring's: 2(n - 1)/n of the bucket each
    way)."""
    sent: dict[int, int] = {}
    for route in plan.routes:
        n, m = len(route.hops), len(route.micro_batches)
        for k, w in enumerate(route.hops):
            first, end = ranges[w]
            edge = (costs.boundary_bytes(first) if k > 0 else 0) + (
                costs.boundary_bytes(end) if k < n - 1 else 0
            )
            sent[w] = sent.get(w, 0) + 2 * edge * m
    training = costs.job.training
    ring = costs.job.cluster.allreduce == "ring"
    for bucket in buckets_of(plan, costs.job.model.layer_params):
        size = costs.job.model.total("num_params", bucket.first_layer, bucket.end_layer)
        n = len(bucket.holders)
        both_ways = 2 * (n - 1) * size * training.grad_bytes
        for w in bucket.holders:
            sent[w] = sent.get(w, 0) + (both_ways * 2 // n if ring else both_ways)
    return sent


def micro_batches_of(plan: Plan) -> dict[int, int]:
    """Micro-batches through each worker in one step (a forward and a backward pass each)."""
    through: dict[int, int] = {}
    for route in plan.routes:
        for w in route.hops:
            through[w] = through.get(w, 0) + len(route.micro_batches)
    return through


def worker_compute_s(
    plan: Plan, costs: CostModel, ranges: dict[int, tuple[int, int]] | None = None
) -> dict[int, float]:
    """Each worker's compute in one step: every pass of its micro-batches, and its
    optimizer update."""
    if ranges is None:
        ranges = {s.worker: (s.first_layer, s.end_layer) for s in plan.stages}
    through = micro_batches_of(plan)
    return {
        w: through.get(w, 0) * (costs.forward_s(first, end, w) + costs.backward_s(first, end, w))
        + costs.optimizer_s(first, end, w)
        for w, (first, end) in ranges.items()
    }


def _compute_phase(
    job: Job, plan: Plan, costs: CostModel, ranges: dict[int, tuple[int, int]], cache: Memo
) -> tuple[dict[int, float], dict[int, int]]:
    """Forward/backward phase of the step graph, timed once per distinct pipeline.

    Workers only wait on workers they share a route with, so the graph falls apart into
    components. A component that is one whole pipeline (one route, nobody else's workers)
    times the same as any other with the same layer ranges, micro-batch positions and
    node boundaries, so at 16k workers the 2,047 pipelines cost a handful of simulations.
    Rerouted pipelines and their peers form one component, timed together level by
    level (planner.estimator.wavefront).
    """
    position, rank = position_in_home(plan), tie_rank(plan)
    components = _components(plan)
    node_of = job.node_of
    compute_end: dict[int, float] = {}
    in_flight: dict[int, int] = {}
    for routes in components:
        if len(routes) == 1:
            hops = routes[0].hops
            nodes = [node_of(w) for w in hops]
            key = (
                tuple(ranges[w] for w in hops),
                tuple(position[mb] for mb in routes[0].micro_batches),
                tuple(a == b for a, b in zip(nodes, nodes[1:], strict=False)),
                tuple(job.slowdown(w) for w in hops) if job.slow else (),
            )
            if key not in cache:
                cache[key] = _time_pipeline(routes[0], position, rank, ranges, costs)
            ends, peaks = cache[key]
            compute_end.update(zip(hops, ends, strict=True))
            in_flight.update(zip(hops, peaks, strict=True))
        else:
            workers = sorted({w for r in routes for w in r.hops})
            ends, peaks = time_routes(routes, position, rank, ranges, costs, workers)
            compute_end.update(zip(workers, ends, strict=True))
            in_flight.update(zip(workers, peaks, strict=True))
    return compute_end, in_flight


def _time_pipeline(
    route: Route,
    position: dict[int, int],
    rank: dict[int, int],
    ranges: dict[int, tuple[int, int]],
    costs: CostModel,
) -> tuple[list[float], list[int]]:
    """A pipeline alone, on the phi-grid fast path when it runs its micro-batches in
    order from position 0 (always, unless rerouting left it a non-prefix share)."""
    hops, m = route.hops, len(route.micro_batches)
    if [position[mb] for mb in route.micro_batches] != list(range(m)):
        return time_routes([route], position, rank, ranges, costs, hops)
    p = len(hops)
    fwd = [costs.forward_s(*ranges[w], w) for w in hops]
    bwd = [costs.backward_s(*ranges[w], w) for w in hops]
    fwd_comm = [0.0] + [
        costs.transfer_s(hops[k - 1], hops[k], costs.boundary_bytes(ranges[hops[k]][0]))
        for k in range(1, p)
    ]
    bwd_comm = [
        costs.transfer_s(hops[k + 1], hops[k], costs.boundary_bytes(ranges[hops[k]][1]))
        for k in range(p - 1)
    ] + [0.0]
    ends = simulate_pipeline(fwd, bwd, fwd_comm, bwd_comm, m) if m else [0.0] * p
    return ends, [min(p - k, m) for k in range(p)]


def _components(plan: Plan) -> list[list[Route]]:
    """Routes grouped by the workers they share, each group in route order and the groups
    in the order of their first route (union-find over routes, every root the lowest
    route of its group)."""
    routes = plan.routes
    hops = [w for route in routes for w in route.hops]
    if len(hops) == len(set(hops)):  # no worker on two routes (no rerouting): one each
        return [[route] for route in routes]
    parent = list(range(len(routes)))
    route_of: dict[int, int] = {}  # per worker: a route through it, kept near its root
    for i, route in enumerate(routes):
        root = i  # of this route's component so far
        for w in route.hops:
            j = route_of.setdefault(w, i)
            if j == i:
                continue
            while parent[j] != j:
                j = parent[j]
            route_of[w] = j
            if j < root:
                parent[root] = root = j
            elif j > root:
                parent[j] = root
    groups: dict[int, list[Route]] = {}
    for i, route in enumerate(routes):
        j = i
        while parent[j] != j:
            j = parent[j]
        parent[i] = j
        groups.setdefault(j, []).append(route)
    return list(groups.values())
