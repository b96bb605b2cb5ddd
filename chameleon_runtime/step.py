"""One training step of one worker: the program ``planner.plans.program`` made for it, executed.

Its passes, in order: a forward receives its input from ``prev`` (or reads the data),
runs the worker's layers and sends the output to ``next`` (or computes the loss, scaled by
1/M for M micro-batches per step, so the step's gradient is the global batch's mean); a
backward receives the output gradient from ``next`` (or starts from the loss) and sends
the input gradient to ``prev``. How the gradients of a bucket's holders are summed is the
program's ``allreduce``:

- ring (the default): autograd adds every pass into the parameters' ``.grad``, views into
  the buckets' flat buffers, and the last backward launches each bucket's all-reduce as it
  completes (chameleon_runtime.reducer); the tail waits for them;
- exchange (``exact``): each pass's gradients are moved into float64 sums
  (chameleon_runtime.shard), and the tail exchanges them among the holders and adds them
  in holder order (bit-identical on every holder and in any layout), then rounds them.

Then the rest of the tail, operation by operation, and the commit: nothing else runs per
step, and the estimator times this same program. The commit decides, for every worker
alike, whether the step is applied:

- exchange: an all-or-none agreement in the store (chameleon_runtime.control), with the
  loss and the norms reported and read there;
- ring: no store operation. Votes go up a binary tree of the plan's workers
  (``planner.plans.program.commit_tree``), each with its sender's subtree's loss share and
  squared gradient norm, point to point; the root, holding every vote, decides (yes when
  all voted, no when a drained step's zero vote is among them) and the decision goes
  back down with the sums: the step's loss and global norm. A worker that learned yes
  applies the step; no, it drops it. One that voted and did not learn the decision (a
  failure on the way: ``CommitUnknown``) cannot tell: the step may be applied elsewhere.
  It keeps the step's gradients, which were final when it voted, and says so in its
  ``Ready``; the leader's next plan says whether it was committed (a survivor is a step
  ahead: it was, and the plan carries the sums to apply it with) or not
  (chameleon_runtime.membership, launcher/recovery.py). A decision lost on the way is
  drained as zeros, which read as "not known", never as no.

Any other error or abort leaves the step unapplied on every worker.

Everything between workers is point to point, and every message of a step is known up
front, so an aborted step can be drained: the worker sends zeros for every message it
still owes and posts receives (never waited) for every message still owed to it. gloo can
cancel neither a blocked receive nor a blocked send (a send completes when its receiver
posts the matching receive). A receive left blocked on a live peer wedges the process's
gloo transport so that the next generation cannot connect, and a wait still blocked when
the interpreter exits aborts the process (both seen on torch 2.13). Drained, every
message of the step is matched on both sides, so no wait stays blocked.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from chameleon_runtime.comm import Aborted, CommError, Generation
from chameleon_runtime.control import Control
from chameleon_runtime.data import Batches
from chameleon_runtime.memory import Meter
from chameleon_runtime.pace import PassClock
from chameleon_runtime.protocol.messages import commit_name
from chameleon_runtime.reducer import Reducer
from chameleon_runtime.shard import Shard
from planner.plans.program import Bucket, Message, OpKind, TailKind, WorkerProgram, commit_tree

Shape = tuple[torch.Size, torch.dtype]


class CommitUnknown(CommError):
    """This worker voted for step ``step``'s commit (a ring's) and did not learn the
    decision: it may be applied elsewhere (module doc)."""

    def __init__(self, step: int, why: str) -> None:
        super().__init__(f"the commit of step {step} is not known here: {why}")
        self.step = step


# A ring's commit decision, the third number of its messages (module doc). A drained
# message is zeros: UNKNOWN.
UNKNOWN, YES, NO = 0.0, 1.0, 2.0
VOTE = (torch.Size([3]), torch.float64)  # [loss share, squared norm share, votes]


class ProtocolError(RuntimeError):
    """The runtime posted a message out of its program's order: a bug, never a failure
    of a peer (messages are matched by order alone: chameleon_runtime.transport)."""


class Ledger:
    """Every message of this worker's step, both ways, in program order
    (``WorkerProgram.messages``) until it is posted: per peer, what it still owes (sends)
    and is still owed (receives), each with its shape. Each message posted must be its
    peer's next one in that order; an aborted step posts the rest (``drain``)."""

    def __init__(self, part: WorkerProgram, shapes: Sequence[Shape], shard: Shard) -> None:
        first, end = part.first_layer, part.end_layer
        out = shapes[end - 1]
        inp = shapes[first - 1] if first > 0 else None
        self.owes: dict[int, deque[tuple[Message, Shape]]] = {}
        self.owed: dict[int, deque[tuple[Message, Shape]]] = {}
        buckets = {b.index: b for b in part.buckets}
        for m in part.messages():
            if m.kind == "X":
                b = buckets[m.index]
                size = sum(p.numel() for p in shard.params(b.first_layer, b.end_layer))
                shape: Shape = (torch.Size([size]), torch.float64)
            elif m.kind in ("U", "D"):
                shape = VOTE
            else:  # a forward's input comes from prev, its output goes to next; backward: reverse
                towards_prev = (m.kind == "F") != m.send
                shape = inp if towards_prev else out  # type: ignore[assignment]
            (self.owes if m.send else self.owed).setdefault(m.peer, deque()).append((m, shape))

    @staticmethod
    def _next(queue: dict[int, deque], peer: int, kind: str, index: int) -> deque:
        """The peer's queue, checked to start with this message."""
        q = queue.get(peer)
        if not q or (q[0][0].kind, q[0][0].index) != (kind, index):
            head = q[0][0] if q else None
            raise ProtocolError(f"posted {kind}{index} with {peer}, its program says {head}")
        return q

    def send(
        self,
        gen: Generation,
        tensor: torch.Tensor,
        peer: int,
        kind: str,
        index: int,
        *,
        force: bool = False,
    ) -> None:
        """``force``: post it whatever happened to the generation (a commit's decision
        once known: module doc)."""
        q = self._next(self.owes, peer, kind, index)
        gen.send(tensor, peer, force=force)
        q.popleft()  # posted (a send that fails to post leaves the pair broken anyway)

    def recv(
        self, gen: Generation, buffer: torch.Tensor, peer: int, kind: str, index: int
    ) -> torch.Tensor:
        q = self._next(self.owed, peer, kind, index)
        return gen.recv(buffer, peer, posted=q.popleft)

    def drain(self, gen: Generation) -> None:
        """Post every message still owed, each way, in order per peer."""
        sends = [(p, *shape) for p, q in self.owes.items() for _, shape in q]
        recvs = [(p, *shape) for p, q in self.owed.items() for _, shape in q]
        self.owes.clear()
        self.owed.clear()
        gen.drain(sends, recvs)


