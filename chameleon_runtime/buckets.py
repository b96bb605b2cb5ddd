"""Gradient buckets of the drop-in data-parallel API (chameleon_runtime.dataparallel): where
a worker's share of a step is summed before, and while, it is all-reduced.

One flat buffer per bucket; its parameters share a dtype and a device (the buffer is one
tensor on one device). DDP's bucketing: reverse parameter order (the backward produces
the last layers' gradients first), a small first bucket so that the first all-reduce
starts early.

What the user's ``.grad`` is, and when:

- While a step accumulates (every backward of its micro-batches on this worker), every
  gradient the backward produces is moved into its bucket: a loop's clipping, unscaling
  or zeroing between micro-batches touches nothing of the step's sums. After such a
  backward ``.grad`` is zeros for the parameters of up to SCRATCH_NUMEL elements (biases,
  norms; the smallest one if none is that small), views of one scratch buffer per dtype
  and device that they all share, and None for the others: what the loop does to them
  between micro-batches is a no-op that does not fail (``clip_grad_value_`` raises on a
  model with no gradient at all, GradScaler on an optimizer with none), at the cost of
  one small buffer, not a second copy of the gradients. A parameter's first contribution
  of a step is copied in (no pass to zero the buckets at each step), later ones added.
- Once the step's sums are all-reduced (the end of the backward of this worker's last
  micro-batch), each ``.grad`` is a view of its bucket, holding the global batch's mean,
  as under DDP when ``backward()`` returns; clipping, unscaling or logging a norm before
  ``step()`` sees the whole step's gradient.
- What the user leaves in ``.grad`` after a commit (no ``zero_grad``) is carried into the
  next step as DDP carries it: added to the next step's mean, not summed again.
- A second backward after the sums were all-reduced (an auxiliary loss) is summed into
  a buffer of its own, all-reduced, and added: as DDP, which reduces every backward.

A sharded parameter (a DTensor of FSDP2: chameleon_runtime.sharding) is summed by its
local shard: the buckets hold local shards, and what ``.grad`` shows is a DTensor over
the bucket's view with the parameter's placement (made once per view, not per step).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from chameleon_runtime.shardlayout import local, shown_as

Post = Callable[["Bucket", torch.Tensor], Any]  # posts a bucket's sums of a buffer: its work

BUCKET_CAP_BYTES = 25 << 20
FIRST_BUCKET_CAP_BYTES = 1 << 20
SCRATCH_NUMEL = 1 << 18  # the largest parameter shown as zeros between micro-batches


class Bucket:
    """Parameters whose gradients are summed together: one flat buffer."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.shapes = {p: local(p).shape for p in params}
        self.flat = torch.zeros(
            sum(local(p).numel() for p in params), dtype=params[0].dtype, device=params[0].device
        )
        self.spans: dict[nn.Parameter, tuple[int, int]] = {}
        offset = 0
        for p in params:
            n = local(p).numel()
            self.spans[p] = (offset, offset + n)
            offset += n
        self.views = self._views(self.flat)
        self.shown = self._shown()
        self.ready = 0  # parameters whose gradient of the current backward is in
        self.work: Any = None  # the all-reduce in flight
        self.extra: torch.Tensor | None = None  # a repeated backward's sums
        self.pieces: Any = None  # (layout, its sums' pieces: chameleon_runtime.rowsums)

    def _views(self, flat: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
        return {p: flat[a:b].view(self.shapes[p]) for p, (a, b) in self.spans.items()}

    def _shown(self) -> dict[nn.Parameter, torch.Tensor]:
        """What ``.grad`` is set to: the views, as DTensors for sharded parameters."""
        return {p: shown_as(p, v) for p, v in self.views.items()}

    def renew(self) -> None:
        """A new buffer: after an abandoned step whose all-reduce of this bucket may still
        be running (gloo's threads write its stale sums into the old one in place)."""
        self.flat = torch.zeros_like(self.flat)
        self.views = self._views(self.flat)
        self.shown = self._shown()
        self.work = None
        self.extra = None

    def extra_view(self, p: nn.Parameter) -> torch.Tensor:
        if self.extra is None:
            self.extra = torch.zeros_like(self.flat)
        a, b = self.spans[p]
        return self.extra[a:b].view(self.shapes[p])


def make_buckets(params: list[nn.Parameter], shards: int = 1) -> list[Bucket]:
    """A sharded model's buckets are cut by a shard's share of each parameter
    (``numel / shards``), not by what this member holds: every member then has the same
    buckets of the same parameters, which the sums of a group re-sharded over fewer
    members pair by (chameleon_runtime.replicagroup)."""
    out: list[Bucket] = []
    group: list[nn.Parameter] = []
    size, cap = 0, FIRST_BUCKET_CAP_BYTES
    for p in reversed(params):
        numel = p.numel() // shards if shards > 1 else local(p).numel()
        nbytes = numel * p.element_size()
        if group and (
            size + nbytes > cap or p.dtype != group[0].dtype or p.device != group[0].device
        ):
            out.append(Bucket(group))
            group, size, cap = [], 0, BUCKET_CAP_BYTES
        group.append(p)
        size += nbytes
    if group:
        out.append(Bucket(group))
    return out


class Gradients:
    """The buckets of one model and what this step has put in them."""

    def __init__(self, params: list[nn.Parameter], shards: int = 1) -> None:
        self.params = params
        self.buckets = make_buckets(params, shards)
        self.bucket_of = {p: k for k, b in enumerate(self.buckets) for p in b.params}
        self.written: set[nn.Parameter] = set()  # got a gradient this step (locally)
        self.carried: dict[nn.Parameter, torch.Tensor] = {}  # left in .grad by the user
        self.exposed_versions: list[int] = []  # the buffers' versions when last exposed
        self.scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        small = [p for p in params if local(p).numel() <= SCRATCH_NUMEL]
        self._shown = small or sorted(params, key=lambda p: local(p).numel())[:1]
        self._scratch_shown: dict[nn.Parameter, tuple[torch.Tensor, torch.Tensor]] = {}
        self.scratch_exposed = False  # each .grad is zeros in the shared scratch
        self.launched = 0  # buckets whose all-reduce of this step is posted

    # -- a step begins -------------------------------------------------------------------

    def open_step(self, taking: nn.Parameter | None = None) -> bool:
        """The step's first backward, before it accumulates: what the user left in
        ``.grad`` since the last commit is kept aside (carried, module doc), and every
        ``.grad`` hidden. A step redone after a recovery keeps what its first attempt
        carried (``.grad`` is empty by then). ``taking``: a parameter whose gradient this
        backward already accumulated (it reached it before the model's outputs): its
        ``.grad`` is that gradient, left to ``take``; False if it went into a view of ours
        (mixed with the last step's mean: it cannot be told apart)."""
        self.written.clear()
        for k, bucket in enumerate(self.buckets):
            bucket.ready = 0
            bucket.extra = None
            # Views of ours still in .grad hold the last step's mean, unless written in
            # place since the commit: most likely zeroed (zero_grad(set_to_none=False)),
            # which one look at the bucket tells (only then: a read of the gradients).
            untouched = bool(self.exposed_versions) and (
                bucket.flat._version == self.exposed_versions[k]
            )
            zeroed: bool | None = None
            for p in bucket.params:
                grad = p.grad if p.grad is None else local(p.grad)
                if p is taking:
                    if grad is not None and _same_storage(grad, bucket.views[p]):
                        return False
                    continue
                if grad is None:
                    continue
                if self.scratch_exposed and self._in_scratch(grad):
                    p.grad = None  # the zeros shown between micro-batches: not the user's
                    continue
                if _same_storage(grad, bucket.views[p]):
                    if untouched:
                        self.carried[p] = grad.clone()
                    else:
                        if zeroed is None:
                            zeroed = not bool(bucket.flat.any())
                        if not zeroed and bool(grad.any()):
                            self.carried[p] = grad.clone()
                elif bool(grad.any()):  # a tensor the user put there
                    self.carried[p] = grad.detach().clone()
                p.grad = None
        self.scratch_exposed = False
        return True

    # -- what a backward produces --------------------------------------------------------

    def take(self, p: nn.Parameter) -> bool:
        """``p``'s gradient of this backward into its bucket; ``.grad`` hidden again. False
        if it was added to the zeros shown between micro-batches (a backward that did not
        pass through the model's outputs first): it cannot be told apart from them."""
        if p.grad is None:
            return True
        grad = local(p.grad)
        if self.scratch_exposed and self._in_scratch(grad):
            return False
        view = self.buckets[self.bucket_of[p]].views[p]
        if p in self.written:
            view.add_(grad)
        else:
            view.copy_(grad)
            self.written.add(p)
        p.grad = None
        return True

    def take_extra(self, p: nn.Parameter) -> None:
        """A repeated backward's gradient (after the step's sums were reduced)."""
        if p.grad is None:
            return
        self.buckets[self.bucket_of[p]].extra_view(p).add_(local(p.grad))
        self.written.add(p)
        p.grad = None

    def hide(self) -> None:
        """A backward or a micro-batch begins: what .grad shows (the step's mean, or the
        shared zeros) must not be accumulated into."""
        for p in self.params:
            p.grad = None
        self.scratch_exposed = False

    def expose_scratch(self, *, broken: bool = False) -> None:
        """Between micro-batches: every ``.grad`` zeros in the shared scratch (module
        doc), zeroed again each time (the loop may have written into it). ``broken``: a
        failure broke the group of a sharded model; its sharded parameters show None, as
        a norm the loop takes over DTensor gradients (``clip_grad_norm_``) would be a
        collective of that group: with none it is taken over nothing, without one."""
        shown = self._shown
        used: dict[tuple[torch.dtype, torch.device], int] = {}
        for p in shown:
            key = (p.dtype, p.device)
            used[key] = max(used.get(key, 0), local(p).numel())
        for key, n in used.items():
            buf = self.scratch.get(key)
            if buf is None or buf.numel() < n:
                buf = self.scratch[key] = torch.zeros(n, dtype=key[0], device=key[1])
            else:
                buf[:n].zero_()
        for p in shown:
            buf = self.scratch[(p.dtype, p.device)]
            made = self._scratch_shown.get(p)
            if made is None or made[0] is not buf:  # (a DTensor made once per buffer)
                view = buf[: local(p).numel()].view(local(p).shape)
                made = self._scratch_shown[p] = (buf, shown_as(p, view))
            p.grad = None if broken and made[1] is not local(made[1]) else made[1]
        self.scratch_exposed = True

    def _in_scratch(self, grad: torch.Tensor) -> bool:
        grad = local(grad)
        buf = self.scratch.get((grad.dtype, grad.device))
        return buf is not None and grad.data_ptr() == buf.data_ptr()

    def zero_unwritten(self) -> None:
        """Parameters with no gradient this step hold zeros in the sums (copy-first
        accumulation never wrote their slots)."""
        if len(self.written) == len(self.params):
            return
        for p in self.params:
            if p not in self.written:
                self.buckets[self.bucket_of[p]].views[p].zero_()

    # -- all-reducing the sums: in one order on every worker (a collective's order must
    # agree), a bucket as soon as the last backward of the step has filled it, and those
    # before it --------------------------------------------------------------------------

    def arm(self) -> None:
        """The backward that completes this worker's share of the step is coming."""
        self.launched = 0
        for b in self.buckets:
            b.ready = 0

    def filled(self, p: nn.Parameter, post: Post) -> None:
        """``p``'s gradient of the last backward is in: post what is complete, in order."""
        self.buckets[self.bucket_of[p]].ready += 1
        while self.launched < len(self.buckets) and self.buckets[self.launched].ready == len(
            self.buckets[self.launched].params
        ):
            self._post(post)

    def post_rest(self, post: Post) -> None:
        """The backward ended: what it did not complete (a parameter with no gradient)."""
        while self.launched < len(self.buckets):
            self._post(post)

    def _post(self, post: Post) -> None:
        bucket = self.buckets[self.launched]
        self.launched += 1
        bucket.work = post(bucket, bucket.flat)

    def wait_all(self, wait: Callable[[Any], None]) -> None:
        for b in self.buckets:
            wait(b.work)
            b.work = None

    def reduce_extra(self, post: Post, wait: Callable[[Any], None], count: int) -> None:
        """A repeated backward's sums: every bucket's (the members' collectives must
        agree whichever buckets it touched here), summed as the step's are, divided,
        added."""
        for b in self.buckets:
            if b.extra is None:
                b.extra = torch.zeros_like(b.flat)
            wait(post(b, b.extra))
        with torch.no_grad():
            for b in self.buckets:
                assert b.extra is not None
                b.flat.add_(b.extra.div_(count))
                b.extra = None

    def unused(self) -> list[nn.Parameter]:
        return [p for p in self.params if p not in self.written]

    # -- the step's sums ---------------------------------------------------------------

    def divide(self, count: int) -> None:
        with torch.no_grad():
            for b in self.buckets:
                b.flat.div_(count)

    def add_carried(self) -> None:
        with torch.no_grad():
            for p, grad in self.carried.items():
                self.buckets[self.bucket_of[p]].views[p].add_(grad)
        self.carried.clear()

    def expose(self) -> None:
        """Every ``.grad`` its bucket's view: the step's mean, what the optimizer steps."""
        self.scratch_exposed = False
        for b in self.buckets:
            for p, shown in b.shown.items():
                p.grad = shown
        self.exposed_versions = [b.flat._version for b in self.buckets]

    def mark_exposed(self) -> None:
        """After the commit's step: what the optimizer did in place is not the user's."""
        self.exposed_versions = [b.flat._version for b in self.buckets]

    def renew_in_flight(self, wait_s: float = 0.1) -> None:
        """After an abandoned step: a bucket whose all-reduce may still run gets a new
        buffer (module doc of Bucket.renew); the others are reused. An all-reduce with a
        dead peer fails within milliseconds of its death, and one with a live peer ends
        once that peer leaves the generation too, so each is given a moment (``wait_s``
        in all) before its bucket is given up: a recovery then holds no second copy of
        the gradients, which a bucket renewed while its old buffer waited on a stuck
        all-reduce cost (measured: the gradients' size again at the survivor's peak)."""
        deadline = time.monotonic() + wait_s
        for b in self.buckets:
            work, b.work = b.work, None
            b.extra = None
            if work is None or work.is_completed():
                continue
            left = deadline - time.monotonic()
            if left > 0:
                with contextlib.suppress(Exception):  # failed: over all the same
                    work.wait(timedelta(seconds=left))
            if not work.is_completed():
                b.renew()
        self.hide()
        self.written.clear()
        # (what the step carried stays: its attempt again adds it)
        self.exposed_versions = []


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )
