"""A ring program's gradient sums for one worker: DDP's reducer, over the buckets the
planner's program names (planner.plans.program: ``allreduce="ring"``).

- Each bucket's gradients live in flat buffers (one per dtype), and every parameter's
  ``.grad`` is a view into one (DDP's ``gradient_as_bucket_view``): autograd adds each
  micro-batch's gradient into it in place, and the all-reduce sums it there, with no copy
  in or out and no second copy of the gradients.
- Before the worker's last backward pass (``WorkerProgram.last_backward``) the reducer is
  armed. A hook on each parameter (``register_post_accumulate_grad_hook``) counts down its
  bucket, and a complete bucket is all-reduced at once while the backward goes on below
  it; buckets are launched in the program's order (a bucket complete before the one
  above it waits for it), so every holder posts them in one order on their group.
- ``finish`` launches whatever the last backward did not complete (a parameter that got no
  gradient in it, a worker that ran no pass), in the same order; the tail then waits for
  each bucket (``wait``).
- An aborted step posts what it has not launched yet (``drain``, on gloo), as it drains
  its messages: on a group whose holders all live, every all-reduce then ends, and the
  group can serve the next generation (chameleon_runtime.comm).

Nothing here blocks: the collectives run on the group's own threads (gloo's, or NCCL's
stream), and a wait goes through the generation, which an abort ends
(chameleon_runtime.comm).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from chameleon_runtime.comm import Generation
from chameleon_runtime.shard import Shard
from planner.plans.program import Bucket, WorkerProgram


class Reducer:
    """The buckets of one worker's program in one generation; ``close`` before the next."""

    def __init__(self, shard: Shard, part: WorkerProgram, gen: Generation) -> None:
        self.part = part
        self.gen = gen
        self._buckets: list[Bucket] = list(part.buckets)  # the launch order
        self._flats: list[list[torch.Tensor]] = []
        self._sizes: list[int] = []  # parameters with a gradient, per bucket
        self._bucket_of: dict[nn.Parameter, int] = {}
        for k, bucket in enumerate(self._buckets):
            params = [
                p for p in shard.params(bucket.first_layer, bucket.end_layer) if p.requires_grad
            ]
            flats = []
            for dtype in dict.fromkeys(p.dtype for p in params):
                mine = [p for p in params if p.dtype == dtype]
                flat = torch.zeros(sum(p.numel() for p in mine), dtype=dtype, device=mine[0].device)
                offset = 0
                for p in mine:
                    view = flat[offset : offset + p.numel()].view_as(p)
                    if p.grad is not None:
                        view.copy_(p.grad)
                    p.grad = view
                    offset += p.numel()
                flats.append(flat)
            for p in params:
                self._bucket_of[p] = k
            self._flats.append(flats)
            self._sizes.append(len(params))
        self._loose = [
            p
            for p in shard.params(part.first_layer, part.end_layer)
            if p.requires_grad and p not in self._bucket_of
        ]
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._accumulated) for p in self._bucket_of
        ]
        self._index = {b.index: k for k, b in enumerate(self._buckets)}
        self._armed = False  # in the step's last backward: launching buckets as they fill
        self._launched = False  # every bucket of this step is launched
        self._remaining: list[int] = []
        self._next = 0  # the next bucket to launch
        self._works: list[list[Any]] = []
        self.begin_step()

    @property
    def flat_buffers(self) -> list[torch.Tensor]:
        return [f for flats in self._flats for f in flats]

    def begin_step(self) -> None:
        """A step starts: nothing of it is launched."""
        self._remaining = list(self._sizes)
        self._next = 0
        self._works = [[] for _ in self._buckets]
        self._armed = self._launched = False

    def arm(self) -> None:
        """The next backward is the step's last: launch each bucket as it completes."""
        self._armed = True

    def _accumulated(self, param: nn.Parameter) -> None:
        if not self._armed:
            return
        k = self._bucket_of[param]
        self._remaining[k] -= 1
        if self._remaining[k] == 0:
            while self._next < len(self._buckets) and self._remaining[self._next] <= 0:
                self._launch(self._next)

    def _launch(self, k: int, *, draining: bool = False) -> None:
        holders = self._buckets[k].holders
        self._works[k] = [
            self.gen.allreduce(holders, flat, draining=draining) for flat in self._flats[k]
        ]
        self._next = k + 1

    def finish(self, *, draining: bool = False) -> None:
        """Launch every bucket not launched yet, in order (module doc)."""
        while self._next < len(self._buckets):
            self._launch(self._next, draining=draining)
        self._armed, self._launched = False, True

    def drain(self) -> None:
        """An aborted step: post what it has not launched (module doc). Errors are the
        dead peer's: that group is not settled and the next generation builds anew."""
        if self._launched or not self.gen.transport.drains:
            return
        while self._next < len(self._buckets):
            with contextlib.suppress(Exception):
                self._launch(self._next, draining=True)
            self._next += 1  # past a bucket that failed to post too
        self._armed, self._launched = False, True

    def wait(self, bucket: Bucket) -> None:
        """Wait for ``bucket``'s all-reduce (``finish`` first if the step has not)."""
        if not self._launched:
            self.finish()
        k = self._index[bucket.index]
        for work in self._works[k]:
            self.gen.wait(work, bucket.holders)
        self._works[k] = []

    def zero_grad(self) -> None:
        """After the optimizer: the buckets' buffers zeroed in place (the views stay), the
        other gradients dropped."""
        for flats in self._flats:
            for flat in flats:
                flat.zero_()
        for p in self._loose:
            p.grad = None

    def close(self, *, keep_grads: bool = False) -> None:
        """Remove the hooks and let go of the buffers (the parameters' gradients too,
        unless ``keep_grads``: a step whose commit is not known yet, which they may
        still apply: chameleon_runtime.step)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if not keep_grads:
            for p in self._bucket_of:
                p.grad = None
            for p in self._loose:
                p.grad = None
        self._bucket_of.clear()
        self._flats = []
        self._armed = False
