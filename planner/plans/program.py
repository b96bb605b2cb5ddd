"""The per-step operation graph: what every worker executes, in order, for one step.

The planner times this graph (``planner.estimator.timing``) and the runtime executes it
(``chameleon_runtime``), so an estimate is the estimate of what will actually run.

For each worker, ``ops`` is its compute sequence: forward and backward passes of single
micro-batches through its layers. The peers are implied: a forward receives its input
from ``prev`` (None on the first stage) and sends its output to ``next``; a backward
receives the output gradient from ``next`` and sends the input gradient to ``prev``.
Sends are asynchronous; a pass waits only for its own input.

A bucket is a run of layers with the same set of holders, whose gradients those holders
sum. How they sum them is the program's ``allreduce``:

- ``ring`` (the runtime's default): each bucket is all-reduced among its holders with a
  real collective (gloo's ring, NCCL's or HCCL's), in the gradients' dtype, launched
  during the worker's last backward pass as soon as the bucket's layers have their
  gradients, while the backward goes on below them (DDP's reducer does the same). Long
  runs are cut into buckets of at most ``BUCKET_BYTES`` at layer boundaries, the
  topmost (reduced first) of at most ``FIRST_BUCKET_BYTES``, as DDP cuts them;
- ``exchange`` (``exact``: bit-identical weights in any layout): after the last backward
  each holder sends its float64 sums of the bucket to every other holder and adds theirs
  in holder order, in the rounds given by colouring the buckets' conflict graph.

After its last backward comes the worker's ``tail``, the rest of its step, in order: the
buckets (ring: waited for; exchange: exchanged), the gradients final (exchange: the sums
rounded) and the queued sends flushed, the last stage's share of the loss into the store,
the commit barrier (the step is applied by all or by none, so a failure never leaves
replicas disagreeing), the optimizer, and the step's loss read back. The runtime
(chameleon_runtime.step) runs exactly these operations and nothing else per step; the
estimator (planner.estimator.timing) charges each of them, the ring's overlap with the backward
included.

Order within a worker: every pass gets a potential from its micro-batch's position q in
its home pipeline and its hop k on a route of n hops,

    phi(forward)  = 2q + k
    phi(backward) = 2q + 2n - 1 - k

and each worker runs its passes in increasing phi. On a plain pipeline this is exactly
1F1B: stage k runs n - k - 1 warm-up forwards, then alternates. A peer serving a rerouted
pipeline has two passes at one phi, its own pipeline's and the guest's; the guest's goes
first (``tie_rank``: shares split over several routes first, then by home pipeline, then
micro-batch). The guest's route runs through the broken pipeline's survivors, which wait
on every one of its micro-batches in turn, while the peer's own pipeline waits on only
one extra pass. On the 1,024 GPU config a step after one lost stage took 16.9-20.0 s
depending on which pipeline lost it when the lower-numbered pipeline went first, and
16.0-16.9 s depending on the stage alone with the guest first: the order follows the
plan's structure, not which pipeline has the lower number. Because phi rises by one
along every dependency between workers (a forward
feeds the next hop's forward, a backward the previous hop's backward, and the last hop's
backward follows its forward), no set of routes can make workers wait on each other in a
cycle, whatever rerouting produced. A peer serving rerouted micro-batches runs each
pipeline's 1F1B interleaved, so it keeps each pipeline's usual window in flight: that is
the extra activation memory rerouting costs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from typing import Literal, NamedTuple

from planner.plans.colouring import Task, colour_rounds
from planner.plans.plan import Plan, Route

Allreduce = Literal["ring", "exchange"]
ALLREDUCES: tuple[Allreduce, ...] = ("ring", "exchange")

# DDP's bucket sizes (torch.nn.parallel.DistributedDataParallel's bucket_cap_mb and its
# first bucket): a ring program cuts runs of layers into buckets of at most these many
# gradient bytes, at layer boundaries (a larger layer is a bucket of its own).
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


class OpKind(StrEnum):
    FORWARD = "F"
    BACKWARD = "B"


class TailKind(StrEnum):
    # REPORT_LOSS, REPORT_NORM, READ_NORM and READ_LOSS go through the store in an
    # exchange program; a ring's COMMIT is a collective that sums the loss and the norms
    # too, so its READ_NORM is local and the others are not in its program.
    # exchange: one bucket's float64 sums sent to and received from its other holders
    EXCHANGE = "exchange"
    # ring: one bucket's all-reduce among its holders, launched during the last backward
    # pass once the bucket's gradients are complete; the tail waits for it to end
    ALLREDUCE = "allreduce"
    # the gradients final (exchange: the float64 sums rounded to the parameters' dtype)
    # and the queued sends flushed
    ROUND = "round"
    REPORT_LOSS = "report_loss"  # the last stage's share of the loss, into the store
    # the all-or-none barrier over the plan's workers: an agreement in the store
    # (exchange); a ring's, votes summed up a binary tree of the workers with the loss
    # and the squared gradient norm, and the root's decision sent back down
    # (``commit_tree``; chameleon_runtime.step), point to point
    COMMIT = "commit"
    OPTIMIZE = "optimize"
    READ_LOSS = "read_loss"  # the step's loss: every last-stage worker's share
    # The global gradient norm (Training.global_norm: clipping, or fp16's overflow check
    # that skips a step on every worker alike): each layer's squared
    # gradient norm is reported once, by its lowest holder, before the commit; after it,
    # every worker reads them all (the same values in the same order: the same scale).
    REPORT_NORM = "report_norm"
    READ_NORM = "read_norm"


class ComputeOp(NamedTuple):
    kind: OpKind
    micro_batch: int
    prev: int | None  # worker holding the layers before ours on this micro-batch's route
    next: int | None  # worker holding the layers after ours


@dataclass(frozen=True)
class Bucket:
    index: int
    first_layer: int
    end_layer: int
    holders: tuple[int, ...]
    round: int


class TailOp(NamedTuple):
    kind: TailKind
    bucket: Bucket | None = None  # EXCHANGE and ALLREDUCE only


class Message(NamedTuple):
    """One point-to-point message of a step, as one side sees it. Between two workers,
    messages are matched by their order alone (NCCL and HCCL have no tags), so the
    runtime sends and receives exactly in ``WorkerProgram.messages`` order."""

    peer: int
    send: bool  # True: this worker sends it to ``peer``; False: receives it from ``peer``
    # "F" a forward's activation, "B" a backward's gradient, "X" a bucket's sums; a ring's
    # commit: "U" votes up its tree, "D" the decision down
    kind: str
    index: int  # the micro-batch ("F", "B"), the bucket ("X"); 0 for "U" and "D"


@dataclass(frozen=True)
class WorkerProgram:
    """One worker's whole step: what chameleon_runtime.step executes for it."""

    plan: Plan
    worker: int
    first_layer: int
    end_layer: int
    ops: tuple[ComputeOp, ...]
    tail: tuple[TailOp, ...]
    max_in_flight: int  # micro-batches whose activations are stashed at once
    allreduce: Allreduce = "ring"

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The buckets this worker sums with others, in issue order (ring: the order
        the last backward completes them, from the top layer down)."""
        return tuple(op.bucket for op in self.tail if op.bucket is not None)

    @property
    def members(self) -> list[int]:
        """The workers of the commit barrier."""
        return sorted(self.plan.workers)

    @property
    def is_last_stage(self) -> bool:
        return self.end_layer == self.plan.num_layers

    def last_stage_workers(self) -> list[int]:
        """Whose shares of the loss make the step's loss (in the store: exchange only)."""
        return last_stage_workers(self.plan) if self.allreduce == "exchange" else []

    def norm_owners(self) -> list[int]:
        """Whose squared gradient norms make the step's global norm in the store: none
        where this program does not read the global norm, or sums it in its commit
        (ring): its step keys then hold no norm."""
        reads = any(op.kind is TailKind.READ_NORM for op in self.tail)
        return norm_owners(self.plan) if reads and self.allreduce == "exchange" else []

    def messages(self) -> tuple[Message, ...]:
        """Every message this worker sends or receives in a step, in the order it posts
        them (chameleon_runtime.step): per pass, its input received before its output
        sent; per bucket (exchange), its sums sent to every other holder, then theirs
        received in holder order; a ring's commit: its children's votes, its own up and
        the decision down (``commit_tree``). A worker's first stage takes no input
        message. Made once per program: the runtime lists them every step."""
        return self._messages

    @cached_property
    def _messages(self) -> tuple[Message, ...]:
        me, out = self.worker, []
        for op in self.ops:
            mb = op.micro_batch
            if op.kind is OpKind.FORWARD:
                if op.prev is not None:
                    out.append(Message(op.prev, False, "F", mb))
                if op.next is not None:
                    out.append(Message(op.next, True, "F", mb))
            else:
                if op.next is not None:
                    out.append(Message(op.next, False, "B", mb))
                if op.prev is not None:
                    out.append(Message(op.prev, True, "B", mb))
        if self.allreduce == "exchange":
            for b in self.buckets:
                others = [h for h in b.holders if h != me]
                out += [Message(h, True, "X", b.index) for h in others]
                out += [Message(h, False, "X", b.index) for h in others]
        else:
            parent, children = commit_tree(self.plan, me)
            out += [Message(c, False, "U", 0) for c in children]
            if parent is not None:
                out += [Message(parent, True, "U", 0), Message(parent, False, "D", 0)]
            out += [Message(c, True, "D", 0) for c in children]
        return tuple(out)

    @property
    def last_backward(self) -> int:
        """The index in ``ops`` of the last backward pass (ring: it launches the buckets'
        all-reduces); -1 when the worker runs no pass."""
        for i in range(len(self.ops) - 1, -1, -1):
            if self.ops[i].kind is OpKind.BACKWARD:
                return i
        return -1

    def owned_layers(self) -> list[int]:
        """The layers this worker is the lowest holder of: the ones it writes to a
        checkpoint and whose squared gradient norm it reports, so that replicas count
        each layer once."""
        lowest = lowest_holders(self.plan)
        return [i for i in range(self.first_layer, self.end_layer) if lowest[i] == self.worker]