@dataclass
class StepResult:
    loss: float
    seconds: float
    # CPU time this thread spent in the layers' passes and the optimizer: against the
    # process's CPU time per step it splits a worker's load into compute and overhead.
    compute_cpu_s: float = 0.0
    # CPU time this thread spent in the pass loop beyond the layers: receiving, sending,
    # stashing, the memory meter (the planner charges it per pass: planner.estimator.fit).
    pass_cpu_s: float = 0.0
    # Wall seconds of the layers' passes (no wait on a peer) and the micro-batches they
    # ran: this worker's speed against its peers' (chameleon_runtime.pace).
    busy_s: float = 0.0
    micro_batches: int = 0
    # Bytes this worker sent: its messages, and a ring all-reduce's share of its buckets.
    sent_bytes: int = 0
    # A ring's commit: what it summed (the step's loss, its squared gradient norm, the
    # votes), for a peer that voted and did not learn the decision (module doc).
    committed: tuple[float, float, float] | None = None


def run_step(
    *,
    step: int,
    part: WorkerProgram,
    shard: Shard,
    gen: Generation,
    control: Control,
    batches: Batches,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    activation_shapes: Sequence[Shape],
    meter: Meter,
    lr: float | None = None,
    forget: Sequence[str] = (),
    max_grad_norm: float | None = None,
    reducer: Reducer | None = None,
) -> StepResult:
    """Run one step; raise Aborted (or CommError) with nothing applied. ``forget``: keys
    of the previous step, deleted by the last member to reach this step's commit (every
    member is past that step by then). ``reducer``: a ring program's (None: exchange)."""
    if (reducer is None) != (part.allreduce == "exchange"):
        raise ValueError(
            f"a {part.allreduce} program needs {'a' if reducer is None else 'no'} reducer"
        )
    ledger = Ledger(part, activation_shapes, shard)
    if reducer is not None:
        reducer.begin_step()
    try:
        return _run(
            step, part, shard, gen, control, batches, loss_fn, activation_shapes, meter, lr,
            ledger, forget, max_grad_norm, reducer,
        )  # fmt: skip
    except BaseException:
        ledger.drain(gen)
        if reducer is not None:
            reducer.drain()  # its collectives too (chameleon_runtime.reducer)
        raise


