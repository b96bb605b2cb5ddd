"""Step time: the longest path through the step's operation graph (PAPER.md, estimator).

end(op) = max(end(predecessors)) + duration(op), where an op's predecessors are the op
before it on the same worker and, for a pass that needs remote input, the transfer of that
input (which itself follows the pass that produced it). The walk is event driven: each
worker advances through its program until it needs an input not yet produced and is woken
when it is. Every op is visited once, so a 16k-worker step takes well under a second.

A program whose workers wait on each other in a cycle would deadlock at run time; here it
raises ``ScheduleDeadlock`` naming the stuck ops, so no such plan is ever handed out.

``simulate`` walks every worker's whole program, tail included (planner.plans.program: each
bucket's exchange once all its holders reach it, or a ring's all-reduce once every holder
has launched it in its last backward and is done with its previous one, the commit once
every worker does, the store operations of the loss, the optimizer). ``estimate`` takes
two fast paths over the same graph, tests hold them equal: ``simulate_pipeline`` for
whole pipelines and ``finish_step``, which visits the buckets in the one order every tail
follows ((round, index) for an exchange, from the top layer down for a ring).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from planner.job.cost import CostModel
from planner.plans.program import Bucket, ComputeOp, OpKind, StepProgram, TailKind, TailOp


class ScheduleDeadlock(RuntimeError):
    pass


@dataclass(frozen=True)
class Timing:
    step_s: float
    compute_end_s: dict[int, float]  # when each worker finished its last pass
    allreduce_end_s: dict[int, float]  # when each worker finished its last all-reduce
    commit_end_s: float


_F = OpKind.FORWARD
_B = OpKind.BACKWARD


def simulate(program: StepProgram, costs: CostModel) -> Timing:
    """Time a whole step program."""
    ranges = {w.worker: (w.first_layer, w.end_layer) for w in program.workers}
    compute_end = simulate_compute({w.worker: w.ops for w in program.workers}, ranges, costs)
    return simulate_tails(compute_end, {w.worker: w.tail for w in program.workers}, ranges, costs)


def simulate_tails(
    compute_end: Mapping[int, float],
    tails: Mapping[int, Sequence[TailOp]],
    ranges: Mapping[int, tuple[int, int]],
    costs: CostModel,
) -> Timing:
    """Every worker's tail from the end of its passes: an exchange ends when the last of
    its holders reaches it plus its duration; a ring's all-reduce when the last holder
    has it ready (in its last backward) and is done with its previous one, plus its
    duration; the commit when the last worker arrives plus its own; the rest runs on the
    worker alone."""
    t = {w: compute_end.get(w, 0.0) for w in tails}
    comm_free = dict.fromkeys(tails, 0.0)  # a ring's: when each one's last all-reduce ended
    cursor = dict.fromkeys(tails, 0)
    arrived: dict[object, dict[int, float]] = {}
    allreduce_end: dict[int, float] = {}
    commit_end = 0.0
    everyone = tuple(tails)
    moved = True
    while moved:
        moved = False
        for w in everyone:
            tail = tails[w]
            while cursor[w] < len(tail):
                kind, bucket = tail[cursor[w]]
                if kind is TailKind.ALLREDUCE:
                    assert bucket is not None
                    here = arrived.setdefault(bucket.index, {})
                    ready = costs.bucket_ready_s(
                        compute_end.get(w, 0.0), ranges[w][0], bucket.first_layer, w
                    )
                    here[w] = max(ready, comm_free[w])
                    if len(here) < len(bucket.holders):
                        break
                    end = max(here.values()) + costs.allreduce_s(
                        bucket.holders, bucket.first_layer, bucket.end_layer
                    )
                    for h in bucket.holders:
                        comm_free[h] = end
                        t[h] = max(t[h], end)
                        cursor[h] += 1
                elif kind is TailKind.EXCHANGE or kind is TailKind.COMMIT:
                    assert bucket is not None or kind is TailKind.COMMIT
                    key, group = (bucket.index, bucket.holders) if bucket else ("commit", everyone)
                    here = arrived.setdefault(key, {})
                    here[w] = t[w]
                    if len(here) < len(group):
                        break
                    if bucket is not None:
                        end = max(here.values()) + costs.allreduce_s(
                            bucket.holders, bucket.first_layer, bucket.end_layer
                        )
                    else:
                        end = commit_end = max(here.values()) + costs.commit_s(len(group))
                    for h in group:
                        t[h] = end
                        cursor[h] += 1
                else:
                    if kind is TailKind.ROUND:
                        allreduce_end[w] = t[w]
                    t[w] += _local_s(kind, ranges[w], costs, w)
                    cursor[w] += 1
                moved = True
    stuck = [w for w in everyone if cursor[w] < len(tails[w])]
    if stuck:
        sample = ", ".join(f"worker {w} at {tails[w][cursor[w]].kind.value}" for w in stuck[:4])
        raise ScheduleDeadlock(f"{len(stuck)} workers wait on each other: {sample}")
    return Timing(
        step_s=max(t.values(), default=0.0),
        compute_end_s=dict(compute_end),
        allreduce_end_s=allreduce_end,
        commit_end_s=commit_end,
    )


_STORE_OPS = frozenset(
    (TailKind.REPORT_LOSS, TailKind.READ_LOSS, TailKind.REPORT_NORM, TailKind.READ_NORM)
)


def _local_s(kind: TailKind, layers: tuple[int, int], costs: CostModel, worker: int) -> float:
    """A tail operation a worker runs alone. Rounding the gradients is CPU beyond the
    layers: on shared hosts the fitted per-worker overhead holds it (planner.estimator.fit). A
    ring's READ_NORM reads its commit's sum: no store operation."""
    if kind is TailKind.OPTIMIZE:
        return costs.optimizer_s(*layers, worker)
    if kind in _STORE_OPS and costs.job.cluster.allreduce == "exchange":
        return costs.store_s()
    return 0.0


def simulate_compute(
    ops_of: Mapping[int, Sequence[ComputeOp]],
    ranges: Mapping[int, tuple[int, int]],
    costs: CostModel,
) -> dict[int, float]:
    """When each worker finishes its last forward/backward pass (from step start).

    ``ops_of`` may be any closed group of workers: every peer an op names must be in it.
    """
    fwd_s = {w: costs.forward_s(*r, w) for w, r in ranges.items()}
    bwd_s = {w: costs.backward_s(*r, w) for w, r in ranges.items()}
    # A forward on worker w receives the output of the layer before its first layer; a
    # backward receives the gradient of its own last output.
    recv_fwd_bytes = {w: costs.boundary_bytes(r[0]) for w, r in ranges.items()}
    recv_bwd_bytes = {w: costs.boundary_bytes(r[1]) for w, r in ranges.items()}
    link_s: dict[tuple[int, int, int], float] = {}

    def transfer(src: int, dst: int, num_bytes: int) -> float:
        key = (src, dst, num_bytes)
        value = link_s.get(key)
        if value is None:
            value = link_s[key] = costs.transfer_s(src, dst, num_bytes)
        return value

    # (worker, kind, micro-batch) packed into one int: dict lookups on ints are the
    # cheapest thing Python has, and this loop runs once per op of a 16k-worker step.
    stride = 1 + max((op.micro_batch for ops in ops_of.values() for op in ops), default=0)

    done: dict[int, float] = {}
    waiting: dict[int, list[int]] = {}
    cursor = dict.fromkeys(ops_of, 0)
    free_at = dict.fromkeys(ops_of, 0.0)
    ready = list(ops_of)
    while ready:
        worker = ready.pop()
        ops = ops_of[worker]
        i = cursor[worker]
        t = free_at[worker]
        f_s, b_s = fwd_s[worker], bwd_s[worker]
        own_f, own_b = 2 * worker * stride, (2 * worker + 1) * stride
        while i < len(ops):
            kind, mb, prev, nxt = ops[i]
            if kind is _F:
                if prev is not None:
                    needed = 2 * prev * stride + mb
                    produced = done.get(needed)
                    if produced is None:
                        waiting.setdefault(needed, []).append(worker)
                        break
                    arrive = produced + transfer(prev, worker, recv_fwd_bytes[worker])
                    if arrive > t:
                        t = arrive
                t += f_s
                mine = own_f + mb
            else:
                if nxt is not None:  # else our own forward of it came earlier in order
                    needed = (2 * nxt + 1) * stride + mb
                    produced = done.get(needed)
                    if produced is None:
                        waiting.setdefault(needed, []).append(worker)
                        break
                    arrive = produced + transfer(nxt, worker, recv_bwd_bytes[worker])
                    if arrive > t:
                        t = arrive
                t += b_s
                mine = own_b + mb
            done[mine] = t
            woken = waiting.pop(mine, None)
            if woken:
                ready.extend(woken)
            i += 1
        cursor[worker] = i
        free_at[worker] = t

    stuck = [w for w, ops in ops_of.items() if cursor[w] < len(ops)]
    if stuck:
        sample = ", ".join(
            f"worker {w} at {ops_of[w][cursor[w]].kind.value}{ops_of[w][cursor[w]].micro_batch}"
            for w in stuck[:4]
        )
        raise ScheduleDeadlock(f"{len(stuck)} workers wait on each other: {sample}")
    return free_at


def finish_step(
    compute_end: Mapping[int, float],
    buckets: Sequence[Bucket],
    ranges: Mapping[int, tuple[int, int]],
    costs: CostModel,
    num_layers: int,
    norm_owners: Collection[int] | None = None,
    *,
    ring: bool = False,
) -> Timing:
    """``simulate_tails`` of the tails ``planner.plans.program.tail_of`` makes, without making
    them: the buckets in the order every tail has them in ((round, index), or for a
    ``ring`` from the top layer down, each from when its holders have it ready), then the
    last stages' loss (and, clipping, ``norm_owners``' squared norms), the commit, (the
    norms read back,) the optimizer and the loss read back."""
    comm_free = {w: compute_end.get(w, 0.0) for w in ranges}
    if ring:
        link_free = dict.fromkeys(ranges, 0.0)
        # A bucket is ready on its holders at the latest of their backwards' ends less
        # the layers below it. Among holders of one first layer and one speed that is the
        # one whose backward ended last (readiness grows with the end): each bucket's
        # readiness is the latest over those few, found once per holder set (the same
        # max, so the same bits; a rerouted plan's holders end at thousands of moments).
        distinct: dict[tuple[int, ...], list[tuple[float, int, int]]] = {}
        slowdown = costs.job.slowdown
        for bucket in sorted(buckets, key=lambda b: -b.first_layer):
            holders = bucket.holders
            moments = distinct.get(holders)
            if moments is None:
                latest: dict[tuple[int, float], tuple[float, int]] = {}
                for h in holders:
                    ce, kind = compute_end.get(h, 0.0), (ranges[h][0], slowdown(h))
                    seen = latest.get(kind)
                    if seen is None or ce > seen[0]:
                        latest[kind] = (ce, h)
                moments = distinct[holders] = [
                    (ce, first, h) for (first, _), (ce, h) in latest.items()
                ]
            ready = max(
                costs.bucket_ready_s(ce, first, bucket.first_layer, h) for ce, first, h in moments
            )
            start = max(ready, max(map(link_free.__getitem__, holders)))
            end = start + costs.allreduce_s(holders, bucket.first_layer, bucket.end_layer)
            link_free.update(dict.fromkeys(holders, end))
        # (each holder's ends only grow: its last is its latest)
        for w, free in link_free.items():
            if free > comm_free[w]:
                comm_free[w] = free
    for bucket in () if ring else sorted(buckets, key=lambda b: (b.round, b.index)):
        start = max(comm_free[h] for h in bucket.holders)
        end = start + costs.allreduce_s(bucket.holders, bucket.first_layer, bucket.end_layer)
        for h in bucket.holders:
            comm_free[h] = end
    # exchange: the loss and the norms through the store (a ring's commit sums them)
    store = 0.0 if ring else costs.store_s()
    owners = norm_owners if norm_owners is not None else ()
    reported = (
        t + store * ((ranges[w][1] == num_layers) + (w in owners)) for w, t in comm_free.items()
    )
    commit_end = max(reported, default=0.0) + costs.commit_s(len(ranges))
    after = store * (1 + (norm_owners is not None))  # the loss read, the norms read
    if costs.job.slow:  # a slow worker's update is slower than its range's
        optimize = [costs.optimizer_s(*r, w) for w, r in ranges.items()]
    else:  # over distinct layer ranges: thousands of workers share a few
        optimize = [costs.optimizer_s(*r) for r in set(ranges.values())]
    step = max((commit_end + s + after for s in optimize), default=commit_end)
    return Timing(
        step_s=step,
        compute_end_s=dict(compute_end),
        allreduce_end_s=comm_free,
        commit_end_s=commit_end,
    )


def simulate_pipeline(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    forward_comm_s: Sequence[float],
    backward_comm_s: Sequence[float],
    num_micro_batches: int,
) -> list[float]:
    """``simulate_compute`` for one pipeline running its own micro-batches 0..m-1 alone.

    Same graph, same answer (tests hold the two equal), without the event queue: every
    dependency between workers raises phi by exactly one and every worker runs its ops in
    increasing phi (``planner.plans.program``), so visiting ops in increasing phi is a
    topological order. forward_comm_s[k] is the transfer into stage k, backward_comm_s[k]
    the gradient transfer out of stage k + 1 into stage k. Returns each stage's end time.
    """
    p, m = len(forward_s), num_micro_batches
    fwd = [[0.0] * m for _ in range(p)]
    bwd = [[0.0] * m for _ in range(p)]
    last = [0.0] * p
    for phi in range(2 * (m - 1) + 2 * p):
        # Forward of micro-batch i on stage k has phi = 2i + k.
        low = max(0, phi - 2 * (m - 1))
        for k in range(low + ((phi - low) & 1), min(p - 1, phi) + 1, 2):
            i = (phi - k) >> 1
            t = last[k]
            if k:
                arrive = fwd[k - 1][i] + forward_comm_s[k]
                if arrive > t:
                    t = arrive
            t += forward_s[k]
            fwd[k][i] = t
            last[k] = t
        # Backward of micro-batch i on stage k has phi = 2i + 2p - 1 - k.
        low = max(0, 2 * p - 1 - phi)
        high = min(p - 1, 2 * (m - 1) + 2 * p - 1 - phi)
        for k in range(low + ((phi - (2 * p - 1) + low) & 1), high + 1, 2):
            i = (phi - 2 * p + 1 + k) >> 1
            t = last[k]
            if k < p - 1:
                arrive = bwd[k + 1][i] + backward_comm_s[k]
                if arrive > t:
                    t = arrive
            t += backward_s[k]
            bwd[k][i] = t
            last[k] = t
    return last
