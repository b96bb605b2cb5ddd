"""The worker's side of a recovery: leave a generation, report what it holds, and carry
out the launcher's next plan: ``Membership``, which the trainer's step loop
(chameleon_runtime.trainer) reads and a recovery moves.

A plan is applied in four steps, each of which a new failure may interrupt:

1. ``groups``: an all-or-none agreement that every member of the new generation is here,
   then its process group is built (so a build never waits for a member that is gone);
2. ``migrate``: layers move from their holders to the workers that lack them, in the
   planner's colouring rounds; each layer's header (shapes, optimizer-state keys) travels
   through gloo ahead of its tensors, so a migration leaves no key in the store;
3. ``migrated``: an all-or-none agreement that every transfer completed. Only when it
   holds does any worker import what it received or free what it gave away: a receiver
   that did not finish holds nothing new, a sender frees nothing before every transfer
   is confirmed, and holders never disagree. Where layers moved, a second agreement,
   ``installed``, lets every member start training together: the plan's first step
   needs all of them, and a member that started early only took the CPU that the
   others, still installing or waking, needed (on the 2-core test bed the last member
   woke 11-16 ms after the first began training, 3-5 ms with the agreement: the
   migration measured 29 ms instead of 42-46);
4. ``Applied`` to the leader, and training goes on from the step the plan names.

Groups are carried over, not rebuilt, when they can be (planner.estimator.transition charges the
same): a gloo group whose member died still carries point-to-point traffic between the
others, and everything the runtime sends is point to point. So a new generation whose
members all belong to the group of the last generation this worker applied keeps that
group (a reroute always, a re-partition over survivors too); one that takes in a worker
from outside builds a new group. Every member publishes which group it could carry
over before the ``groups`` agreement and reads the others' after it, so all of them
decide alike. A message left unmatched on the group would match a later generation's next
message of the same pair (a survivor drains a step a peer aborted before starting it;
a migration is interrupted half way), so a worker offers the group only once every
message it posted there has completed (``Kept.settled``), and never after its migration
on it was interrupted. When all members offer it, nothing is left posted in it.

Whatever interrupts it, the worker reports ``Ready`` again, with the generation it left,
the last one it applied and what it really holds, and waits for the next plan.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from chameleon_runtime.comm import (
    COLLECTIVE_RELEASE,
    Aborted,
    Collective,
    CommError,
    Generation,
    Kept,
)
from chameleon_runtime.control import STORE_LOST, Finished
from chameleon_runtime.memory import Meter
from chameleon_runtime.protocol.messages import Applied, GroupOffer, Joined, Ready, holders_key
from chameleon_runtime.protocol.wire import PlanMessage, TransferWire
from chameleon_runtime.reducer import Reducer
from chameleon_runtime.shard import Shard, pack_layers, unpack_layers
from chameleon_runtime.step import apply_norm
from chameleon_runtime.transport import Transport
from planner.plans.program import Allreduce, WorkerProgram, worker_program

if TYPE_CHECKING:
    from chameleon_runtime.control import Control
    from planner.plans.plan import Plan


def move_layers(
    gen: Generation, shard: Shard, transfers: Sequence[TransferWire], me: int
) -> list[tuple[dict, list[torch.Tensor]]]:
    """Send and receive layer state, round by round (a worker takes part in one transfer
    per round); a transfer is two messages, its sizes and its layers packed
    (``shard.pack_layers``), matched by order: both sides take the rounds in order and a
    round's transfers in list order. What ``me`` received, unpacked, not yet installed. (The
    profile times a chain of transfers through this same function.)"""
    received = []
    for r in sorted({t.round for t in transfers}):
        for t in transfers:
            if t.round != r or me not in (t.src, t.dst):
                continue
            if t.src == me:
                layers = [shard.export_layer(i) for i in range(t.first_layer, t.end_layer)]
                blob, header_len = pack_layers(layers)
                sizes = torch.tensor([header_len, blob.numel()], dtype=torch.int64)
                gen.send(sizes, t.dst)
                gen.send(blob, t.dst)
            else:
                sizes = gen.recv(torch.zeros(2, dtype=torch.int64), t.src)
                blob = gen.recv(torch.empty(int(sizes[1]), dtype=torch.uint8), t.src)
                received += unpack_layers(blob, int(sizes[0]))
        gen.flush_sends()
    return received


class Membership:
    """This worker's place in the job: the generation it is in and the last it applied,
    the plan and its program, the generation's group (and the one kept for the next to
    carry over), a ring's collective groups and reducer, the step it is at, and a step
    whose commit it did not learn. The trainer's step loop reads it; a recovery (the
    launcher's next plan) moves it. Handed what it acts on: the control channel, the
    shard of layers it moves, and the rules a rolled-forward step is applied by."""

    def __init__(
        self,
        *,
        rank: int,
        control: Control,
        shard: Shard,
        meter: Meter,
        transport: Transport,
        layer_params: list[int],
        allreduce: Allreduce,
        global_norm: bool,
        max_grad_norm: float | None,
        lr_schedule: Callable[[int], float] | None,
        losses: dict[int, float],
    ) -> None:
        self.rank = rank
        self.control = control
        self.shard = shard
        self.meter = meter
        self.transport = transport
        self.layer_params = layer_params
        self.allreduce = allreduce  # how holders sum a bucket: "ring", or "exchange" (exact)
        self.global_norm = global_norm  # each step reads the gradients' global norm
        self.max_grad_norm = max_grad_norm
        self.lr_schedule = lr_schedule
        self.losses = losses  # the trainer's: a rolled-forward step's loss goes there too
        self.generation = 0
        self.applied = 0  # the last generation whose migration this worker completed
        self.plan: Plan | None = None
        self.part: WorkerProgram | None = None
        self.gen: Generation | None = None
        self.kept: Kept | None = None  # the last applied generation's group, to carry over
        # A ring's collective groups by holders, across generations (chameleon_runtime.comm)
        self.collectives: dict[tuple[int, ...], Collective] = {}
        self.reducer: Reducer | None = None  # the ring's, for ``part`` (built at its first step)
        self.groups_s = 0.0  # what building (or carrying over) the last group took
        self.step = 0
        self.recoveries = 0
        # A plan said to stop for a preemption notice (PlanMessage.stop): save, then leave.
        self.stopping = False
        # A ring's commit (chameleon_runtime.step): what the last one summed, and the step
        # whose commit this worker voted for without learning the decision.
        self.committed: tuple[float, float, float] | None = None
        self.pending: int | None = None
        # The generation of a plan that left this worker out while it held layers: it
        # keeps them until every member applied that plan (``Settled``) or training ends:
        # a failure before its members agree their transfers completed is planned from
        # the layout before it, in which they count.
        self.reserve_for: int | None = None

    # -- generations ---------------------------------------------------------------------

    def launch(self, plan: Plan, step: int) -> None:
        """Generation 0, from ``step``: enter it as a holder, or wait as a spare where the
        plan leaves this worker out (the planner's launch layout may use fewer workers).
        A member lost before generation 0's group was built is recovered from in place
        (the launcher aborts generation 0 as any other): a restart used to follow."""
        self.step = step
        self.control.status.update(step=step)
        if self.rank in plan.stage_of:
            try:
                self.enter(0, plan, plan.workers)
            except (Aborted, CommError) as exc:  # a member lost before its group was built
                self.recover(str(exc))  # (it holds its layers: the next plan keeps them)
                return
            self.keep(self.gen.kept if self.gen is not None else None)
            self.control.status.update(phase="train")
        else:
            self.generation, self.plan, self.part = 0, plan, None
            self.control.status.update(phase="spare", generation=0)

    def enter(self, generation: int, plan: Plan, members: list[int]) -> None:
        """Agree that every member is here, then build the generation's group."""
        self.generation, self.plan = generation, plan
        self.control.status.update(phase="groups", generation=generation)
        self.control.failpoint("groups")
        keys = self.control.keys
        carries = self.transport.carries_over  # gloo only (module doc)
        kept = self.kept if carries else None
        usable = kept is not None and kept.settled and set(members) <= set(kept.members)
        offer = kept if usable else None
        settled = {h: c.built for h, c in self.collectives.items() if carries and c.settled}
        mine = GroupOffer(
            p2p=offer.built if offer else -1,
            collectives={holders_key(h): built for h, built in settled.items()},
        )
        self.control.put(keys.kept(generation, self.rank), mine)
        if not self.control.agree(generation, "groups", len(members)).held:
            raise Aborted(f"generation {generation} aborted before its groups were built")
        part = (
            worker_program(
                plan, self.rank, self.layer_params, global_norm=self.global_norm,
                allreduce=self.allreduce,
            )
            if self.rank in plan.stage_of
            else None
        )  # fmt: skip
        # A ring's buckets: a group per set of holders (chameleon_runtime.comm).
        wanted = [b.holders for b in part.buckets] if part and part.allreduce == "ring" else []
        if offer is not None or settled:
            raw = self.control.store.multi_get([keys.kept(generation, r) for r in members])
            offers = dict(zip(members, map(GroupOffer.model_validate_json, raw), strict=True))
            if offer is not None and any(o.p2p != offer.built for o in offers.values()):
                offer = None
            # A collective group every holder offers from the same build is carried over.
            carried = {
                h
                for h in wanted
                if h in settled
                and all(offers[r].collectives.get(holders_key(h)) == settled[h] for r in h)
            }
        else:
            carried = set()
        for h in [h for h in self.collectives if h not in carried]:
            self.collectives.pop(h).let_go(self.transport, COLLECTIVE_RELEASE)
        t0 = time.perf_counter()
        self.gen = self.control.generation(
            generation, members, self.collectives, wanted, adopt=offer, transport=self.transport
        )
        self.groups_s = time.perf_counter() - t0
        self.meter.reset()  # a new layout: its own peak
        self.part = part

    def keep(self, kept: Kept | None) -> None:
        """Hold ``kept`` for the next generation to carry over (None: hold nothing)."""
        if kept is self.kept:
            return
        if kept is not None:
            kept.acquire()
        if self.kept is not None:
            self.kept.let_go()
        self.kept = kept

    def leave(self, *, keep_grads: bool = False) -> None:
        if self.reducer is not None:
            self.reducer.close(keep_grads=keep_grads)
            self.reducer = None
        if self.gen is not None:
            self.gen.abandon()
            self.gen = None
        if not self.transport.carries_over:  # aborted, never carried (transport's doc)
            self.let_go_of_collectives()

    def let_go_of_collectives(self) -> None:
        while self.collectives:
            self.collectives.popitem()[1].let_go(self.transport, COLLECTIVE_RELEASE)

    def ring_reducer(self) -> Reducer | None:
        """The ring's reducer for the current program, built at its first step (after
        any migration: it holds views of the layers' gradients); None for exchange."""
        if self.part is None or self.part.allreduce != "ring":
            return None
        if self.reducer is None or self.reducer.part is not self.part:
            if self.reducer is not None:
                self.reducer.close()
            assert self.gen is not None
            self.reducer = Reducer(self.shard, self.part, self.gen)
        return self.reducer

    def _drop_reserve(self) -> None:
        if self.reserve_for is not None:
            self.reserve_for = None
            self.shard.keep_only(0, 0)

    # -- recovery ------------------------------------------------------------------------

    def recover(self, reason: str, *, pending: int | None = None) -> None:
        """Discard the step in progress and carry out the launcher's next plan. ``pending``:
        the step whose commit this worker voted for without learning the decision (a
        ring's: chameleon_runtime.step); its gradients are kept for the plan to settle."""
        left = self.generation
        if pending is not None:
            self.pending = pending
        self.leave(keep_grads=self.pending is not None)
        if self.pending is None:
            self.shard.zero_grad()
        while True:
            self.control.status.update(phase="ready", generation=left)
            try:
                self.control.tell_leader(
                    Ready(
                        rank=self.rank,
                        pid=os.getpid(),
                        after=left,
                        applied=self.applied,
                        # A worker holding nothing (a spare, a replacement) ran no step:
                        # its step is stale. Whoever holds layers holds them as of its step
                        # (a spare's reserve too: the launcher counts it only while the
                        # layout it belongs to is the newest any survivor applied).
                        step=self.step if self.shard.held() else None,
                        held=self.shard.held(),
                        reason=reason[:200],
                        pending=self.pending is not None,
                        committed=list(self.committed) if self.committed else None,
                    )
                )
                message = self.control.next_plan(left)
            except Finished as end:  # training ended meanwhile: nothing more to do
                self._drop_reserve()  # (stale: its plan's members trained on)
                self.control.interrupts._finish(end.step)  # the loop's idle ends at once
                self.step = max(self.step, end.step + 1)
                self.generation, self.part = left, None
                self.control.status.update(phase="spare")
                return
            except STORE_LOST:  # the leader's node is lost: report again to the next one
                if not self.control.reconnect():
                    raise
                continue
            try:
                self._apply(message)
                self.recoveries += 1
                self.control.status.update(recoveries=self.recoveries)
                return
            except (Aborted, CommError) as exc:  # a failure during the recovery itself
                self.leave()
                left, reason = message.generation, str(exc)
            except STORE_LOST as exc:
                if not self.control.reconnect():
                    raise
                self.leave()
                left, reason = message.generation, f"the worker store moved ({exc})"[:200]

    def _settle_pending(self, message: PlanMessage) -> None:
        """The step whose commit this worker did not learn: committed (the plan rolls it
        forward) or not (its gradients are dropped). Module doc of chameleon_runtime.step."""
        if self.pending is None:
            return
        rf = message.roll_forward
        if rf is not None and rf.step == self.pending == self.step:
            self._roll_forward(tuple(rf.values))
        else:
            self.shard.zero_grad()
        self.pending = None

    def _roll_forward(self, committed: tuple[float, ...]) -> None:
        """Apply step ``self.step`` as its committed peers did: the tail after its commit
        (chameleon_runtime.step), with the sums the commit gave them."""
        step, shard = self.step, self.shard
        held = shard.held()
        first, end = held[0], held[-1] + 1
        lr = self.lr_schedule(step) if self.lr_schedule else None
        apply = True
        if self.global_norm:
            apply = apply_norm(step, shard, first, end, committed[1], self.max_grad_norm)
        if apply:
            shard.step(lr)
        shard.zero_grad()
        self.losses[step] = committed[0]
        self.committed = (committed[0], committed[1], committed[2])
        self.step += 1

    def _apply(self, message: PlanMessage) -> None:
        self._settle_pending(message)
        self.stopping = self.stopping or message.stop
        plan = message.plan.to_plan()
        members = sorted(set(plan.workers) | {t.src for t in message.transfers})
        if self.rank not in members:  # neither used nor needed: a spare from now on
            self.generation, self.plan, self.part = message.generation, plan, None
            # What it held is not needed by this plan, and goes stale with the plan's
            # first step. Until every member has applied it, though, a failure is planned
            # from the layout before it, and there these layers may be the last copy of
            # a stage (a 1x1 plan's source lost while it sends: every other holder had
            # let go, and the job fell back to its checkpoint). So they are kept until
            # the plan settles (``idle``), and reported meanwhile. (Until the plan's
            # ``migrated`` agreement, that is: after it its members report it applied,
            # and the launcher plans from its layout, in which they do not count.)
            if self.shard.held() and message.resume_step == self.step:
                self.reserve_for = message.generation
            else:
                self.reserve_for = None
                self.shard.keep_only(0, 0)
            self.let_go_of_collectives()
            self.step = message.resume_step
            self.control.status.update(phase="spare", generation=message.generation)
            return
        if message.resume_step != self.step:
            self._drop_reserve()  # the plan it was kept for settled, and training went on
        self.reserve_for = None  # (a reserve at this step is the plan's to use or drop)
        if self.shard.held() and message.resume_step != self.step:
            raise RuntimeError(
                f"plan resumes at step {message.resume_step}, this worker is at {self.step}"
            )
        self.enter(message.generation, plan, members)
        self.control.status.update(phase="migrate")
        self.control.failpoint("migrate")
        t0 = time.perf_counter()
        try:
            received = self._migrate(message)
        except BaseException:
            if self.kept is not None and self.gen.kept is self.kept:
                self.keep(None)  # messages may be left posted on it (module doc)
            raise
        if not self.control.agree(message.generation, "migrated", len(members)).held:
            raise Aborted(f"generation {message.generation} aborted during its migration")
        # Every transfer is confirmed: only now replace and free state.
        for header, tensors in received:
            self.shard.import_layer(header, tensors)
        if self.rank in plan.stage_of:
            stage = plan.stage_of[self.rank]
            self.shard.ensure(stage.first_layer, stage.end_layer)  # no-op unless a bug
            self.shard.keep_only(stage.first_layer, stage.end_layer)
        else:
            self.shard.keep_only(0, 0)
        self.applied = message.generation
        carried = self.gen.kept is self.kept
        self.keep(self.gen.kept)
        self.step = message.resume_step
        if (
            message.transfers
            and not self.control.agree(message.generation, "installed", len(members)).held
        ):
            raise Aborted(f"generation {message.generation} aborted after its migration")
        migrate_s = time.perf_counter() - t0
        # A source the plan does not use sent its layers and is a spare from now on: it
        # must not read as training at a standing step.
        phase = "train" if self.rank in plan.stage_of else "spare"
        self.control.status.update(phase=phase, step=self.step)
        self.control.tell_leader(
            Applied(
                rank=self.rank,
                generation=message.generation,
                groups_s=self.groups_s,
                migrate_s=migrate_s,
                carried=carried,
                collectives_built=[
                    holders_key(h)
                    for h, c in self.collectives.items()
                    if c.built == message.generation
                ],
                collectives_carried=[
                    holders_key(h)
                    for h, c in self.collectives.items()
                    if c.built != message.generation
                ],
                sent_at=time.time(),
            )
        )

    def _migrate(self, message: PlanMessage) -> list[tuple[dict, list[torch.Tensor]]]:
        assert self.gen is not None
        return move_layers(self.gen, self.shard, message.transfers, self.rank)

    # -- spares and replacements ---------------------------------------------------------

    def join(self, count: int) -> None:
        """A replacement started by the launcher while the job trains (launcher/rejoin.py):
        take the current generation as a spare, holding nothing, and announce it. The
        launcher decides whether to re-partition with us; until then we idle."""
        message = self.control.latest_plan()
        self.generation, self.plan, self.part = message.generation, message.plan.to_plan(), None
        self.step = message.resume_step  # stale until a plan takes us in
        self.control.catch_up(message.generation)  # (what came before it listened)
        self.control.status.update(phase="spare", generation=message.generation)
        self.control.tell_leader(Joined(rank=self.rank, count=count, generation=message.generation))

    def idle(self, steps: int) -> None:
        """A live worker the plan does not use: wait, heartbeating, until a new plan is
        coming (an abort of this generation) or training is over. A reserve it keeps
        (``reserve_for``) is dropped meanwhile, once its plan has settled."""
        interrupts = self.control.interrupts
        while True:
            # Looked at after every wake, the last included: a plan may settle as the wait
            # ends (both messages read before this looks), and a settled plan's reserve
            # is stale; the next plan must not find it held.
            if self.reserve_for is not None and interrupts.settled_upto >= self.reserve_for:
                self._drop_reserve()
            if interrupts.finished is not None or interrupts.aborted(self.generation):
                break
            event = threading.Event()
            with interrupts.watch(self.generation, event, settled=self.reserve_for is not None):
                event.wait()
        if interrupts.finished is not None:
            self._drop_reserve()  # (any reserve: the dump would show a stale holder)
            self.step = max(steps, interrupts.finished + 1)
        else:
            self.recover("a new plan")
