"""The drop-in data-parallel API for an ordinary PyTorch loop: ``ElasticDataParallel`` in
place of ``DistributedDataParallel``, ``ElasticOptimizer`` around the user's optimizer
(chameleon_runtime.elastic_optimizer; its ``step()`` is the commit point) and
``ElasticSampler`` (chameleon_runtime.sampler) in place of ``DistributedSampler``. The
user keeps their model, loss, dataset, DataLoader, learning-rate schedule and loop::

    model = cr.ElasticDataParallel(model, sampler)  # was DistributedDataParallel(model)
    optimizer = cr.ElasticOptimizer(torch.optim.AdamW(model.parameters()), model)
    for batch in DataLoader(dataset, batch_sampler=sampler):
        loss = loss_fn(model(batch))
        loss.backward()
        if optimizer.step():                       # False while accumulating
            scheduler.step()
        optimizer.zero_grad()

What it does, as DDP does: the parameters and buffers start as rank 0's; gradients are
summed in flat buckets (chameleon_runtime.buckets) and a bucket is all-reduced,
asynchronously, as soon as the last backward of this worker's share of the step has
produced it, overlapping the rest of the backward; when ``backward()`` returns, ``.grad``
is the global batch's mean; buffers follow the replica that computed micro-batch 0, and
unused parameters keep ``.grad`` None (``find_unused_parameters=True``;
chameleon_runtime.stepmeta). What it does differently: a step is a fixed global batch of
micro-batches dealt by the sampler; a worker with several micro-batches of a step
accumulates them (``step()`` returns False until its share is done), and the sum is
divided by the step's micro-batch count, so the gradient is the global batch's mean
however the micro-batches were dealt.

A micro-batch is what one turn of the loop runs: from the first training forward after
an ``optimizer.step()`` to the next ``step()``. Extra forwards in a turn (an evaluation,
a ``no_grad`` pass, a second train-mode forward, a teacher) and several ``backward()``
calls belong to it; ``model.zero_grad()`` and the inner optimizer's ``zero_grad`` behave
as under DDP; the global random state is the script's own (a micro-batch's forwards draw
from a stream of its own, seeded by the step and the micro-batch, so that dropout is the
same wherever it runs, and the script's generator is put back after each forward).

Under ``chameleon run`` a member's failure is recovered in place
(chameleon_runtime.elastic); every ``check_every`` steps the replicas compare a
fingerprint of their weights (chameleon_runtime.consistency).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from chameleon_runtime.buckets import Gradients
from chameleon_runtime.comm import Aborted, CommError
from chameleon_runtime.consistency import DEFAULT_CHECK_EVERY, Consistency
from chameleon_runtime.heal import ReplicaState, check_travels
from chameleon_runtime.pace import PassClock
from chameleon_runtime.replicagroup import ReplicaGroup
from chameleon_runtime.sampler import ElasticSampler, MicroBatch
from chameleon_runtime.shard import Streams, op_seed
from chameleon_runtime.sharding import Sharding, check_even_deal
from chameleon_runtime.shardlayout import local
from chameleon_runtime.stepmeta import StepMeta


class Wrapped(Protocol):
    """An optimizer of the model (chameleon_runtime.elastic_optimizer.ElasticOptimizer):
    the inner one is what a heal and a consistency check read."""

    optimizer: torch.optim.Optimizer

    def apply_rolled(self, turn: int) -> None: ...


@dataclass(frozen=True)
class Outcome:
    """What ``step()`` returns for one turn of the loop; every optimizer of the model
    stepped in that turn gets the same."""

    turn: int
    committed: bool


class ElasticDataParallel(nn.Module):
    """In place of ``DistributedDataParallel(module)``; ``sampler`` deals the micro-batches
    this wrapper's forward passes run (chameleon_runtime.sampler). Under ``chameleon
    run`` it recovers in place (chameleon_runtime.elastic).

    ``find_unused_parameters``: as DDP's; parameters no member's backward reached keep
    ``.grad`` None. ``check_every``: compare the replicas' weights every this many steps
    (0: never; chameleon_runtime.consistency).

    ``shards``: HSDP (chameleon_runtime.sharding): replica groups of this many workers,
    the model sharded within each by FSDP2, ``fully_shard`` applied here to each of
    ``blocks`` and then to the root, with ``fsdp_options`` (``mp_policy``,
    ``reshard_after_forward``, ...)."""

    def __init__(
        self,
        module: nn.Module,
        sampler: ElasticSampler,
        *,
        find_unused_parameters: bool = False,
        check_every: int = DEFAULT_CHECK_EVERY,
        shards: int = 1,
        blocks: Iterable[nn.Module] = (),
        fsdp_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.sampler = sampler
        first = next(module.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        # who the replicas are and how they sum: the generation, the default group, none
        self.replicas = ReplicaGroup(sampler, device, shards)
        self.elastic = self.replicas.elastic
        self.world_size, self.rank = self.replicas.world_size, self.replicas.rank
        if sampler.num_micro_batches < self.world_size:
            raise ValueError(
                f"a step of {sampler.global_batch_size} samples is "
                f"{sampler.num_micro_batches} micro-batches of {sampler.micro_batch_size}, "
                f"fewer than the {self.world_size} workers: each needs one at least"
            )
        check_even_deal(sampler.num_micro_batches, shards)
        sampler.rank, sampler.members = self.rank, list(range(self.world_size))
        sampler.shards = shards
        sampler.before_loop = self._before_loop
        self.failure: tuple[str, bool] | None = None  # (why, pending) of a failed sync
        # A replacement under chameleon run: it takes its state from a live member when a
        # plan takes it in (a sharded model's must not load a checkpoint before: it
        # belongs to no group yet).
        self.replacement = self.elastic is not None and bool(self.elastic.joining)
        if self.elastic is not None and not self.replacement:
            self.elastic.start(sampler.step)
        self._find_unused = find_unused_parameters
        self._hooks: list[Any] = []
        self.optimizers: list[Wrapped] = []
        # FSDP2 within the replica group (chameleon_runtime.sharding); a replacement's
        # model is sharded once a plan takes it in (``_install``): until then it belongs
        # to no group to shard over.
        self.sharding: Sharding | None = None
        if shards > 1:
            self.sharding = Sharding(
                module, self.replicas, blocks, dict(fsdp_options or {}),
                find_unused=find_unused_parameters,
                run=self._group_collective if self.elastic is not None else None,
            )  # fmt: skip
            self.sharding.optimizers = lambda: [o.optimizer for o in self.optimizers]
            self.sharding.rebuilt = self._rebuilt
            if self.elastic is not None:
                self.elastic.reshaper = self.sharding
            if not self.replacement:
                self.sharding.apply()
        self._track()
        self.kept: list[Any] = []  # heal_with's objects
        self._streams = Streams(device)  # a micro-batch's random numbers
        self.consistency = Consistency(self, check_every)
        # -- the turn of the loop in progress ----------------------------------------------
        self.mb: MicroBatch | None = None  # the micro-batch its forwards run
        self.ddp_mode = False  # a batch the sampler did not deal (the script's own loader)
        self.discard = False  # a stale deal's micro-batch (a recovery happened since)
        self.armed = False  # this worker's last micro-batch of the step: its backward syncs
        self.trained = False  # a training forward since the last step()
        self.synced = False  # the step's sums are reduced and in .grad
        self.repeat = False  # a backward after the sync is being summed apart
        self.step_open = False  # the step's first micro-batch has begun
        self._sync_queued = False
        self._shown_queued = False
        self._grads_open = False  # the step's first backward has judged .grad
        self._rolled = False  # a step rolled forward was applied before a heal's export
        self._outcome = Outcome(0, False)
        self._last_commit = time.perf_counter()
        self._cpu_mark = time.process_time()
        self._compute_cpu = 0.0  # the passes' CPU since the last commit (main thread)
        self._passes = PassClock(device)  # ... and their wall time (on CUDA, the device's)
        self._forwards = 0  # the micro-batches they ran
        self._backward_wall: Any = None  # when the backward began (with _backward_cpu)
        self._stop_agreed = False  # the last commit said a member heard a preemption notice
        self._backward_cpu: float | None = None  # thread CPU when the backward began
        if not self.replacement:
            self._broadcast_start()
        self.meta.committed = self.meta.flat_buffers()
        if self.elastic is not None:
            self.elastic.end_at_exit(lambda: self.sampler.step)

    @property
    def sharded(self) -> bool:
        return self.sharding is not None

    def _track(self) -> None:
        """The parameters the step's sums and hooks follow (again after a replacement
        sharded its model: ``fully_shard`` puts new parameter objects in place)."""
        for hook in self._hooks:
            hook.remove()
        self._params = [p for p in self.module.parameters() if p.requires_grad]
        self._names = {p: name for name, p in self.module.named_parameters()}
        self.grads = Gradients(self._params, self.replicas.shards)
        self.meta = StepMeta(self.module, self._params, find_unused=self._find_unused)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._accumulated) for p in self._params
        ]

    def _rebuilt(self) -> None:
        """A re-shard put new sharded parameters in place (chameleon_runtime.reshard):
        the sums and hooks follow them; the buffers are the committed ones still."""
        self._track()
        self.meta.committed = self.meta.flat_buffers()

    def _broadcast_start(self) -> None:
        """Every replica starts from rank 0's weights, as DDP's (sharded: each shard from
        the first replica group's holder of it)."""
        replicas = self.replicas
        if self.elastic is not None:  # the generation's sums with zeros: floating tensors
            buffers = [b for b in self.module.buffers() if b.is_floating_point()]
            params = [local(p.data) for p in self.module.parameters() if p.is_floating_point()]
            if self.sharding is not None:
                replicas.broadcast_from(replicas.column[0], params, column=True)
            else:
                buffers = params + buffers
            replicas.broadcast_from(0, buffers)
        elif replicas.group:  # torchrun's default group and its subgroups
            with torch.no_grad():
                for p in self.module.parameters():
                    if self.sharding is not None:
                        dist.broadcast(
                            local(p.data), replicas.column[0], group=replicas.column_group
                        )
                    else:
                        dist.broadcast(p.data, 0)
                for b in self.module.buffers():
                    dist.broadcast(b.data, 0)

    def _group_collective(self, kind: str, output: torch.Tensor, tensor: torch.Tensor) -> None:
        """FSDP2's all-gather or reduce-scatter (chameleon run: chameleon_runtime.sharding).
        A failure is kept, not raised in the script's forward or backward: the output is
        zeros, the step is redone once ``step()`` has recovered, and the turn's later
        collectives are not posted (the group is broken)."""
        if self.mb is None:  # outside a training turn (an evaluation): as the script's own
            self.replicas.shard_collective(kind, output, tensor)
            return
        if self.discard:
            # A stale deal's turn (a batch the loader drew before a recovery): it posts
            # nothing, so that the group's real turns stay paired, and is thrown away.
            output.zero_()
            return
        if self.failure is None:
            try:
                self.replicas.shard_collective(kind, output, tensor)
                return
            except (Aborted, CommError) as exc:
                self.failure = (str(exc), False)
        output.zero_()

    def _export(self) -> tuple[dict, list[torch.Tensor]]:
        """What a heal sends (chameleon_runtime.heal). Never a sharded model's stale
        shards: rows a re-shard moved here that no mesh has taken yet (its groups' build
        failed after the plan was agreed) are not in the model."""
        if self.sharding is not None and self.sharding.holds_unset_rows:
            raise RuntimeError(
                f"chameleon: rank {self.rank} was asked to heal a replacement while its "
                "re-sharded rows are not set up (a failure right after the re-shard): it "
                "stops rather than send stale shards"
            )
        return self.replica.export()

    @property
    def replica(self) -> ReplicaState:
        return ReplicaState(
            self.module,
            [o.optimizer for o in self.optimizers],
            self.sampler,
            self._streams.seeder,
            self.kept,
        )

    # -- the script's set-up ---------------------------------------------------------------

    def heal_with(self, *objects: Any) -> None:
        """Objects with ``state_dict``/``load_state_dict`` (a schedule, a GradScaler, an
        EMA of the weights; tensors included) that a replacement takes from a live member
        besides the model, the optimizers, the sampler's position and the random state."""
        for obj in objects:
            try:
                check_travels(obj)
            except TypeError as exc:
                raise TypeError(f"heal_with: {exc}") from None
            self.kept.append(obj)

    def _before_loop(self) -> None:
        """The loop starts (the sampler is iterated): a replacement is taken in here, once
        the script has built everything and loaded whatever checkpoint it loads, so that
        what it heals from a live member is what it trains from."""
        if not self.step_open:  # the buffers the script set up (a checkpoint it loaded)
            self.meta.committed = self.meta.flat_buffers()
        elastic = self.elastic
        if elastic is None or not elastic.joining or elastic.joined:
            return
        resume = elastic.join(self.replica.export, self._install)
        self.sampler.rewind(resume, elastic.members)
        self.meta.committed = self.meta.flat_buffers()
        self.consistency.last_checked = -1

    def _install(self, header: dict, tensors: list[torch.Tensor]) -> None:
        """What a live member sent (chameleon_runtime.heal), over what the script built and
        loaded: the optimizers' groups (learning rates a schedule's constructor set from
        this process's start) come with their states, the heal_with objects after."""
        if self.sharding is not None and not self.sharding.applied:  # a replacement, taken in
            self.sharding.apply_to_replacement([o.optimizer for o in self.optimizers])
            self._track()  # (fully_shard put new parameter objects in place)
        for obj, state in zip(self.kept, self.replica.install(header, tensors), strict=False):
            obj.load_state_dict(state)

    # -- the forward ---------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (torch.is_grad_enabled() and self.training):
            return self.module(*args, **kwargs)
        if self.mb is None and not self._begin():
            return self.module(*args, **kwargs)  # after step(), before the next batch
        self.trained = True
        if self.ddp_mode:  # the script's own loader: its own random state, as under DDP
            out = self.module(*args, **kwargs)
            self._watch_backward(out)
            return out
        # Random ops (dropout) draw the same numbers for a micro-batch wherever it runs: a
        # run that lost a worker, whose micro-batches others computed, trains the same
        # weights as one that did not.
        if self.elastic is not None:
            self.elastic.mark(0)  # (the first step's forward, timed for the planner)
        started, wall = time.thread_time(), self._passes.start()
        with self._streams.drawing(op_seed(self.sampler.seed, self.mb.step, self.mb.index, 0)):
            out = self.module(*args, **kwargs)
        self._compute_cpu += time.thread_time() - started
        self._passes.stop(wall)
        self._forwards += 1
        if self.elastic is not None:
            self.elastic.mark(1)
        self._watch_backward(out)
        return out

    def _begin(self) -> bool:
        """The first training forward of a turn of the loop: which micro-batch it runs.
        False for a forward between ``step()`` and the loader's next batch."""
        issued = self.sampler.issued
        if issued:
            mb = issued[0]
            self.ddp_mode = False
        elif self.sampler.iterating:
            return False
        else:
            if self.elastic is not None:
                raise RuntimeError(
                    "chameleon run: the loader must draw its batches from the "
                    "ElasticSampler (DataLoader(dataset, batch_sampler=sampler)): a "
                    "recovery deals a step's samples again"
                )
            # The script's own loader (DistributedSampler): one batch per worker a step.
            mb = MicroBatch(self.sampler.step, self.rank, last=True, deal=self.sampler.deal_id)
            self.ddp_mode = True
        self.mb = mb
        self._backward_cpu = None  # (a backward that raised never ran its callback)
        self._streams.new()
        self.discard = mb.deal != self.sampler.deal_id
        self.armed = not self.discard and mb.last
        if self.discard:
            self.meta.stale_forward()
            return True
        if not self.step_open:
            self.step_open = True
            self.synced = False
            # What .grad holds since the last commit is judged at the step's first
            # backward, not here: a loop may zero it between its forward and backward.
            self._grads_open = False
            self.meta.begin_step()
            if self.elastic is not None:  # (a fault injected at this step fires here)
                self.elastic.control.step_failpoint(mb.step)
            self._check_consistency()
        elif self.grads.scratch_exposed:
            self.grads.hide()  # the zeros shown after the last micro-batch's backward
        # (the buffers follow micro-batch 0's holder: chameleon_runtime.stepmeta)
        self.meta.micro_batch(first=mb.index == 0 or (self.ddp_mode and self.rank == 0))
        if self.armed:
            self.grads.arm()
        return True

    def _watch_backward(self, out: Any) -> None:
        """A backward reaches the forward's outputs before any parameter's gradient: the
        moment to tell a second backward of a turn, whose gradients must be summed apart
        from the step's reduced mean (chameleon_runtime.buckets)."""
        for t in _tensors(out):
            if t.requires_grad and t.grad_fn is not None:
                t.grad_fn.register_prehook(self._backward_begins)

    def _backward_begins(self, grad_outputs: Any) -> None:
        """The backward reached the forward's outputs: on the backward's own graph task
        (an inner one, such as reentrant activation checkpointing's, would run its
        callbacks before the other layers' gradients arrived), before any parameter's
        gradient is accumulated."""
        if self.mb is None:
            return
        if self._backward_cpu is None:  # (the passes' CPU, for the launcher's fit)
            self._backward_cpu, self._backward_wall = time.thread_time(), self._passes.start()
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_timed)
        if self.synced and not self.repeat and not self.discard:
            self.repeat = True
            self.grads.hide()
            torch.autograd.Variable._execution_engine.queue_callback(self._repeat_done)
            return
        if not self._grads_open:
            self.grads.open_step()
            self._grads_open = True
        elif self.grads.scratch_exposed:
            self.grads.hide()
        if self.armed and not self.synced:
            self._queue_sync()
        elif not self.armed:
            self._show_zeros_after()

    def _backward_timed(self) -> None:
        """The backward's passes are done (queued before the step's sums, which are the
        runtime's, not the model's): their CPU."""
        if self._backward_cpu is not None:
            self._compute_cpu += time.thread_time() - self._backward_cpu
            self._passes.stop(self._backward_wall)
            self._backward_cpu = None

    def charge_cpu(self, seconds: float) -> None:
        """CPU an optimizer spent applying a step: counted with the passes'."""
        self._compute_cpu += seconds

    def _queue_sync(self) -> None:
        if not self._sync_queued:
            # As DDP: the sums are complete when backward() returns, so that what the
            # loop does between it and step() (clipping, logging a norm) sees them.
            torch.autograd.Variable._execution_engine.queue_callback(self.sync)
            self._sync_queued = True

    def _backward_ended(self) -> None:
        """A backward that left the step's sums hidden (accumulating, or a stale deal's
        micro-batch): ``.grad`` shows zeros (chameleon_runtime.buckets)."""
        self._shown_queued = False
        if not self.synced and not self.repeat:
            if self.sharding is not None and self.elastic is not None and not self.discard:
                # A group agrees on an accumulating turn too (chameleon_runtime.sharding:
                # ``agree``): a member whose collective saw the launcher's abort first
                # shows None, its mate whose same collective ended first would show
                # zeros, and a norm the loop takes of them is a collective of the group
                # that one member no longer joins.
                self.failure = self.sharding.agree(self.failure)
            broken = self.failure is not None or (self.sharded and self.discard)
            self.grads.expose_scratch(broken=broken)

    # -- the backward's hooks --------------------------------------------------------------

    def _accumulated(self, param: nn.Parameter) -> None:
        if self.mb is None or self.discard:
            param.grad = None  # a stale deal's micro-batch, or no micro-batch: not counted
            self._show_zeros_after()
            return
        if self.repeat:
            self.grads.take_extra(param)
            return
        if self.synced:
            raise self._outside(param)
        if not self._grads_open:
            # A backward that reached this parameter before the model's outputs (used
            # outside the forward too, by a regularizer): the others are judged now,
            # this one's gradient is the backward's own unless it went into a view of ours.
            if not self.grads.open_step(taking=param):
                raise self._outside(param)
            self._grads_open = True
        if not self.grads.take(param):
            raise self._outside(param)
        if not self.armed:
            self._show_zeros_after()
            return
        self._queue_sync()
        if self.replicas.distributed and self.failure is None:
            try:
                self.grads.filled(param, self.replicas.post)
            except (Aborted, CommError) as exc:
                self.failure = (str(exc), False)

    def _outside(self, param: nn.Parameter) -> RuntimeError:
        name = self._names.get(param, "?")
        return RuntimeError(
            f"chameleon: parameter {name!r} got a gradient the step's sums cannot take, by a "
            "backward that did not pass through the model's outputs (a parameter used "
            "outside ElasticDataParallel's forward, with a gradient still in .grad): "
            "zero the gradients first, or use it inside the forward"
        )

    def _show_zeros_after(self) -> None:
        if not self._shown_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
            self._shown_queued = True

    def sync(self) -> None:
        """The step's sums, divided into its mean: what the last backward did not launch
        (a parameter with no gradient in it) goes out now, in order; then each is waited
        for. Under chameleon run a failure here is not raised (it would end the user's
        backward()): it is kept, and ``ElasticOptimizer.step`` recovers."""
        self._sync_queued = False
        if self.synced or not self.armed:
            return
        if self.elastic is not None:
            self.elastic.mark(2)
        grads = self.grads
        grads.zero_unwritten()
        if not self.meta.find_unused:
            unused = grads.unused()
            if unused:
                names = ", ".join(repr(self._names.get(p, "?")) for p in unused[:3])
                raise RuntimeError(
                    f"chameleon: parameter(s) {names}{' ...' if len(unused) > 3 else ''} got "
                    f"no gradient in step {self.mb.step if self.mb else '?'} on rank "
                    f"{self.rank}: pass find_unused_parameters=True to "
                    "cr.ElasticDataParallel, as DDP needs it"
                )
        if self.replicas.distributed and self.failure is None:
            try:
                grads.post_rest(self.replicas.post)
                grads.wait_all(self.replicas.wait)
            except (Aborted, CommError) as exc:
                self.failure = (str(exc), False)
        if self.sharding is not None and self.elastic is not None:
            self.failure = self.sharding.agree(self.failure)
        if self.failure is not None:
            grads.expose_scratch(broken=True)  # the sums are incomplete: the step is redone
            return
        grads.divide(self._count())
        grads.add_carried()
        grads.expose()
        self.synced = True

    def _repeat_done(self) -> None:
        """A second backward after the sync: its sums, all-reduced, divided and added to
        the step's mean (chameleon_runtime.buckets)."""
        self.repeat = False
        try:
            if self.failure is None:
                self.grads.reduce_extra(self.replicas.post, self.replicas.wait, self._count())
        except (Aborted, CommError) as exc:
            self.failure = (str(exc), False)
        if self.failure is not None:
            self.grads.expose_scratch(broken=True)  # the step is redone
            return
        self.grads.expose()

    def _count(self) -> int:
        # The global batch's mean: its micro-batches' count when the sampler dealt them;
        # DDP's world size for batches it did not deal.
        return self.world_size if self.ddp_mode else self.sampler.num_micro_batches

    # -- the turn's end: step() ----------------------------------------------------------

    def turn(self) -> Outcome:
        """``step()`` of the turn in progress (every ElasticOptimizer of the model calls
        it; the first call of a turn ends it, later ones get the same outcome)."""
        if not self.trained:
            return self._outcome
        mb = self.mb
        assert mb is not None
        elastic = self.elastic
        if self.discard:
            return self._end_turn(False)
        if elastic is not None and self.failure is None and elastic.aborted():
            self.failure = (f"generation {elastic.generation} aborted", False)
        if self.failure is not None:
            return self._end_turn(self._recover(mb))
        if not self.armed:
            return self._end_turn(False)
        if not self.synced:
            self.sync()  # a turn whose backward reached no parameter of this worker
            if self.failure is not None:
                return self._end_turn(self._recover(mb))
        if not self._exchange(mb):
            return self._end_turn(self._recover(mb))
        if elastic is not None and not self._commit(mb):
            return self._end_turn(self._recover(mb))
        return self._end_turn(self._committed(mb))

    def _exchange(self, mb: MicroBatch) -> bool:
        """The step's metadata (chameleon_runtime.stepmeta), before the commit."""
        try:
            self.meta.exchange(self.grads.written, self.replicas.allreduce)
        except (Aborted, CommError) as exc:
            self.failure = (str(exc), False)
            return False
        return True

    def _commit(self, mb: MicroBatch) -> bool:
        """Every member has the step's sums once this all-reduce ends (the commit: module
        doc of chameleon_runtime.elastic), and it says which step each commits: a member
        at another step is never applied silently. Posted and not seen to end, the step
        may be applied elsewhere: pending, the next plan says."""
        assert self.elastic is not None
        try:
            self._stop_agreed = self.meta.commit(
                mb.step,
                self.replicas.allreduce,
                f"generation {self.elastic.generation}",
                stop_asked=self.elastic.control.interrupts.preempt_signal is not None,
            )
        except (Aborted, CommError) as exc:
            self.failure = (str(exc), True)
            return False
        return True

    def _committed(self, mb: MicroBatch) -> bool:
        """The step holds: globally unused parameters drop their gradient, the sampler
        moves on, the launcher hears of the progress."""
        for p in self.meta.committed_step():
            p.grad = None
        self.sampler.step = mb.step + 1
        self.step_open = False
        elastic = self.elastic
        if elastic is not None:
            now, cpu = time.perf_counter(), time.process_time()
            # (the CPU of the whole process, every thread: what a step costs a host whose
            # cores the workers share)
            elastic.progress(
                mb.step + 1, now - self._last_commit, cpu - self._cpu_mark, self._compute_cpu,
                self._passes.take(), self._forwards,
            )  # fmt: skip
            self._last_commit, self._cpu_mark, self._compute_cpu = now, cpu, 0.0
            self._forwards = 0
            if self._stop_agreed and elastic.preempted_at is None:
                elastic.preempted_at = mb.step + 1  # every member: the same commit
            if self.optimizers:
                elastic.describe_measured(
                    lambda: sum(p.numel() for p in self.module.parameters()),
                    self.optimizers[0].optimizer,
                )
        return True

    def _end_turn(self, committed: bool) -> Outcome:
        if self.mb is not None and self.sampler.issued and self.sampler.issued[0] is self.mb:
            self.sampler.issued.pop(0)
        self.mb = None
        self.trained = False
        self.discard = False
        self.armed = False
        if not committed:
            self.synced = False
        self._outcome = Outcome(self._outcome.turn + 1, committed)
        return self._outcome

    def after_apply(self) -> None:
        """An optimizer applied the step: what it did to .grad in place is not the
        script's (chameleon_runtime.buckets); the next turn begins a new step."""
        self.synced = False
        self.grads.mark_exposed()

    # -- recovery --------------------------------------------------------------------------

    def _recover(self, mb: MicroBatch) -> bool:
        """A failure during this step: the launcher's next plan, then the step again (or,
        rolled forward, applied as the others applied it: True)."""
        elastic = self.elastic
        assert elastic is not None and self.failure is not None
        why, pending = self.failure
        self.failure = None
        # The abandoned step's forwards moved the buffers: back to the last commit's, before
        # a heal exports them (a replacement got the uncommitted ones: BatchNorm's count
        # one ahead after 3 replacements in a 3,000-step soak).
        self.meta.restore()
        self._rolled = False
        resume, roll = elastic.recover(
            why, step=mb.step, pending=pending, export=self._export,
            install=self._install, roll_now=lambda: self._roll_now(mb),
        )  # fmt: skip
        self.sampler.rewind(resume, elastic.members)
        self.consistency.last_checked = -1  # (as every member of the new generation)
        if roll or self._rolled:  # committed elsewhere: these sums (their mean) are final
            if self._rolled:  # (applied already, before this member sent its state)
                return True
            return self._committed(mb)
        self.meta.abandon_step()
        self.grads.renew_in_flight()
        self.synced = False
        self.repeat = False
        self.step_open = False
        self._sync_queued = False
        return False

    def _roll_now(self, mb: MicroBatch) -> None:
        """Apply the step rolled forward at once, every optimizer of the model, before this
        member sends its state to a replacement (chameleon_runtime.elastic); their step()
        calls of this turn then find it applied."""
        self._committed(mb)
        turn = self._outcome.turn + 1  # the turn _end_turn is about to close
        for optimizer in self.optimizers:
            optimizer.apply_rolled(turn)
        self._rolled = True

    def _check_consistency(self) -> None:
        try:
            self.consistency.maybe_check(self.sampler.step)
        except (Aborted, CommError) as exc:
            self.failure = (str(exc), False)  # step() recovers


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a forward's output (a tensor, a tuple, a dict, a ModelOutput)."""
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, list | tuple):
        return [t for v in out for t in _tensors(v)]
    return []


# The old name, kept: it read as torch.nn.DataParallel, which it does not replace.
DataParallel = ElasticDataParallel