@dataclass(frozen=True)
class StepProgram:
    plan: Plan
    workers: tuple[WorkerProgram, ...]  # sorted by worker
    buckets: tuple[Bucket, ...]

    def of(self, worker: int) -> WorkerProgram:
        for program in self.workers:
            if program.worker == worker:
                return program
        raise KeyError(worker)


def reads_global_norm(max_grad_norm: float | None, precision: str) -> bool:
    """Whether every step reads the gradients' global norm: to clip them to
    ``max_grad_norm``, or for fp16's overflow check (chameleon_runtime.scaler). The one
    rule the runtime's programs and the planner's estimates (chameleon_runtime.protocol.wire) both follow."""
    return max_grad_norm is not None or precision == "fp16"


def bucket_split(allreduce: Allreduce, grad_bytes: int) -> tuple[int, int] | None:
    """The most parameters of a ring program's buckets (the first reduced, the others),
    from DDP's sizes; None for exchange (a run of layers is one bucket)."""
    if allreduce == "exchange":
        return None
    return max(1, FIRST_BUCKET_BYTES // grad_bytes), max(1, BUCKET_BYTES // grad_bytes)


def build_program(
    plan: Plan,
    layer_params: Sequence[int],
    *,
    global_norm: bool = False,
    allreduce: Allreduce = "ring",
    grad_bytes: int = 4,
) -> StepProgram:
    """Every worker's program; ``layer_params`` (parameters per layer) orders the buckets;
    ``global_norm``: every step reads the gradients' global norm (to clip them, or to
    check fp16 gradients for overflow); ``allreduce`` and ``grad_bytes`` (the gradients'
    dtype): how buckets are summed (module doc)."""
    buckets = buckets_of(plan, layer_params, split=bucket_split(allreduce, grad_bytes))
    work = ops_for(plan.routes, position_in_home(plan), tie_rank(plan))
    owners = set(norm_owners(plan)) if global_norm else None
    programs = tuple(
        _program(plan, stage.worker, work.get(stage.worker, []), buckets, owners, allreduce)
        for stage in plan.stages
    )
    return StepProgram(plan=plan, workers=programs, buckets=buckets)


def worker_program(
    plan: Plan,
    worker: int,
    layer_params: Sequence[int],
    *,
    global_norm: bool = False,
    allreduce: Allreduce = "ring",
    grad_bytes: int = 4,
) -> WorkerProgram:
    """One worker's program (what the runtime builds for itself: only its own routes)."""
    routes = [r for r in plan.routes if worker in r.hops]
    ops = ops_for(routes, position_in_home(plan), tie_rank(plan)).get(worker, [])
    owners = set(norm_owners(plan)) if global_norm else None
    buckets = buckets_of(plan, layer_params, split=bucket_split(allreduce, grad_bytes))
    return _program(plan, worker, ops, buckets, owners, allreduce)


def _program(
    plan: Plan,
    worker: int,
    ops: Sequence[ComputeOp],
    buckets: Sequence[Bucket],
    owners: set[int] | None,
    allreduce: Allreduce,
) -> WorkerProgram:
    stage = plan.stage_of[worker]
    return WorkerProgram(
        plan=plan,
        worker=worker,
        first_layer=stage.first_layer,
        end_layer=stage.end_layer,
        ops=tuple(ops),
        tail=tail_of(
            worker,
            buckets,
            last_stage=stage.end_layer == plan.num_layers,
            global_norm=owners is not None,
            reports_norm=owners is not None and worker in owners,
            allreduce=allreduce,
        ),
        max_in_flight=max_in_flight(ops),
        allreduce=allreduce,
    )


def tail_of(
    worker: int,
    buckets: Iterable[Bucket],
    *,
    last_stage: bool,
    global_norm: bool = False,
    reports_norm: bool = False,
    allreduce: Allreduce = "ring",
) -> tuple[TailOp, ...]:
    """What follows a worker's passes (module doc). Exchange: its buckets in (round,
    index) order, the order every holder of a bucket reaches it in, so no two holders
    wait on each other in a cycle. Ring: its buckets from the top layer down, the order
    its last backward completes (and launches) them, the same on every holder; each
    bucket's collective has a group of its own, so buckets of different holders never
    wait on each other. ``global_norm``: the step reads the gradients' global norm;
    ``reports_norm``: it is the lowest holder of some layer and reports its part."""
    if allreduce == "ring":
        mine = sorted((b for b in buckets if worker in b.holders), key=lambda b: -b.first_layer)
        return (
            *(TailOp(TailKind.ALLREDUCE, b) for b in mine),
            TailOp(TailKind.ROUND),
            TailOp(TailKind.COMMIT),
            *((TailOp(TailKind.READ_NORM),) if global_norm else ()),
            TailOp(TailKind.OPTIMIZE),
        )
    else:
        mine = sorted((b for b in buckets if worker in b.holders), key=lambda b: (b.round, b.index))
        kind = TailKind.EXCHANGE
    return (
        *(TailOp(kind, b) for b in mine),
        TailOp(TailKind.ROUND),
        *((TailOp(TailKind.REPORT_LOSS),) if last_stage else ()),
        *((TailOp(TailKind.REPORT_NORM),) if reports_norm else ()),
        TailOp(TailKind.COMMIT),
        *((TailOp(TailKind.READ_NORM),) if global_norm else ()),
        TailOp(TailKind.OPTIMIZE),
        TailOp(TailKind.READ_LOSS),
    )


def commit_tree(plan: Plan, worker: int) -> tuple[int | None, list[int]]:
    """A ring's commit tree (``TailKind.COMMIT``): the plan's workers in rank order as a
    binary heap, 2 log2(n) hops from the leaves to the root and back. (parent or None
    for the root, children) of ``worker``."""
    order = sorted(plan.workers)
    i = order.index(worker)
    children = [order[c] for c in (2 * i + 1, 2 * i + 2) if c < len(order)]
    return (order[(i - 1) // 2] if i else None), children


def last_stage_workers(plan: Plan) -> list[int]:
    return sorted(s.worker for s in plan.stages if s.end_layer == plan.num_layers)


def lowest_holders(plan: Plan) -> tuple[int, ...]:
    """Each layer's lowest holder (computed once per plan: ``Plan.derived``)."""
    hit = plan.derived.get(("lowest_holders",))
    if hit is None:
        hit = plan.derived[("lowest_holders",)] = tuple(
            min(plan.holders(layer)) for layer in range(plan.num_layers)
        )
    return hit  # type: ignore[return-value]


def norm_owners(plan: Plan) -> list[int]:
    """The workers that are some layer's lowest holder: who report squared norms."""
    return sorted(set(lowest_holders(plan)))


def position_in_home(plan: Plan) -> dict[int, int]:
    """Each micro-batch's position q within its home pipeline's share."""
    return {mb: q for mbs in plan.micro_batches_of_home.values() for q, mb in enumerate(mbs)}


def tie_rank(plan: Plan) -> dict[int, int]:
    """Which pipeline's share a worker runs first among passes at one phi (module doc):
    shares split over several routes (rerouted around a lost worker) first, then the
    rest, each in home order."""
    routes_of: dict[int, int] = {}
    for r in plan.routes:
        routes_of[r.home] = routes_of.get(r.home, 0) + 1
    homes = sorted(routes_of, key=lambda h: (routes_of[h] == 1, h))
    return {h: i for i, h in enumerate(homes)}


def ops_for(
    routes: Iterable[Route], position: Mapping[int, int], rank: Mapping[int, int]
) -> dict[int, list[ComputeOp]]:
    """The compute sequence of every worker on ``routes``, ordered by phi (module doc);
    ``rank``: the plan's ``tie_rank``."""
    make = tuple.__new__  # ComputeOp(...) without NamedTuple's argument parsing: hot path
    forward, backward = OpKind.FORWARD, OpKind.BACKWARD
    keyed: dict[int, list[tuple[int, int, int, ComputeOp]]] = {}
    for route in routes:
        hops = route.hops
        n = len(hops)
        home = rank[route.home]
        for k, worker in enumerate(hops):
            prev = hops[k - 1] if k > 0 else None
            nxt = hops[k + 1] if k < n - 1 else None
            mine = keyed.setdefault(worker, [])
            f_shift, b_shift = k, 2 * n - 1 - k
            for mb in route.micro_batches:
                q2 = 2 * position[mb]
                mine.append((q2 + f_shift, home, mb, make(ComputeOp, (forward, mb, prev, nxt))))
                mine.append((q2 + b_shift, home, mb, make(ComputeOp, (backward, mb, prev, nxt))))
    return {w: [item[3] for item in sorted(items)] for w, items in keyed.items()}


def max_in_flight(ops: Iterable[ComputeOp]) -> int:
    in_flight = peak = 0
    for op in ops:
        in_flight += 1 if op.kind is OpKind.FORWARD else -1
        peak = max(peak, in_flight)
    return peak


def buckets_of(
    plan: Plan, layer_params: Sequence[int], *, split: tuple[int, int] | None = None
) -> tuple[Bucket, ...]:
    """Runs of layers with the same holders; single-holder runs need no all-reduce.
    ``split`` (``bucket_split``): cut each run into buckets of at most this many
    parameters, its topmost of at most the first, at layer boundaries. In layer order;
    computed once per plan, ``layer_params`` and ``split``: ``Plan.derived``."""
    key = ("buckets", tuple(layer_params), split)
    hit = plan.derived.get(key)
    if hit is None:
        hit = plan.derived[key] = _buckets_of(plan, layer_params, split)
    return hit  # type: ignore[return-value]


def _cut(
    first: int, end: int, layer_params: Sequence[int], split: tuple[int, int]
) -> list[tuple[int, int]]:
    """[first, end) cut into spans from the top down, each within its cap (module doc)."""
    spans = []
    cap = split[0]
    top = end
    while top > first:
        low, size = top - 1, layer_params[top - 1]
        while low > first and size + layer_params[low - 1] <= cap:
            low -= 1
            size += layer_params[low]
        spans.append((low, top))
        top, cap = low, split[1]
    return spans[::-1]


def _buckets_of(
    plan: Plan, layer_params: Sequence[int], split: tuple[int, int] | None
) -> tuple[Bucket, ...]:
    boundaries = sorted({s.first_layer for s in plan.stages} | {s.end_layer for s in plan.stages})
    index = {b: i for i, b in enumerate(boundaries)}
    # The holders of the span between two neighbouring boundaries, in stage order: each
    # stage adds itself to the spans it covers (one pass, not one per span: at 16k
    # workers a plan has thousands of stages and a search estimates hundreds of plans).
    holders_of: list[list[int]] = [[] for _ in boundaries[1:]]
    for s in plan.stages:
        for i in range(index[s.first_layer], index[s.end_layer]):
            holders_of[i].append(s.worker)
    runs: list[tuple[int, int, tuple[int, ...]]] = []
    for first, end, span in zip(boundaries, boundaries[1:], holders_of, strict=False):
        holders = tuple(span)
        if runs and runs[-1][2] == holders and runs[-1][1] == first:
            runs[-1] = (runs[-1][0], end, holders)
        else:
            runs.append((first, end, holders))
    shared = [r for r in runs if len(r[2]) > 1]
    if split is not None:
        shared = [(f, e, h) for f0, e0, h in shared for f, e in _cut(f0, e0, layer_params, split)]
    tasks = [Task(h, float(sum(layer_params[f:e]))) for f, e, h in shared]
    rounds = colour_rounds(tasks)
    return tuple(
        Bucket(index=i, first_layer=f, end_layer=e, holders=h, round=r)
        for i, ((f, e, h), r) in enumerate(zip(shared, rounds, strict=True))
    )
