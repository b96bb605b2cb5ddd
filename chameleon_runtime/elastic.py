"""The drop-in data-parallel API under ``chameleon run``: in-place recovery for an
ordinary loop (chameleon_runtime.dataparallel). Under torchrun the drop-in API sums on
the default process group, as DDP; under chameleon run it speaks the runtime's protocol
with the launcher (chameleon_runtime.protocol.messages), as the Trainer does, over groups
of its own:

- The job is one stage (the whole model, "layer" 0) held by every member; the plan's
  workers are the members, and the sampler deals each step's micro-batches among them.
- A step's gradients are all-reduced on a collective group of the generation's members
  (chameleon_runtime.comm: an abort ends every wait), then a small all-reduce, the
  commit, says every member has the step's sums and which step each commits. A worker
  that saw the commit applies the step; one that posted it and did not see it end keeps
  the sums (``pending``), and the next plan says whether the step was applied elsewhere
  (``roll_forward``): then it applies it too. A failure before the commit leaves the step
  to be redone by the new members, the sampler dealing its micro-batches among them.
- On a failure (a peer's death breaking the all-reduce, the launcher's abort), the
  worker reports ``Ready`` with the step it is at and waits for the next plan, builds
  the new generation's groups (its own, and the script's default process group:
  chameleon_runtime.usergroup), heals whoever the plan says lacks the state (a
  replacement: model, optimizers, sampler position, random state and the heal_with
  objects, streamed from a live member: chameleon_runtime.heal), reports ``Applied`` and
  goes back to the loop, whose next micro-batches are the interrupted step dealt anew.
- A replacement started by the launcher announces itself (``Joined``) when its loop
  starts (after the script's set-up and whatever checkpoint it loads) and waits there,
  as a spare, until a plan takes it in (then heals and trains to the end, a member like
  any other) or training ends (then the process exits 0: it has nothing to train).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import torch

from chameleon_runtime import preemption, usergroup
from chameleon_runtime.comm import COLLECTIVE_RELEASE, Aborted, Collective, CommError, Generation
from chameleon_runtime.control import STORE_LOST, Control, Finished
from chameleon_runtime.heal import receive_state, send_state
from chameleon_runtime.pace import Pace
from chameleon_runtime.profile import host_cores, memory_per_worker, optimizer_bytes_per_param
from chameleon_runtime.protocol.messages import Applied, Finish, Joined, Ready
from chameleon_runtime.protocol.wire import JobDescription, PlanMessage
from chameleon_runtime.sampler import uneven_shares
from chameleon_runtime.shardlayout import ShardLayout
from chameleon_runtime.transport import GlooTransport
from planner.job.costtable import LayerCost
from planner.plans.plan import data_parallel

if TYPE_CHECKING:
    from chameleon_runtime.sampler import ElasticSampler


class Reshaper(Protocol):
    """A sharded model's re-shard (chameleon_runtime.sharding.Sharding): the rows move
    during the migration; the model is set up on them when its mesh is rebuilt."""

    def move(
        self,
        old: ShardLayout,
        new: ShardLayout,
        me: int,
        pairs: list[tuple[int, int]],
        send: Callable[[torch.Tensor, int], None],
        recv: Callable[[torch.Tensor, int], Any],
        flush: Callable[[], None],
    ) -> None: ...

    def commit(self) -> None: ...

    def regroup(self, layout: ShardLayout) -> None: ...

    def forget(self) -> None: ...


def under_chameleon() -> bool:
    """Launched by ``chameleon run``, which sets CHAMELEON_RUN_DIR for every worker (the
    job token only where the run has one)."""
    return "CHAMELEON_RUN_DIR" in os.environ and "MASTER_ADDR" in os.environ


class Membership:
    """This worker's place in the job under chameleon run: the generation, its group,
    and the recovery protocol. What a heal sends and installs the caller hands in
    (``export``, ``install``: chameleon_runtime.dataparallel.ElasticOptimizer)."""

    def __init__(self, sampler: ElasticSampler, device: str, *, shards: int = 1) -> None:
        env = os.environ
        self.rank = int(env["RANK"])
        self.world_size = int(env["WORLD_SIZE"])
        self.sampler = sampler
        self.device = device
        self.control = Control(
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            self.rank,
            attempt=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        )
        self.control.register(device)
        self.generation = 0
        self.applied = 0
        self.gen: Generation | None = None
        self.transport = GlooTransport()  # CPU tensors over gloo, as the Trainer's default
        self.collectives: dict[tuple[int, ...], Collective] = {}
        self.members: list[int] = list(range(self.world_size))
        self.shards = shards  # a sharded model's replica groups (chameleon_runtime.sharding)
        self.unit_params = 0  # its largest FSDP unit (ElasticDataParallel says)
        self.row_counts: tuple[int, ...] = ()  # its parameters' rows (dim 0), for row sums
        self.reshaper: Reshaper | None = None  # a sharded model's re-shard (Sharding)
        self.layout = ShardLayout(tuple(self.members), shards)
        self.described = False
        self._timing: list[float] = []  # the first step's forward start and end, backward end
        self.joining = env.get("CHAMELEON_JOIN")
        self.joined = False  # a replacement taken in
        self._progress = 0  # steps this process committed
        # The steps committed when the members agreed to stop for a preemption notice
        # (chameleon_runtime.preemption): the same on every member.
        self.preempted_at: int | None = None
        preemption.follow(lambda: self.preempted_at is not None)
        self._slowest = 0.0
        self._pace = Pace()

    # -- generation 0 ----------------------------------------------------------------------

    def start(self, step: int) -> None:
        """Publish generation 0 (the chief) and build its group."""
        self.sampler.step = step
        # every member holds the model (one layer), the step dealt as the sampler deals it
        plan = data_parallel(self.members, self.sampler.num_micro_batches, self.shards)
        if self.rank == 0:
            message = PlanMessage.build(generation=0, policy="initial", resume_step=step, plan=plan)
            self.control.put_signed(self.control.keys.plan(0), message)
            self.control.put_signed(self.control.keys.latest, "0")
        self._enter(0, self.members, build_agreement=False)
        self._user_group(0)
        self.control.status.update(phase="train", generation=0, step=step)

    def mark(self, point: int) -> None:
        """The first step's forward starts (0), ends (1), its backward ends (2): what
        ``describe_measured`` tells the planner."""
        if not self.described and len(self._timing) == point:
            self._timing.append(time.perf_counter())

    def describe_measured(self, params: Callable[[], int], optimizer: Any) -> None:
        """The job, from the first step's marks, once they are all in (``params``: the
        model's parameter count, counted only then)."""
        if not self.described and len(self._timing) == 3 and self.rank == min(self.members):
            t = self._timing
            self.describe(t[1] - t[0], t[2] - t[1], params(), optimizer)

    def describe(self, forward_s: float, backward_s: float, params: int, optimizer: Any) -> None:
        """The job for the planner, from the first step's measured pass (the chief)."""
        if self.described or self.rank != min(self.members):
            return
        self.described = True
        description = JobDescription(
            model="DataParallel",
            layers=[
                LayerCost(
                    name="model",
                    num_params=params,
                    forward_s=forward_s,
                    backward_s=backward_s,
                    optimizer_s=0.0,
                    activation_bytes=0,
                    stash_bytes=0,
                )  # fmt: skip
            ],
            global_batch_size=self.sampler.global_batch_size,
            micro_batch_size=self.sampler.micro_batch_size,
            param_bytes=4,
            grad_bytes=4,
            optimizer_bytes=optimizer_bytes_per_param(optimizer),
            dp=len(self.members),
            pp=1,
            memory_limit_bytes=memory_per_worker(),
            link_bandwidth_bytes_per_s=1e9,
            link_latency_s=1e-4,
            checkpoint_interval_steps=1,
            host_cores=host_cores(self.device),
            shards=self.shards,
            shard_unit_params=self.unit_params,
        )
        self.control.put_signed(self.control.keys.job, description)

    def _enter(
        self,
        generation: int,
        members: list[int],
        layout: ShardLayout | None = None,
        *,
        build_agreement: bool = True,
    ) -> None:
        self.generation = generation
        self.control.status.update(phase="groups", generation=generation)
        if build_agreement and not self.control.agree(generation, "groups", len(members)).held:
            raise Aborted(f"generation {generation} aborted before its groups were built")
        # (the last generation's collectives were let go of when it was left: each
        # generation builds its own)
        layout = layout or ShardLayout(tuple(sorted(members)), self.shards)
        self.gen = self.control.generation(
            generation,
            members,
            self.collectives,
            layout.collectives(self.row_counts),
            transport=self.transport,
        )
        self.members = list(members)
        self.layout = layout

    # -- a step's collectives ----------------------------------------------------------------

    @property
    def holders(self) -> tuple[int, ...]:
        return tuple(self.members)

    def aborted(self) -> bool:
        return self.control.interrupts.aborted(self.generation)

    def allreduce(self, tensor: torch.Tensor, holders: tuple[int, ...] | None = None) -> Any:
        """Post a sum over ``holders`` (every member by default)."""
        assert self.gen is not None
        return self.gen.allreduce(holders or self.holders, tensor)

    def wait(self, work: Any, holders: tuple[int, ...] | None = None) -> None:
        assert self.gen is not None
        self.gen.wait(work, holders or self.holders)

    def group_collective(self, kind: str, output: torch.Tensor, tensor: torch.Tensor) -> None:
        """A sharded model's all-gather or reduce-scatter within this member's replica
        group (chameleon_runtime.sharding), waited for here."""
        gen = self.gen
        assert gen is not None
        group = self.layout.group_of(self.rank)
        if len(group) == 1:  # a group re-sharded down to one member: it holds everything
            output.view(-1).copy_(tensor.view(-1))
            return
        post = gen.allgather if kind == "allgather" else gen.reducescatter
        gen.wait(post(group, output, tensor), group)

    def progress(
        self,
        step: int,
        step_s: float,
        cpu_s: float,
        compute_cpu_s: float,
        busy_s: float = 0.0,
        micro_batches: int = 0,
    ) -> None:
        """A step committed: what the launcher's progress watch reads (its step timeout
        is a multiple of the slowest step seen), and what its model is fitted to: the
        step's CPU, the process's and its passes' (launcher/calibration.py: on a host
        whose cores the workers share, what a step costs the host); the wall time of its
        passes and their micro-batches (this worker's speed: chameleon_runtime.pace)."""
        self._progress += 1
        # (the first steps pay for start-up: as the Trainer, the slowest is of the rest)
        if self._progress > 2:
            self._slowest = max(self._slowest, step_s)
        self._pace.add(self.generation, step_s, cpu_s, compute_cpu_s, 0.0, busy_s, micro_batches)
        self.control.status.update(
            phase="train", generation=self.generation, step=step, progress=self._progress,
            step_s=step_s, slowest_step_s=self._slowest or step_s, cpu_s=cpu_s,
            compute_cpu_s=compute_cpu_s, busy_s=busy_s, micro_batches=micro_batches,
            **self._pace.means(),
        )  # fmt: skip

    # -- recovery ------------------------------------------------------------------------

    def recover(
        self,
        reason: str,
        *,
        step: int,
        pending: bool,
        export: Callable[[], tuple[dict, list[torch.Tensor]]],
        install: Callable[[dict, list[torch.Tensor]], None],
        held: bool = True,
        roll_now: Callable[[], None] | None = None,
    ) -> tuple[int, bool]:
        """Leave the generation, report, apply the next plan. Returns (the step to resume
        at, whether the pending step is to be applied: rolled forward)."""
        left = self.generation
        self._leave()

        def rolled_now() -> None:
            # The pending step is applied here now (before a re-shard's moves): a later
            # report must say so, or a plan made without the member that was ahead
            # would have it redone on weights that hold it already.
            nonlocal step, pending
            assert roll_now is not None
            roll_now()
            step, pending = step + 1, False

        while True:
            self.control.status.update(phase="ready", generation=left)
            try:
                self.control.tell_leader(
                    Ready(
                        rank=self.rank, pid=os.getpid(), after=left, applied=self.applied,
                        step=step if held else None, held=[0] if held else [],
                        reason=reason[:200], pending=pending,
                        committed=[0.0, 0.0, float(len(self.members))] if held else None,
                    )
                )  # fmt: skip
                message = self.control.next_plan(left)
            except Finished as done:
                if held and pending and step == done.step:
                    # The others applied the last step and left; this one posted its
                    # commit and did not see it end: its sums are complete, so it
                    # applies the step too and its loop ends as theirs did.
                    self.generation = left
                    return done.step + 1, True
                if held and self.joined and step == done.step + 1:
                    # A replacement whose loop went on past the job's last step, on a
                    # count of its own (an epoch loop resumed from its own, older
                    # snapshot; or one that started at 0): it was healed to the job's
                    # state and stepped with the others to the end, so its weights are
                    # the job's. It ends as a spare does, said, without the script's
                    # code after its loop (the others run theirs).
                    self._end(
                        f"rank {self.rank}'s loop went on after the job's last step "
                        f"({done.step}), on a count of its own (an older snapshot's, or "
                        "from 0); its weights are the job's"
                    )
                if held and step > done.step:
                    # The others left their loops after the job's last step; this one's
                    # loop went on: a member's count that is not the job's (a replacement
                    # ahead of the job's next step is not one trained in step with it).
                    # Said, not trained on alone.
                    raise RuntimeError(
                        f"chameleon: the other members ended training after step "
                        f"{done.step}, but rank {self.rank}'s loop went on to step {step}: "
                        "end the loop on optimizer.global_step (the job's count of "
                        "steps), not on a count of the script's own"
                    ) from None
                self._end()
            except STORE_LOST:
                if not self.control.reconnect():
                    raise
                continue
            try:
                return self._apply(
                    message, step, pending, export, install, rolled_now if roll_now else None
                )
            except (Aborted, CommError) as exc:
                self._leave()
                left, reason = message.generation, str(exc)
                if self.applied == message.generation:  # healed before the failure
                    held = True
            except STORE_LOST as exc:
                if not self.control.reconnect():
                    raise
                self._leave()
                left, reason = message.generation, f"the worker store moved ({exc})"[:200]

    def _apply(
        self,
        message: PlanMessage,
        step: int,
        pending: bool,
        export: Callable[[], tuple[dict, list[torch.Tensor]]],
        install: Callable[[dict, list[torch.Tensor]], None],
        roll_now: Callable[[], None] | None = None,
    ) -> tuple[int, bool]:
        plan = message.plan.to_plan()
        if self.reshaper is not None:
            self.reshaper.forget()  # (rows an aborted generation moved)
        members = sorted(set(plan.workers) | {t.src for t in message.transfers})
        if self.rank not in members:  # not used by this plan: wait for the next one
            self.generation = message.generation
            self.control.status.update(phase="spare", generation=message.generation)
            self._idle()
            raise Aborted("a spare waits for the next plan")
        rf = message.roll_forward
        roll = pending and rf is not None and rf.step == step
        sizes = tuple(len(g) for g in plan.replica_groups)
        target = ShardLayout(tuple(sorted(plan.workers)), self.shards, sizes)
        # (sources outside the plan send whole states: a model that is not sharded)
        self._enter(
            message.generation, members, target if members == list(target.members) else None
        )
        self.control.status.update(phase="migrate")
        t0 = time.perf_counter()
        received = None
        gen = self.gen
        assert gen is not None
        transfers = sorted(message.transfers, key=lambda t: t.round)
        if message.reshard_from and self.reshaper is not None:
            # Groups re-sharded: rows move among their holders, in the plan's rounds
            # (chameleon_runtime.reshard); the pending step first, on every member.
            if roll and roll_now is not None:
                roll_now()
            old = ShardLayout(
                tuple(w for g in message.reshard_from for w in g),
                self.shards,
                tuple(len(g) for g in message.reshard_from),
            )
            moves = [(t.src, t.dst) for t in transfers if t.dst in old.members]
            self.reshaper.move(
                old, target, self.rank, moves,
                lambda x, d: gen.send(x, d), lambda x, s: gen.recv(x, s), gen.flush_sends,
            )  # fmt: skip
            # (a member that held nothing, a replacement, is healed whole below)
            transfers = [t for t in transfers if t.dst not in old.members]
        for t in transfers:
            if t.src == self.rank:  # streamed in chunks (chameleon_runtime.heal)
                if roll:
                    # This member applies the step inside the script's optimizer.step(),
                    # before the script's code after it (a schedule's step) has run: what
                    # it would send is a step behind there. The launcher heals nothing
                    # whole in a plan that rolls a step forward (launcher/recovery.py,
                    # _plan); a plan that does would train the receiver on wrong state.
                    raise RuntimeError(
                        f"generation {message.generation} asks rank {self.rank} to heal "
                        f"rank {t.dst} while it rolls step {step} forward: refused"
                    )
                header, tensors = export()
                send_state(lambda x, d=t.dst: gen.send(x, d), gen.flush_sends, header, tensors)
            elif t.dst == self.rank:
                received = receive_state(lambda x, s=t.src: gen.recv(x, s))
        if not self.control.agree(message.generation, "migrated", len(members)).held:
            raise Aborted(f"generation {message.generation} aborted during its migration")
        # Applied (the launcher plans the next failure from this generation's layout): a
        # re-shard's moved rows are what this member holds now, set up in the model once
        # the groups are built (a failure before that keeps them for the next plan).
        self.applied = message.generation
        if self.reshaper is not None:
            self.reshaper.commit()
        self.members = sorted(plan.workers)
        self.layout = target
        self.sampler.members = list(self.members)
        self.sampler.sizes = sizes
        self.sampler.shares = uneven_shares(plan, self.shards)
        if self.rank in self.members:
            self._user_group(message.generation)
            if self.reshaper is not None:  # the mesh a sharded model shards on
                self.reshaper.regroup(target)
        else:  # a source that gave its state away: a spare from now on
            usergroup.remove()
        if received is not None:  # (after the groups: a sharded model shards on them)
            install(*received)
        self.control.status.update(phase="train", step=message.resume_step)
        self.control.tell_leader(
            Applied(
                rank=self.rank,
                generation=message.generation,
                migrate_s=time.perf_counter() - t0,
                collectives_built=["-".join(map(str, self.members))],
                sent_at=time.time(),
            )
        )
        return message.resume_step, roll

    def join(
        self,
        export: Callable[[], tuple[dict, list[torch.Tensor]]],
        install: Callable[[dict, list[torch.Tensor]], None],
    ) -> int:
        """A replacement: announce it, then wait as a spare until a plan takes it in
        (healing it) or training ends. Returns the step to resume at."""
        message = self.control.latest_plan()
        self.generation = message.generation
        # (what came before it listened: without it, a warm replacement up before the
        # next plan was out waited on the aborted generation to the end; seen in CI)
        self.control.catch_up(message.generation)
        self.control.status.update(phase="spare", generation=message.generation)
        self.control.tell_leader(
            Joined(rank=self.rank, count=int(self.joining or 1), generation=message.generation)
        )
        self._idle()  # (at once when the generation is aborted or training has ended)
        resume, _ = self.recover(
            "a replacement waits to be taken in",
            step=0, pending=False, export=export, install=install, held=False,
        )  # fmt: skip
        self.joined = True
        return resume

    def _idle(self) -> None:
        """A spare: until its generation is aborted (a plan is coming) or training ends."""
        event = threading.Event()
        with self.control.interrupts.watch(self.generation, event):
            event.wait()
        if self.control.interrupts.finished is not None:
            self._end()

    def _user_group(self, generation: int, workers: list[int] | None = None) -> None:
        """The script's default process group over this generation's workers
        (chameleon_runtime.usergroup)."""
        assert self.gen is not None
        usergroup.install(
            self.gen, self.gen.store, self.control.keys.groups(generation),
            workers if workers is not None else self.members, self.rank,
        )  # fmt: skip

    def _leave(self) -> None:
        usergroup.remove()
        if self.gen is not None:
            self.gen.abandon()
            self.gen = None
        while self.collectives:
            self.collectives.popitem()[1].let_go(self.transport, COLLECTIVE_RELEASE)

    def _end(self, why: str | None = None) -> NoReturn:
        """Training ended while this worker waited as a spare: it holds no trained state
        (never taken in, or left out by a plan and stale since), so the script's code
        after its loop (a final save, an evaluation) must not run here. Or ``why``: a
        replacement's loop went on past the job's end (its weights are the job's, and
        the others run that code). Said, then exit 0."""
        self.control.status.update(phase="done")
        self.close()
        said = why or f"rank {self.rank} waited as a spare when training ended"
        print(
            f"chameleon_runtime: {said}; it exits without running the script's code after its loop",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(0)  # the script's loop has no step left to run here

    def end_at_exit(self, step: Callable[[], int]) -> None:
        """When the interpreter exits: announce the end of training at ``step()`` (unless
        the script raised: an error is not the end of training, and the others must not
        exit 0 early), then close."""
        usergroup.ScriptErrors.watch()

        def at_exit() -> None:
            if not usergroup.ScriptErrors.raised:
                with contextlib.suppress(Exception):
                    self.finish(step())
            with contextlib.suppress(Exception):
                self.close()

        atexit.register(at_exit)

    def finish(self, step: int) -> None:
        """The last step is done: spares and those waiting for a plan end too."""
        self.control.status.update(phase="done", step=step)
        if self.rank == min(self.members):
            keys = self.control.keys
            self.control.put_signed(keys.finished, str(step - 1))
            self.control.end(self.generation, step - 1)
            for rank in range(self.world_size):
                if rank not in self.members:
                    self.control.push_signed(keys.mailbox(rank), Finish(step=step - 1))

    def close(self) -> None:
        self._leave()
        self.control.close_settled()