def _run(
    step,
    part,
    shard,
    gen,
    control,
    batches,
    loss_fn,
    activation_shapes,
    meter,
    lr,
    ledger,
    forget,
    max_grad_norm,
    reducer,
) -> StepResult:  # noqa: ANN001
    started = time.perf_counter()
    sent0 = gen.sent_bytes
    last_backward = part.last_backward
    m_total = part.plan.num_micro_batches
    first, end = part.first_layer, part.end_layer
    in_shape, in_dtype = activation_shapes[first - 1] if first > 0 else (None, None)
    device = shard.device
    scaler = shard.scaler  # fp16's loss scale (chameleon_runtime.scaler), else None
    skip = False  # fp16: this step's gradients overflowed somewhere; every worker skips it
    stash: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    partial_loss = 0.0
    cpu = 0.0
    passes, forwards = PassClock(shard.device), 0  # their wall time (on CUDA, the device's)
    keys = control.keys
    loop0 = time.thread_time()
    metering = meter.begin_step()  # the first steps of a layout only (chameleon_runtime.memory)
    for i, op in enumerate(part.ops):
        mb = op.micro_batch
        if op.kind is OpKind.FORWARD:
            if op.prev is None:
                x = batches.inputs(step, mb).to(device)
            else:
                x = ledger.recv(
                    gen, torch.empty(in_shape, dtype=in_dtype, device=device), op.prev, "F", mb
                )
                x.requires_grad_(True)
            c0, w0 = time.thread_time(), passes.start()
            with meter.saving(mb) if metering else contextlib.nullcontext():
                y = shard.forward(x, first, end, step=step, micro_batch=mb)
                if op.next is None:
                    # In fp32 whatever the precision: an fp16 loss times the loss scale
                    # would overflow before any gradient does.
                    loss = loss_fn(y, batches.targets(step, mb).to(device)).float() / m_total
            cpu += time.thread_time() - c0
            passes.stop(w0)
            forwards += 1
            if op.next is None:
                partial_loss += loss.item()
                stash[mb] = (x, loss if scaler is None else loss * scaler.scale)
            else:
                ledger.send(gen, y.detach(), op.next, "F", mb)
                stash[mb] = (x, y)
            if metering:
                meter.keep(mb, *stash[mb])
                meter.sample()
        else:
            x, y = stash.pop(mb)
            grad = (
                None if op.next is None else ledger.recv(gen, torch.empty_like(y), op.next, "B", mb)
            )
            last = i == last_backward
            if last and reducer is not None:
                reducer.arm()  # buckets all-reduced as this backward completes them
            c0, w0 = time.thread_time(), passes.start()
            y.backward(grad)
            cpu += time.thread_time() - c0
            passes.stop(w0)
            if metering:
                meter.release(mb)
                meter.sample(*(() if x.grad is None else (x.grad,)))  # and the layers' .grad
            if reducer is None:
                c0 = time.thread_time()
                shard.accumulate(first, end)  # exact float64 sums: any order (shard's doc)
                cpu += time.thread_time() - c0
            elif last:
                reducer.finish()
            if op.prev is not None:
                ledger.send(gen, x.grad, op.prev, "B", mb)
    pass_cpu = time.thread_time() - loop0 - cpu
    total = 0.0
    committed = None
    reads_norm = any(op.kind is TailKind.READ_NORM for op in part.tail)
    for op in part.tail:  # layers held here alone have no bucket: their sum is total
        kind = op.kind
        if kind is TailKind.ALLREDUCE:
            reducer.wait(op.bucket)
        elif kind is TailKind.EXCHANGE:
            _exchange(op.bucket, part.worker, shard, gen, ledger, meter if metering else None)
        elif kind is TailKind.ROUND:
            if reducer is None:
                shard.round_grads(first, end)
            if metering:
                meter.sample()
            gen.flush_sends()
        elif kind is TailKind.REPORT_LOSS:
            control.put(keys.loss(gen.generation, step, part.worker), repr(partial_loss))
        elif kind is TailKind.COMMIT and reducer is not None:  # a ring's (module doc)
            squared = shard.grad_sq_norm(part.owned_layers()) if reads_norm else 0.0
            share = partial_loss if part.is_last_stage else 0.0
            committed = _commit_tree(step, part, gen, ledger, share, squared)
            total = committed[0]
        elif kind is TailKind.COMMIT:
            agreed = control.agree(gen.generation, commit_name(step), len(part.members))
            if not agreed.held:
                raise Aborted(f"generation {gen.generation} aborted at step {step}")
            if agreed.last:
                control.forget(list(forget))
        elif kind is TailKind.REPORT_NORM:
            squared = shard.grad_sq_norm(part.owned_layers())
            control.put(keys.norm(gen.generation, step, part.worker), repr(squared))
        elif kind is TailKind.READ_NORM and committed is not None:
            skip = not apply_norm(step, shard, first, end, committed[1], max_grad_norm)
        elif kind is TailKind.READ_NORM:
            skip = not _read_norm(step, part, shard, gen, control, max_grad_norm)
        elif kind is TailKind.OPTIMIZE:
            c0 = time.thread_time()
            if not skip:
                shard.step(lr)
            cpu += time.thread_time() - c0
            if reducer is None:
                shard.zero_grad()
            else:
                reducer.zero_grad()
        elif kind is TailKind.READ_LOSS:
            keys_ = [keys.loss(gen.generation, step, w) for w in part.last_stage_workers()]
            total = sum(float(v) for v in control.store.multi_get(keys_))
    return StepResult(
        loss=total,
        seconds=time.perf_counter() - started,
        compute_cpu_s=cpu,
        pass_cpu_s=max(0.0, pass_cpu),
        busy_s=passes.take(),
        micro_batches=forwards,
        sent_bytes=gen.sent_bytes - sent0,
        committed=committed,
    )


