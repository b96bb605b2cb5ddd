"""``Trainer``: the runtime's public face. The user gives layers, a loss, an optimizer and a
dataset; the runtime owns the step, and survives failures in place when started by
``chameleon run``.

Life of a worker:
1. read the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT) and join the
   control channel (``chameleon_runtime.control``), which starts its heartbeat and
   watcher threads (``chameleon_runtime.liveness``);
2. probe the model on the meta device (parameters, activation shapes), build only its own
   layers of generation 0 (pipelines of ``pipeline_stages`` consecutive ranks, layers split
   by parameter count), load the last checkpoint if there is one, measure its layers'
   costs and publish them for the planner;
3. run steps; every ``checkpoint_every`` steps, checkpoint;
4. on a failure (a broken transfer, or the launcher's abort), discard the step and carry
   out the launcher's next plan (``chameleon_runtime.membership``). If the plan never
   comes, the launcher is restarting the job from the checkpoint and will end this
   process.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from chameleon_runtime import checkpoint
from chameleon_runtime.comm import Aborted, CommError, settle
from chameleon_runtime.control import STORE_LOST, Control
from chameleon_runtime.data import Batches
from chameleon_runtime.device import bind, resolve_device
from chameleon_runtime.layercost import measure, probe
from chameleon_runtime.membership import Membership
from chameleon_runtime.memory import Meter
from chameleon_runtime.pace import Pace
from chameleon_runtime.profile import describe_job, profile_job
from chameleon_runtime.protocol.messages import Finish, checkpoint_name
from chameleon_runtime.protocol.seal import TOKEN_ENV
from chameleon_runtime.protocol.wire import JobDescription, PlanMessage
from chameleon_runtime.scaler import INIT_SCALE
from chameleon_runtime.shard import PRECISIONS, LayerFactory, OptimizerFactory, Shard
from chameleon_runtime.step import CommitUnknown, run_step
from chameleon_runtime.transport import transport_for
from planner.job.costtable import LayerCost
from planner.plans.partition import balanced_split
from planner.plans.plan import Plan, pipelines_plan, split_evenly
from planner.plans.program import Allreduce, reads_global_norm

AUTO = "auto"  # Trainer(pipeline_stages=AUTO): the planner picks the launch layout
# A layout planned by the chief alone (no launcher: a plain script, torchrun) is scored
# with the restart cost the launcher's planner assumes before it has measured a start-up
# (launcher.calibration.DEFAULT_RESTART_S) and the planner's prior for D.
LAUNCH_RESTART_S = 10.0


@dataclass(frozen=True)
class StepInfo:
    step: int
    loss: float
    seconds: float
    generation: int
    rank: int
    is_chief: bool  # the lowest-ranked worker of the current plan: log from here
    sent_bytes: int = 0  # what this worker sent in the step (messages, its all-reduce share)


@dataclass(frozen=True)
class FitResult:
    steps: int
    generation: int
    losses: dict[int, float]  # step -> loss, for the steps this process ran
    recoveries: int
    # Stopped for a preemption notice (chameleon run --signals-to-handle): a checkpoint
    # of ``steps`` is saved when the Trainer has a checkpoint_dir; leave, to be requeued.
    preempted: bool = False


class Trainer:
    """Pipeline x data parallel training that survives failures in place.

    Args:
        layers: a function building layer i (called under a per-layer seed, so every
            holder gets the same initial weights), or a list of modules.
        num_layers: how many layers (needed with a function).
        loss_fn: loss(output of the last layer, targets) -> scalar mean over the micro-batch.
        optimizer: builds an optimizer for one layer's parameters (element-wise
            optimizers only: SGD, Adam, AdamW...).
        dataset: indexable by global sample index, returning (input, target) tensors.
        global_batch_size, micro_batch_size: samples per step and per micro-batch.
        pipeline_stages: stages per pipeline at the start (WORLD_SIZE must be a multiple),
            or "auto": the planner picks the starting layout as it picks one after a
            failure (under ``chameleon run`` the leader, from the layers' measured costs
            and the run's ``--config``; otherwise the chief, from the measured costs), and
            may leave workers out as spares when fewer run faster.
        lr_schedule: step -> learning rate, applied to every layer's optimizer.
        checkpoint_dir, checkpoint_every: atomic checkpoints every N steps (0: never).
        device: "cpu", "cuda", "npu" or "auto" (chameleon_runtime.device: a worker uses its
            LOCAL_RANK's accelerator; one that cannot be had is a DeviceError naming what is
            missing; auto: a visible GPU, else an NPU, else the CPU).
        transport: "gloo" (accelerator tensors staged through pinned host memory, so
            several ranks may share one GPU) or "native" (NCCL on cuda, HCCL on npu):
            chameleon_runtime.transport.
        precision: "fp32", "bf16" or "fp16": the half types compute under autocast and
            round every layer's output to the half type, with fp32 weights, gradients and
            optimizer state; fp16 adds dynamic loss scaling (chameleon_runtime.scaler: a
            step whose gradients overflow anywhere is skipped by every worker).
        init_loss_scale: fp16's first loss scale (torch.amp.GradScaler's default).
        max_grad_norm: clip the gradients to this global norm across every stage and
            replica, as torch.nn.utils.clip_grad_norm_ over the whole model (None: no
            clipping).
        exact: sum every gradient in float64 and exchange the sums between holders, so
            that any layout, and so any recovery, trains the same bits (8 bytes a
            parameter more, and the exchange's traffic). The default trains as DDP does:
            each bucket all-reduced in the gradients' dtype while the backward runs, and a
            run with failures ends within float tolerance of one without.
    """

    def __init__(
        self,
        *,
        layers: LayerFactory | Sequence[nn.Module],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        optimizer: OptimizerFactory,
        dataset: Any,
        global_batch_size: int,
        micro_batch_size: int,
        num_layers: int | None = None,
        pipeline_stages: int | Literal["auto"] = 1,
        seed: int = 0,
        lr_schedule: Callable[[int], float] | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int = 0,
        device: str = "cpu",
        transport: str = "gloo",
        max_grad_norm: float | None = None,
        precision: str = "fp32",
        init_loss_scale: float = INIT_SCALE,
        exact: bool = False,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(
                f"precision {precision!r} is not supported: use {', '.join(PRECISIONS)}"
            )
        if not (init_loss_scale > 0 and math.log2(init_loss_scale).is_integer()):
            raise ValueError(f"init_loss_scale must be a power of two, not {init_loss_scale}")
        # Before anything is built: a device that cannot be had is one line (DeviceError).
        device = resolve_device(device, int(os.environ.get("LOCAL_RANK", "0")))
        self.transport = transport_for(device, transport)
        bind(device)
        if pipeline_stages != AUTO and not (
            isinstance(pipeline_stages, int) and pipeline_stages >= 1
        ):
            raise ValueError(
                f'pipeline_stages must be a positive number or "auto", not {pipeline_stages!r}'
            )
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, not {max_grad_norm}")
        if callable(layers) and not isinstance(layers, nn.Module):
            if num_layers is None:
                raise ValueError("num_layers is needed when layers is a function")
            self.factory: LayerFactory = layers  # type: ignore[assignment]
            self.num_layers = num_layers
        else:
            modules = list(layers)  # type: ignore[arg-type]
            self.factory = lambda i: modules[i]
            self.num_layers = len(modules)
        self.loss_fn = loss_fn
        self.batches = Batches(
            dataset, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size
        )
        self.pipeline_stages = pipeline_stages
        self.seed = seed
        self.lr_schedule = lr_schedule
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.checkpoint_every = checkpoint_every
        self.device = device
        self.max_grad_norm = max_grad_norm
        self.precision = precision
        self.global_norm = reads_global_norm(max_grad_norm, precision)
        self.exact = exact
        self.allreduce: Allreduce = "exchange" if exact else "ring"
        self.losses: dict[int, float] = {}  # step -> loss, for the steps this process ran
        self._checkpoint_keys: list[str] = []  # a ring's last checkpoint agreement
        self.shard = Shard(
            self.factory, optimizer, seed=seed, device=device, precision=precision,
            init_loss_scale=init_loss_scale,
        )  # fmt: skip
        self.meter = Meter(self.shard)
        # Where this worker is in the job (generation, plan, step...): built once the
        # worker knows its rank and its layers' sizes (_setup).
        self.member: Membership | None = None

    # -- setup -------------------------------------------------------------------------

    def _connect(self) -> None:
        env = os.environ
        self.rank = int(env.get("RANK", "0"))
        self.world_size = int(env.get("WORLD_SIZE", "1"))
        if "MASTER_ADDR" not in env:  # run as a plain script: host a store of our own
            from torch.distributed import TCPStore

            self._own_store = TCPStore(
                "127.0.0.1",
                0,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=60),
            )
            addr, port = "127.0.0.1", self._own_store.port
        else:
            addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.control = Control(addr, port, self.rank, attempt=attempt)
        self.control.register(self.device)

    def membership(self) -> Membership:
        """This worker's place in the job, from generation 0 (after ``_connect`` and the
        probe: it needs the rank and the layers' sizes)."""
        return Membership(
            rank=self.rank, control=self.control, shard=self.shard, meter=self.meter,
            transport=self.transport, layer_params=self.layer_params, allreduce=self.allreduce,
            global_norm=self.global_norm, max_grad_norm=self.max_grad_norm,
            lr_schedule=self.lr_schedule, losses=self.losses,
        )  # fmt: skip

    def initial_plan(self) -> Plan:
        """Generation 0 as given: pipelines of ``pipeline_stages`` consecutive ranks, layers
        split by parameter count, micro-batches split evenly. Every worker computes the
        same one. (``"auto"``: the planner's launch layout is not known here; this is then
        the data-parallel layout, which ``chameleon profile`` times, holding every layer
        on every worker as it does anyway.)"""
        pp = 1 if self.pipeline_stages == AUTO else int(self.pipeline_stages)
        if self.world_size % pp:
            raise ValueError(
                f"WORLD_SIZE {self.world_size} is not a multiple of pipeline_stages {pp}"
            )
        dp = self.world_size // pp
        bounds = balanced_split([max(1, n) for n in self.layer_params], pp)
        return pipelines_plan(
            num_layers=self.num_layers,
            num_micro_batches=self.batches.num_micro_batches,
            pipelines=[list(range(d * pp, (d + 1) * pp)) for d in range(dp)],
            boundaries=[bounds] * dp,
            micro_batch_counts=split_evenly(self.batches.num_micro_batches, [1.0] * dp),
        )

    def _setup(self) -> None:
        self._connect()
        sample = self.batches.inputs(0, 0)
        self.layer_params, self.activation_shapes, self.layer_names = probe(
            self.factory, self.num_layers, sample, seed=self.seed,
            wire_dtype=self.shard.wire_dtype, device=self.device,
        )  # fmt: skip
        member = self.member = self.membership()
        joining = os.environ.get("CHAMELEON_JOIN")
        if joining:
            member.join(int(joining))
            return
        last = checkpoint.latest(self.checkpoint_dir) if self.checkpoint_dir else None
        resume = last + 1 if last is not None else 0
        if self.pipeline_stages == AUTO:
            plan = self._launch_plan(resume)
        else:
            plan = self.initial_plan()
            stage = plan.stage_of[self.rank]
            self.shard.ensure(stage.first_layer, stage.end_layer)
            if self.rank == min(plan.workers):
                self._publish_plan(plan, resume)
            self._publish_costs(plan, stage.first_layer, stage.end_layer)
        stage = plan.stage_of.get(self.rank)
        if stage is not None:
            self.shard.keep_only(stage.first_layer, stage.end_layer)
            self.shard.ensure(stage.first_layer, stage.end_layer)
        else:  # a spare from the start: the planner left it out
            self.shard.keep_only(0, 0)
        if last is not None and self.shard.held():
            checkpoint.load_layers(self.checkpoint_dir, last, self.shard, self.shard.held())
        member.launch(plan, resume)

    def _publish_plan(self, plan: Plan, resume: int, policy: str = "initial") -> None:
        keys = self.control.keys
        message = PlanMessage.build(generation=0, policy=policy, resume_step=resume, plan=plan)
        self.control.put_signed(keys.plan(0), message)
        self.control.put_signed(keys.latest, "0")

    def _launch_plan(self, resume: int) -> Plan:
        """``pipeline_stages="auto"``: the planner picks generation 0. Every worker builds
        and measures its share of the layers split over as many workers as there are
        layers (each layer measured once, no worker holding more than its share), the
        chief describes the job, and the leader plans from that description
        (launcher/coordinator.py). Without a leader (a plain script, torchrun) the chief
        plans it itself from the same description (the analytic model, one node of
        LOCAL_WORLD_SIZE workers per node)."""
        pieces = min(self.world_size, self.num_layers)
        bounds = balanced_split([max(1, n) for n in self.layer_params], pieces)
        first, end = (bounds[self.rank], bounds[self.rank + 1]) if self.rank < pieces else (0, 0)
        self.shard.ensure(first, end)
        description = self._publish_costs(None, first, end, resume=resume)
        if description is not None and TOKEN_ENV not in os.environ:
            self._publish_plan(self._plan_alone(description), resume, policy="launch")
        with self.control.status.waiting("plan"):
            return self.control.latest_plan().plan.to_plan()

    def _plan_alone(self, description: JobDescription) -> Plan:
        from planner.choice.selection import Outlook, launch_choice
        from planner.job.failures import DEFAULT_DEVICE_MTBF_H, FailureRate

        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size)) or self.world_size
        job = description.to_job(
            num_nodes=max(1, self.world_size // per_node), workers_per_node=per_node,
            mtbf_s=None, step_s=1.0, restart_s=LAUNCH_RESTART_S,
        )  # fmt: skip
        mtbf = FailureRate(DEFAULT_DEVICE_MTBF_H * 3600).mtbf(self.world_size).seconds
        choice = launch_choice(job, list(range(self.world_size)), Outlook(mtbf))
        if choice is None:
            raise ValueError(
                f"no layout of the model's {self.num_layers} layers fits {self.world_size} "
                f"workers of {description.memory_limit_bytes / 2**30:.1f} GiB"
            )
        return choice.plan

    def _publish_costs(
        self, plan: Plan | None, first: int, end: int, *, resume: int = 0
    ) -> JobDescription | None:
        """Measure layers [first, end) and publish their costs; the chief (the lowest worker
        of ``plan``; rank 0 when ``plan`` is None: no layout launched yet, "auto") gathers
        every layer's and publishes the job's description, which it returns (the others:
        None)."""
        keys = self.control.keys
        if first < end:
            shape, dtype = self.activation_shapes[first - 1] if first > 0 else (None, None)
            if first == 0:
                x = self.batches.inputs(0, 0).to(self.device)
            elif dtype.is_floating_point:
                x = torch.randn(*shape, dtype=dtype, device=self.device)
            else:
                x = torch.zeros(*shape, dtype=dtype, device=self.device)
            for cost in measure(self.shard, list(range(first, end)), x, self.layer_names):
                index = int(cost.name.rsplit(".", 1)[1])
                self.control.put(keys.layer(index), cost)
        if self.rank != (min(plan.workers) if plan is not None else 0):
            return None
        costs = [
            LayerCost.model_validate_json(self.control.wait(keys.layer(i)))
            for i in range(self.num_layers)
        ]
        description = describe_job(self, plan, costs, resume_step=resume)
        self.control.put_signed(keys.job, description)
        return description

    # -- the loop ----------------------------------------------------------------------

    def fit(self, steps: int, *, on_step: Callable[[StepInfo], None] | None = None) -> FitResult:
        """Train until ``steps`` steps are done (counting from step 0, resuming from a
        checkpoint if there is one); call ``on_step`` after each. Under ``chameleon
        profile`` (CHAMELEON_PROFILE set) measure instead, write the cost table, return."""
        if os.environ.get("CHAMELEON_PROFILE"):
            self._connect()
            try:
                profile_job(self, Path(os.environ["CHAMELEON_PROFILE"]))
            finally:
                settle(timeout_s=5.0)  # its group is released before the interpreter ends
                self.control.close()
            return FitResult(steps=0, generation=0, losses={}, recoveries=0)
        self._setup()
        m = self.member
        assert m is not None
        losses = self.losses
        status = self.control.status
        progress, slowest = 0, 0.0
        cpu_mark = time.process_time()
        pace = Pace()
        forget: list[str] = []  # the previous step's keys, for its commit's last arrival
        while m.step < steps:
            if m.stopping:  # a preemption notice: every member resumed at this step
                self._save_for_preemption()
                break
            if m.part is None:  # a spare: not in this plan
                m.idle(steps)
                forget = []
                continue
            self.control.step_failpoint(m.step)
            if self.control.interrupts.aborted(m.generation):
                # Heard between steps: a worker with no peer to wait on (alone in its
                # generation) hears an abort nowhere else, and would train on to the end
                # while the launcher waited for it to recover (a replacement's rejoin).
                m.recover(f"generation {m.generation} aborted")
                forget = []
                continue
            lr = self.lr_schedule(m.step) if self.lr_schedule else None
            try:
                result = run_step(
                    step=m.step, part=m.part, shard=self.shard, gen=m.gen,
                    control=self.control, batches=self.batches, loss_fn=self.loss_fn,
                    activation_shapes=self.activation_shapes, meter=self.meter, lr=lr,
                    forget=forget, max_grad_norm=self.max_grad_norm, reducer=m.ring_reducer(),
                )  # fmt: skip
            except (Aborted, CommError) as exc:
                # A ring's commit whose outcome this worker did not learn: it keeps the
                # step's gradients for the next plan to settle (chameleon_runtime.step).
                m.recover(str(exc), pending=exc.step if isinstance(exc, CommitUnknown) else None)
                forget = []
                continue
            except STORE_LOST as exc:  # the leader's node is lost: its store went with it
                if not self.control.reconnect():
                    raise
                m.recover(f"the worker store moved ({str(exc).splitlines()[0][:80]})")
                forget = []
                continue
            done = m.step
            losses[done] = result.loss
            m.committed = result.committed
            m.step += 1
            progress += 1
            slowest = max(slowest, result.seconds)
            # CPU time of the whole process (every thread) since the last step: on a host
            # whose cores the workers share, this is what each step costs the host.
            cpu_now = time.process_time()
            cpu_s, cpu_mark = cpu_now - cpu_mark, cpu_now
            pace.add(
                m.generation, result.seconds, cpu_s, result.compute_cpu_s, result.pass_cpu_s,
                result.busy_s, result.micro_batches,
            )  # fmt: skip
            status.update(
                phase="train", generation=m.generation, step=m.step, progress=progress,
                step_s=result.seconds, slowest_step_s=slowest, cpu_s=cpu_s,
                compute_cpu_s=result.compute_cpu_s, pass_cpu_s=result.pass_cpu_s,
                busy_s=result.busy_s, micro_batches=result.micro_batches,
                peak_bytes=self.meter.peak_bytes,
                **pace.means(),
            )  # fmt: skip
            checkpointed = self._checkpoint_if_due(done)
            forget = self.control.keys.step_keys(
                m.generation, done, m.part.last_stage_workers(), checkpointed=checkpointed,
                norm_owners=m.part.norm_owners(), commit=self.allreduce == "exchange",
            )  # fmt: skip
            if on_step is not None:
                chief = self.rank == min(m.plan.workers)
                on_step(
                    StepInfo(
                        done,
                        result.loss,
                        result.seconds,
                        m.generation,
                        self.rank,
                        chief,
                        result.sent_bytes,
                    )  # fmt: skip
                )
        self._finish(steps)
        return FitResult(
            steps=m.step,
            generation=m.generation,
            losses=losses,
            recoveries=m.recoveries,
            preempted=m.stopping,
        )

    def _finish(self, steps: int) -> None:
        m = self.member
        assert m is not None
        status = self.control.status
        status.update(phase="done", step=m.step)
        if m.part is not None and self.rank == min(m.plan.workers):
            # Spares (and replacements yet to come) wait for a plan: tell them it is over.
            keys = self.control.keys
            self.control.put_signed(keys.finished, str(m.step - 1))
            self.control.end(m.generation, m.step - 1)
            members = set(m.plan.workers)
            for rank in range(self.world_size):
                if rank not in members:
                    self.control.push_signed(keys.mailbox(rank), Finish(step=m.step - 1))
        m.leave()
        m.keep(None)
        m.let_go_of_collectives()
        self.control.close_settled()

    @property
    def loss_scale(self) -> float | None:
        """fp16's current loss scale (None at other precisions)."""
        return self.shard.scaler.scale if self.shard.scaler is not None else None

    def checksums(self) -> dict[int, float]:
        """A fingerprint of each layer this worker holds (to compare holders and runs)."""
        return {i: self.shard.checksum(i) for i in self.shard.held()}

    def _save_for_preemption(self) -> None:
        """The members' checkpoint of the steps done, before they leave; without a
        checkpoint_dir there is nowhere to save (said once, by the chief)."""
        m = self.member
        assert m is not None
        if m.part is None or m.step == 0:
            return
        if self.checkpoint_dir is None:
            if self.rank == min(m.plan.workers):
                print(
                    f"[rank {self.rank}] chameleon: stopped for a preemption notice at step "
                    f"{m.step}; nothing saved (the Trainer has no checkpoint_dir)",
                    file=sys.stderr,
                    flush=True,
                )
            return
        self._checkpoint(m.step - 1)

    def _checkpoint_if_due(self, step: int) -> bool:
        """Every ``checkpoint_every`` steps (``_checkpoint``)."""
        m = self.member
        assert m is not None
        if not (
            self.checkpoint_dir and self.checkpoint_every and m.step % self.checkpoint_every == 0
        ):
            return False
        return self._checkpoint(step)

    def _checkpoint(self, step: int) -> bool:
        """Each layer by its first holder; ``latest`` moves once all are written (an
        all-or-none agreement). A failure in between leaves the previous checkpoint."""
        m = self.member
        assert m is not None and m.part is not None and self.checkpoint_dir is not None
        status = self.control.status
        status.update(phase="checkpoint")
        with status.waiting("checkpoint"):
            checkpoint.save_layers(self.checkpoint_dir, step, self.shard, m.part.owned_layers())
        name = checkpoint_name(step)
        agreed = self.control.agree(m.generation, name, len(m.part.members))
        if agreed.held and self.rank == min(m.plan.workers):
            checkpoint.publish(self.checkpoint_dir, step, self.num_layers)
        if self.allreduce == "ring":
            # No store commit to forget them at (an exchange's does): the last to reach a
            # checkpoint forgets the one before, which every member is past.
            if agreed.last and self._checkpoint_keys:
                self.control.forget(self._checkpoint_keys)
            keys = self.control.keys
            self._checkpoint_keys = [
                keys.agreement(m.generation, name),
                keys.agreement_done(m.generation, name),
            ]
        status.update(phase="train")
        return self.allreduce == "exchange"  # whose step keys forget it
