"""The drop-in data-parallel API for an ordinary PyTorch loop: ``DataParallel`` in place
of ``DistributedDataParallel``, ``ElasticOptimizer`` around the user's optimizer (its
``step()`` is the commit point) and ``ElasticSampler`` (chameleon_runtime.sampler) in
place of ``DistributedSampler``. The user keeps their model, loss, dataset, DataLoader,
learning-rate schedule and loop::

    model = cr.DataParallel(model, sampler)        # was DistributedDataParallel(model)
    optimizer = cr.ElasticOptimizer(torch.optim.AdamW(model.parameters()), model)
    for batch in DataLoader(dataset, batch_sampler=sampler):
        loss = loss_fn(model(batch))
        loss.backward()
        if optimizer.step():                       # False while accumulating
            scheduler.step()
        optimizer.zero_grad()

What it does, as DDP does: the parameters and buffers start as rank 0's (broadcast);
gradients live in flat buckets (about 25 MiB, the first 1 MiB, in reverse parameter
order) that each ``.grad`` is a view of, and a bucket is all-reduced, asynchronously, as
soon as the last backward of this worker's share of the step has produced all of its
gradients, so that the all-reduce overlaps the rest of the backward. What it does
differently: a step is a fixed global batch of micro-batches dealt by the sampler; a
worker with several micro-batches of a step accumulates them (``step()`` returns False
and ``zero_grad()`` leaves the sums alone until the step commits), and the sum is
divided by the step's micro-batch count, not the world size, so that the gradient is the
global batch's mean however the micro-batches were dealt. With one micro-batch per worker
(``global_batch_size == world_size * micro_batch_size``) it trains as DDP with
DistributedSampler does.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from chameleon_runtime.comm import Aborted, CommError
from chameleon_runtime.elastic import Membership, export_state, install_state, under_chameleon
from chameleon_runtime.sampler import ElasticSampler, MicroBatch
from chameleon_runtime.shard import Seeder, op_seed

BUCKET_CAP_BYTES = 25 << 20
FIRST_BUCKET_CAP_BYTES = 1 << 20


def _default_group(device: torch.device) -> bool:
    """Whether there is a default group to sum on (False alone): the script's, or one
    initialised here from torchrun's environment, then destroyed at exit. Only the default
    group is named (group=None), never held: a gloo group still referenced when the
    interpreter ends is destroyed with its threads running, which aborted the process
    ("terminate called without an active exception") in about 1 exit of 8 here, plain
    DDP's included."""
    if dist.is_available() and dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    atexit.register(_destroy)
    return True


def _destroy() -> None:
    if dist.is_initialized():
        gc.collect()  # what still holds the group in a reference cycle lets go of it now
        dist.destroy_process_group()