def _commit_tree(
    step: int, part: WorkerProgram, gen: Generation, ledger: Ledger, loss: float, squared: float
) -> tuple[float, float, float]:
    """A ring's commit (module doc): (the step's loss, its squared gradient norm, votes)
    once committed; raises Aborted when not, CommitUnknown when not known here."""
    parent, children = commit_tree(part.plan, part.worker)
    vote = torch.tensor([loss, squared, 1.0], dtype=torch.float64)
    for child in children:  # the subtrees' votes and sums, added in child order
        vote += ledger.recv(gen, torch.empty(VOTE[0], dtype=VOTE[1]), child, "U", 0)
    if parent is None:
        yes = round(vote[2].item()) == len(part.plan.workers)
        decision = torch.tensor([vote[0].item(), vote[1].item(), YES if yes else NO],
                                dtype=torch.float64)  # fmt: skip
    else:
        ledger.send(gen, vote, parent, "U", 0)
        try:
            decision = ledger.recv(gen, torch.empty(VOTE[0], dtype=VOTE[1]), parent, "D", 0)
        except (Aborted, CommError) as exc:
            raise CommitUnknown(step, str(exc).splitlines()[0][:200]) from None
    for child in children:  # passed down whatever happens to this generation now
        ledger.send(gen, decision, child, "D", 0, force=True)
    flag = decision[2].item()
    if flag == YES:
        return decision[0].item(), decision[1].item(), vote[2].item()
    if flag == NO:
        raise Aborted(f"step {step} not committed: a member of generation {gen.generation} left it")
    raise CommitUnknown(step, "its decision was lost on the way")


def _read_norm(step, part, shard, gen, control, max_grad_norm) -> bool:  # noqa: ANN001
    """Read the global gradient norm from the store (exchange); ``apply_norm``."""
    keys = [control.keys.norm(gen.generation, step, w) for w in part.norm_owners()]
    squared = sum(float(v) for v in control.store.multi_get(keys))
    return apply_norm(step, shard, part.first_layer, part.end_layer, squared, max_grad_norm)


def apply_norm(
    step: int, shard: Shard, first: int, end: int, squared: float, max_grad_norm: float | None
) -> bool:
    """Act on the global squared gradient norm; False: fp16 gradients overflowed, skip
    the step. Every worker has the same sum (read in one order from the store, or a
    ring's commit), so every worker makes the same decision and every replica scales by
    the same bits. fp16: unscale by the loss scale (a power of two: exact) and update it
    (chameleon_runtime.scaler). Clipping: scale as torch.nn.utils.clip_grad_norm_ scales
    the whole model's gradients, by max_norm / (norm + 1e-6) when below 1."""
    scaler = shard.scaler
    if scaler is not None:
        inverse = 1.0 / scaler.scale
        finite = math.isfinite(squared)
        scaler.update(step, finite)
        if not finite:
            return False
        shard.scale_grads(first, end, inverse)
        squared *= inverse * inverse
    if max_grad_norm is not None:
        scale = max_grad_norm / (math.sqrt(squared) + 1e-6)
        if scale < 1.0:
            shard.scale_grads(first, end, scale)
    return True


def _exchange(
    bucket: Bucket, me: int, shard: Shard, gen: Generation, ledger: Ledger, meter: Meter | None
) -> None:
    """Sum a bucket's gradients over its holders: send my float64 sums to every other
    holder, then receive theirs one at a time in holder order and add each as it comes
    (every holder computes the same bits, and the same bits as any other grouping of the
    micro-batches would). At most three bucket-sized buffers live at once (mine, the
    total, one received), however many holders share the bucket."""
    mine = shard.flat_sums(bucket.first_layer, bucket.end_layer)
    for h in bucket.holders:
        if h != me:
            ledger.send(gen, mine, h, "X", bucket.index)
    total: torch.Tensor | None = None
    scratch: torch.Tensor | None = None
    for h in bucket.holders:
        if h == me:
            part = mine
        else:
            scratch = torch.empty_like(mine) if scratch is None else scratch
            part = ledger.recv(gen, scratch, h, "X", bucket.index)
        if total is None:
            total = part.clone()
        else:
            total += part
    assert total is not None
    if meter is not None:
        meter.sample(*(t for t in (total, mine, scratch) if t is not None))
    shard.set_flat_sums(bucket.first_layer, bucket.end_layer, total)