class _Bucket:
    """Parameters whose gradients are summed together: one flat buffer per bucket
    (its parameters share a dtype and device), each ``.grad`` a view into it."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.flat = torch.zeros(
            sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
        )
        self.views: dict[nn.Parameter, torch.Tensor] = {}
        offset = 0
        for p in params:
            view = self.flat[offset : offset + p.numel()].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = self.views[p] = view
            offset += p.numel()
        self.ready = 0  # parameters whose gradient of the last backward is in
        self.work: Any = None  # the all-reduce in flight


def _buckets(params: list[nn.Parameter]) -> list[_Bucket]:
    """DDP's bucketing: reverse order (the backward produces the last layers' gradients
    first), a small first bucket so that the first all-reduce starts early."""
    out, group, size = [], [], 0
    cap = FIRST_BUCKET_CAP_BYTES
    for p in reversed(params):
        if group and (size + p.numel() * p.element_size() > cap or p.dtype != group[0].dtype):
            out.append(_Bucket(group))
            group, size, cap = [], 0, BUCKET_CAP_BYTES
        group.append(p)
        size += p.numel() * p.element_size()
    if group:
        out.append(_Bucket(group))
    return out


class DataParallel(nn.Module):
    """In place of ``DistributedDataParallel(module)``; ``sampler`` deals the micro-batches
    this wrapper's forward passes run (chameleon_runtime.sampler). Under ``chameleon
    run`` it recovers in place (chameleon_runtime.elastic)."""

    def __init__(self, module: nn.Module, sampler: ElasticSampler) -> None:
        super().__init__()
        self.module = module
        self.sampler = sampler
        first = next(module.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        self.elastic: Membership | None = None
        if under_chameleon():
            self.group = False
            self.elastic = Membership(sampler, device.type)
            self.world_size, self.rank = self.elastic.world_size, self.elastic.rank
        else:
            self.group = _default_group(device)  # True: sum on the default group
            self.world_size = dist.get_world_size() if self.group else 1
            self.rank = dist.get_rank() if self.group else 0
        if sampler.num_micro_batches < self.world_size:
            raise ValueError(
                f"a step of {sampler.global_batch_size} samples is "
                f"{sampler.num_micro_batches} micro-batches of {sampler.micro_batch_size}, "
                f"fewer than the {self.world_size} workers: each needs one at least"
            )
        sampler.rank, sampler.members = self.rank, list(range(self.world_size))
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._buckets = _buckets(self._params)
        self._bucket_of = {p: k for k, b in enumerate(self._buckets) for p in b.params}
        self._launched = 0  # buckets launched in this step's sync, in order
        self._armed = False  # the current backward is this worker's last of the step
        self._queued = False  # its end-of-backward sync is queued
        self._discard = False  # the current micro-batch is a stale deal's: dropped
        self.failure: tuple[str, bool] | None = None  # (why, pending) of a failed sync
        self.current: MicroBatch | None = None  # what the last training forward ran
        self._timing: list[float] = []  # the first step's forward start, end (described)
        self._seeder = Seeder(str(device))
        if self.elastic is not None and not self.elastic.joining:
            self.elastic.start(sampler.step)
            self._broadcast_elastic()
        elif self.group:  # every replica starts from rank 0's weights, as DDP's
            with torch.no_grad():
                for t in [*module.parameters(), *module.buffers()]:
                    dist.broadcast(t.data, 0)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._accumulated) for p in self._params
        ]

    def _broadcast_elastic(self) -> None:
        """Rank 0's weights on every member: the others add zeros to them (exact)."""
        assert self.elastic is not None
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                if not t.is_floating_point():
                    continue
                if self.rank != 0:
                    t.data.zero_()
                self.elastic.wait(self.elastic.allreduce(t.data))

    @property
    def distributed(self) -> bool:
        return self.group or self.elastic is not None

    # -- the forward and the backward's hooks ---------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and self.training:
            # The loader yields in the order the sampler dealt (also with prefetching
            # workers), so the oldest issued micro-batch is this one.
            issued = self.sampler.issued
            self.current = issued.pop(0) if issued else None
            self._discard = self.current is not None and self.current.deal != self.sampler.deal_id
            self._armed = not self._discard and (self.current is None or self.current.last)
            self._queued = False
            if self._armed:
                self._launched = 0
                for b in self._buckets:
                    b.ready = 0
            # The step's gradients show in .grad only from its last backward on (what a
            # loop does to them between backward() and step(), such as clipping, must
            # see the whole step's); before, each micro-batch's is added to the bucket
            # and .grad left empty.
            for b in self._buckets:
                for p, view in b.views.items():
                    p.grad = view if self._armed else None
            if self.current is not None:
                # Random ops (dropout) draw the same numbers for a micro-batch wherever it
                # runs: a run that lost a worker, whose micro-batches others computed,
                # trains the same weights as one that did not.
                self._seeder.seed(
                    op_seed(self.sampler.seed, self.current.step, self.current.index, 0)
                )
            if self.elastic is not None and not self.elastic.described:
                self._timing = [time.perf_counter()]
                out = self.module(*args, **kwargs)
                self._timing.append(time.perf_counter())
                return out
        return self.module(*args, **kwargs)

    def _accumulated(self, param: nn.Parameter) -> None:
        if self._discard:  # a stale deal's micro-batch (a recovery happened since)
            param.grad = None
            return
        if not self._armed:  # accumulating: into the bucket, out of sight
            self._buckets[self._bucket_of[param]].views[param].add_(param.grad)
            param.grad = None
            return
        if not self._queued:
            # As DDP: the sums are complete when backward() returns, so that what the
            # loop does between it and step() (clipping, logging a norm) sees them.
            torch.autograd.Variable._execution_engine.queue_callback(self.sync)
            self._queued = True
        if not self.distributed or self.failure is not None:
            return
        bucket = self._buckets[self._bucket_of[param]]
        bucket.ready += 1
        # Buckets go out in one order on every worker (a collective's order must agree):
        # a complete bucket waits for those before it.
        while self._launched < len(self._buckets) and self._buckets[self._launched].ready == len(
            self._buckets[self._launched].params
        ):
            self._launch(self._launched)

    def _launch(self, k: int) -> None:
        bucket = self._buckets[k]
        self._launched = k + 1
        if self.elastic is not None:
            try:
                bucket.work = self.elastic.allreduce(bucket.flat)
            except (Aborted, CommError) as exc:
                self.failure = (str(exc), False)
            return
        bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, async_op=True)

    def sync(self) -> None:
        """The step's sums, divided into its mean: what the last backward did not launch
        (a parameter with no gradient in it) goes out now, in order; then each is waited
        for. Under chameleon run a failure here is not raised (it would end the user's
        backward()): it is kept, and ``ElasticOptimizer.step`` recovers."""
        if not self._armed:  # done at the end of the backward already
            return
        self._armed = False
        if self._timing and self.elastic is not None and not self.elastic.described:
            self._timing.append(time.perf_counter())
        if self.elastic is not None:
            self._sync_elastic()
            if self.failure is not None and not self.failure[1]:
                return  # the sums are incomplete: the step is redone
        elif self.group:
            while self._launched < len(self._buckets):
                self._launch(self._launched)
            for b in self._buckets:
                b.work.wait()
                b.work = None
        self._mean()  # (pending ones too: complete sums, which the plan may apply)

    def _sync_elastic(self) -> None:
        elastic = self.elastic
        assert elastic is not None
        try:
            if self.failure is None:
                while self._launched < len(self._buckets):
                    self._launch(self._launched)
            if self.failure is not None:
                return
            for b in self._buckets:
                elastic.wait(b.work)
                b.work = None
        except (Aborted, CommError) as exc:
            self.failure = (str(exc), False)
            return
        # Every member has the step's sums once this one-element all-reduce ends: the
        # commit (module doc of chameleon_runtime.elastic). Posted and not seen to end,
        # the step may be applied elsewhere: pending, the next plan says.
        try:
            elastic.wait(elastic.allreduce(torch.ones(1)))
        except (Aborted, CommError) as exc:
            self.failure = (str(exc), True)

    def _mean(self) -> None:
        # The global batch's mean: its micro-batches' count when the sampler dealt them;
        # DDP's world size for batches it did not deal.
        count = self.sampler.num_micro_batches if self.current is not None else self.world_size
        with torch.no_grad():
            for b in self._buckets:
                b.flat.div_(count)

    def fresh_buckets(self) -> None:
        """After an abandoned step: new buffers. An all-reduce of the old generation may
        still be running on gloo's threads and would write its (stale) sums into the old
        ones in place: into the next step's gradients, had they been reused (replicas
        drifted apart so, after a kill that landed inside an all-reduce)."""
        for p in self._params:
            p.grad = None
        self._buckets = [_Bucket(b.params) for b in self._buckets]
        self._launched = 0
        self._armed = False

    def zero_grad_buckets(self) -> None:
        for b in self._buckets:
            b.flat.zero_()
            b.work = None
        self._armed = False


class ElasticOptimizer(torch.optim.Optimizer):
    """The user's optimizer, stepped once per global step: ``step()`` returns True when the
    step committed (this worker's share of it done and the sums in), False while it
    accumulates or when a recovery left the step to be redone; ``zero_grad()`` clears the
    sums only after a commit. A learning-rate scheduler built on this wrapper steps the
    inner optimizer's groups."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: DataParallel) -> None:
        # (torch.optim.Optimizer.__init__ is not called: the state is the inner one's)
        self.optimizer = optimizer
        self.model = model
        self._clear = True  # the sums belong to a committed step: zero_grad may clear them
        self._last_commit = time.perf_counter()
        self._kept: list[Any] = []  # heal_with's objects
        self._healed: list[dict] = []  # their states, received by a replacement
        self._groups: list[dict] = []  # the received optimizer groups' settings
        elastic = model.elastic
        if elastic is not None:
            atexit.register(self._at_exit)
            if elastic.joining:  # a replacement: healed from a live member, then trains
                resume = elastic.join(self._export, self._install)
                model.sampler.rewind(resume, elastic.members)

    @property
    def global_step(self) -> int:
        """The job's committed steps: a loop's counter (a replacement joins mid-run)."""
        return self.model.sampler.step

    def heal_with(self, *objects: Any) -> None:
        """Objects with ``state_dict``/``load_state_dict`` (JSON-able states: a learning-
        rate schedule) that a replacement takes from a live member with the model and the
        optimizer. On a replacement, each takes the received state at once."""
        for obj in objects:
            index = len(self._kept)
            self._kept.append(obj)
            if index < len(self._healed):
                obj.load_state_dict(self._healed[index])
                # A schedule's constructor set this process's learning rate from its own
                # start: the live member's groups, received, are the ones to keep.
                self._restore_groups()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def step(self, closure: Any = None) -> bool:  # type: ignore[override]
        model, elastic = self.model, self.model.elastic
        current = model.current
        if model._discard:  # a stale deal's micro-batch: nothing of it counts
            self._clear = True
            return False
        if elastic is not None and model.failure is None and elastic.aborted():
            model.failure = (f"generation {elastic.generation} aborted", False)
        if model.failure is not None:
            return self._recover(current)
        if current is not None and not current.last:
            self._clear = False
            return False
        model.sync()
        if model.failure is not None:
            return self._recover(current)
        self._apply(closure)
        if current is not None:
            model.sampler.step = current.step + 1
        return True

    def _apply(self, closure: Any = None) -> None:
        self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self._clear = True
        elastic = self.model.elastic
        if elastic is not None:
            now = time.perf_counter()
            step = self.model.sampler.step + 1
            elastic.progress(step, now - self._last_commit)
            self._last_commit = now
            timing = self.model._timing
            if not elastic.described and len(timing) == 3:
                forward_s, backward_s = timing[1] - timing[0], timing[2] - timing[1]
                params = sum(p.numel() for p in self.model.module.parameters())
                elastic.describe(forward_s, backward_s, params, self.optimizer)

    def _recover(self, current: MicroBatch | None) -> bool:
        """A failure during this step: the launcher's next plan, then the step again (or,
        rolled forward, applied as the others applied it)."""
        model, elastic = self.model, self.model.elastic
        assert elastic is not None and model.failure is not None
        why, pending = model.failure
        model.failure = None
        step = current.step if current is not None else model.sampler.step
        resume, roll = elastic.recover(
            why, step=step, pending=pending, export=self._export, install=self._install
        )
        if roll:  # the step was committed elsewhere: these sums (their mean) are final
            self._apply()
        model.fresh_buckets()
        self._clear = True
        model.sampler.rewind(resume, elastic.members)
        return roll

    def _export(self) -> tuple[dict, list[torch.Tensor]]:
        return export_state(self.model.module, self.optimizer, self.model.sampler, self._kept)

    def _install(self, header: dict, tensors: list[torch.Tensor]) -> None:
        self._healed = install_state(
            header, tensors, self.model.module, self.optimizer, self.model.sampler
        )
        self._groups = [
            {k: v for k, v in g.items() if k != "params"} for g in header["param_groups"]
        ]
        for obj, state in zip(self._kept, self._healed, strict=False):
            obj.load_state_dict(state)

    def _restore_groups(self) -> None:
        for group, healed in zip(self.optimizer.param_groups, self._groups, strict=True):
            group.update(healed)

    def _at_exit(self) -> None:
        elastic = self.model.elastic
        if elastic is None:
            return
        with contextlib.suppress(Exception):
            elastic.finish(self.model.sampler.step)
        with contextlib.suppress(Exception):
            elastic.close()

    def zero_grad(self, set_to_none: bool = True) -> None:
        del set_to_none  # the gradients are views of the buckets: zeroed, never dropped
        if self._clear:
            self.model.zero_grad_buckets()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"ElasticOptimizer({self.optimizer!r})"
