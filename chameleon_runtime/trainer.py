"""``Trainer``: the runtime's public face. The user gives layers, a loss, an optimizer and a
dataset; the runtime owns the step, and survives failures in place when started by
``chameleon run``.

Life of a worker:
1. read the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT) and join the
   control channel (``chameleon_runtime.control``);
2. probe the model on the meta device (parameters, activation shapes), build only its own
   layers of generation 0 (pipelines of ``pipeline_stages`` consecutive ranks, layers split
   by parameter count), load the last checkpoint if there is one, measure its layers'
   costs and publish them for the planner;
3. run steps; after each, heartbeat; every ``checkpoint_every`` steps, checkpoint;
4. on a failure (a broken transfer, or the launcher's abort), discard the step, report
   ready with the step it is at, wait for the launcher's next plan, migrate weights as
   told, free what it no longer needs once every transfer is confirmed, and go on from
   the step the plan names. If the plan never comes, the launcher is restarting the job
   from the checkpoint and will end this process.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from chameleon_runtime import checkpoint
from chameleon_runtime.comm import Aborted, CommError, Generation, stuck_waits
from chameleon_runtime.control import Control
from chameleon_runtime.data import Batches
from chameleon_runtime.pace import Pace
from chameleon_runtime.profile import link_cost, measure, probe
from chameleon_runtime.shard import LayerFactory, OptimizerFactory, Shard
from chameleon_runtime.step import MyPart, run_step
from planner.partition import balanced_split
from planner.plan import Plan, pipelines_plan, split_evenly
from planner.wire import JobDescription, LayerCostWire, PlanMessage

HEARTBEAT_WHILE_WAITING_S = 1.0


@dataclass(frozen=True)
class StepInfo:
    step: int
    loss: float
    seconds: float
    generation: int
    rank: int
    is_chief: bool  # the lowest-ranked worker of the current plan: log from here


@dataclass(frozen=True)
class FitResult:
    steps: int
    generation: int
    losses: dict[int, float]  # step -> loss, for the steps this process ran
    recoveries: int


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
        pipeline_stages: stages per pipeline at the start (WORLD_SIZE must be a multiple).
        lr_schedule: step -> learning rate, applied to every layer's optimizer.
        checkpoint_dir, checkpoint_every: atomic checkpoints every N steps (0: never).
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
        pipeline_stages: int = 1,
        seed: int = 0,
        lr_schedule: Callable[[int], float] | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int = 0,
        device: str = "cpu",
    ) -> None:
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
        self.shard = Shard(self.factory, optimizer, seed=seed, device=device)
        self.generation = 0
        self.recoveries = 0
        self.gen: Generation | None = None
        self.part: MyPart | None = None

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
        self.control.register({"pid": os.getpid(), "device": self.device})

    def initial_plan(self) -> Plan:
        """Generation 0: pipelines of ``pipeline_stages`` consecutive ranks, layers split by
        parameter count, micro-batches split evenly. Every worker computes the same one."""
        pp = self.pipeline_stages
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
            self.factory, self.num_layers, sample, seed=self.seed
        )
        joining = os.environ.get("CHAMELEON_JOIN")
        if joining:
            self._join(int(joining))
            return
        self.plan = self.initial_plan()
        stage = self.plan.stage_of[self.rank]
        self.shard.ensure(stage.first_layer, stage.end_layer)
        self.step = 0
        if self.checkpoint_dir is not None:
            last = checkpoint.latest(self.checkpoint_dir)
            if last is not None:
                checkpoint.load_layers(self.checkpoint_dir, last, self.shard, self.shard.held())
                self.step = last + 1
        if self.rank == min(self.plan.workers):
            self.control.put(
                "plan/0",
                PlanMessage.build(
                    generation=0, policy="initial", resume_step=self.step, plan=self.plan
                ).model_dump(),
            )
            self.control.put("gen", 0)
        self._publish_costs(stage.first_layer, stage.end_layer)
        self._start_generation(0, self.plan, members=self.plan.workers)

    def _join(self, count: int) -> None:
        """A replacement started by the launcher while the job trains (launcher/rejoin.py):
        take the current generation as a spare, holding nothing, and announce it. The
        launcher decides whether to re-partition with us; until then we idle."""
        self.control.forget(f"exit/{self.rank}")  # a request to our predecessor, not to us
        while (latest := self.control.get("gen")) is None or (
            message := self.control.get(f"plan/{latest}")
        ) is None:
            time.sleep(0.05)
        plan = PlanMessage.model_validate(message)
        self.generation, self.plan, self.part = latest, plan.plan.to_plan(), None
        self.step = plan.resume_step  # stale until a plan takes us in
        self.control.watch(latest)
        self.control.heartbeat(
            step=self.step - 1, generation=self.generation, step_s=None, state="spare"
        )
        self.control.put(f"join/{self.rank}", {"count": count, "generation": latest})

    def _publish_costs(self, first: int, end: int) -> None:
        x = (
            self.batches.inputs(0, 0)
            if first == 0
            else torch.randn(*self.activation_shapes[first - 1][0])
        )
        if first > 0 and not self.activation_shapes[first - 1][1].is_floating_point:
            x = torch.zeros(
                *self.activation_shapes[first - 1][0], dtype=self.activation_shapes[first - 1][1]
            )
        for cost in measure(self.shard, list(range(first, end)), x, self.layer_names):
            index = int(cost.name.rsplit(".", 1)[1])
            self.control.put(f"layer/{index}", cost.model_dump())
        if self.rank != min(self.plan.workers):
            return
        costs = []
        for i in range(self.num_layers):
            while (c := self.control.get(f"layer/{i}")) is None:
                time.sleep(0.01)
            costs.append(c)
        dp = len(self.plan.pipelines)
        description = JobDescription(
            model=type(self).__name__,
            layers=costs,
            global_batch_size=self.batches.global_batch_size,
            micro_batch_size=self.batches.micro_batch_size,
            param_bytes=4,
            grad_bytes=4,
            optimizer_bytes=_optimizer_bytes_per_param(self.shard),
            dp=dp,
            pp=self.pipeline_stages,
            memory_limit_bytes=_memory_per_worker(),
            link_bandwidth_bytes_per_s=1e9,
            link_latency_s=1e-4,
            checkpoint_interval_steps=max(1, self.checkpoint_every),
            host_cores=len(os.sched_getaffinity(0)) if self.device == "cpu" else 0,
        )
        self.control.put("job", description.model_dump())

    def _start_generation(self, generation: int, plan: Plan, *, members: Sequence[int]) -> None:
        self.generation = generation
        self.plan = plan
        self.control.watch(generation)
        self.part = (
            MyPart.of(plan, self.rank, self.layer_params) if self.rank in plan.stage_of else None
        )
        self.gen = Generation(
            store=self.control.store,
            generation=generation,
            members=sorted(members),
            workers=plan.workers,
            me=self.rank,
            buckets=[b.holders for b in (self.part.all_buckets if self.part else ())],
            abort=self.control.abort,
            key_prefix=self.control.prefix,
            device=self.device,
        )

    # -- the loop ----------------------------------------------------------------------

    def fit(self, steps: int, *, on_step: Callable[[StepInfo], None] | None = None) -> FitResult:
        """Train until ``steps`` steps are done (counting from step 0, resuming from a
        checkpoint if there is one); call ``on_step`` after each. Under ``chameleon
        profile`` (CHAMELEON_PROFILE set) measure instead, write the cost table, return."""
        if os.environ.get("CHAMELEON_PROFILE"):
            self.profile(Path(os.environ["CHAMELEON_PROFILE"]))
            return FitResult(steps=0, generation=0, losses={}, recoveries=0)
        self._setup()
        losses: dict[int, float] = {}
        step_s: float | None = None
        cpu_mark = time.process_time()
        pace = Pace()
        while self.step < steps:
            try:
                self._honour_exit_request()
                if self.part is None:  # a spare: not in this plan
                    self._idle()
                    continue
                lr = self.lr_schedule(self.step) if self.lr_schedule else None
                result = run_step(
                    step=self.step,
                    part=self.part,
                    shard=self.shard,
                    gen=self.gen,
                    control=self.control,
                    batches=self.batches,
                    loss_fn=self.loss_fn,
                    activation_shapes=self.activation_shapes,
                    lr=lr,
                )
            except (Aborted, CommError) as exc:
                self._recover(str(exc))
                continue
            step_s = result.seconds
            done = self.step
            losses[done] = result.loss
            self.step += 1
            # CPU time of the whole process (every thread) since the last step: on a host
            # whose cores the workers share, this is what each step costs the host.
            cpu_now = time.process_time()
            cpu_s, cpu_mark = cpu_now - cpu_mark, cpu_now
            pace.add(self.generation, step_s, cpu_s, result.compute_cpu_s)
            self.control.heartbeat(
                step=done,
                generation=self.generation,
                step_s=step_s,
                cpu_s=cpu_s,
                compute_cpu_s=result.compute_cpu_s,
                means=pace.means(),
            )
            if (
                self.checkpoint_dir is not None
                and self.checkpoint_every
                and self.step % self.checkpoint_every == 0
            ):
                self._checkpoint(done)
            if on_step is not None:
                on_step(
                    StepInfo(
                        done,
                        result.loss,
                        result.seconds,
                        self.generation,
                        self.rank,
                        self.rank == min(self.plan.workers),
                    )
                )
        self.control.heartbeat(
            step=self.step - 1, generation=self.generation, step_s=step_s, state="done"
        )
        self.control.close()
        # Peers finish at slightly different times; a group destroyed while a peer's end of
        # it is gone can abort the process at exit. Release it like an abandoned one.
        if self.gen is not None:
            self.gen.abandon()
        stuck = stuck_waits()
        if stuck:
            print(
                f"chameleon_runtime: rank {self.rank} ends with blocked waits: {stuck}",
                file=sys.stderr,
                flush=True,
            )
        return FitResult(
            steps=self.step, generation=self.generation, losses=losses, recoveries=self.recoveries
        )

    def profile(self, out: Path) -> None:
        """Measure every layer on every worker at once (contention included), links and
        the store; rank 0 writes the per-layer medians as a cost table (atomically)."""
        self._connect()
        try:
            self._profile(out)
        finally:
            self.control.close()

    def _profile(self, out: Path) -> None:
        from planner.costtable import CostTable, LayerCost, LinkCost

        sample = self.batches.inputs(0, 0)
        self.layer_params, self.activation_shapes, self.layer_names = probe(
            self.factory, self.num_layers, sample, seed=self.seed
        )
        self.shard.ensure(0, self.num_layers)
        for cost in measure(
            self.shard, list(range(self.num_layers)), sample, self.layer_names, reps=5
        ):
            self.control.put(f"profile/{self.rank}/{cost.name}", cost.model_dump())
        members = list(range(self.world_size))
        t0 = time.perf_counter()
        gen = Generation(
            store=self.control.store, generation=0, members=members, workers=members, me=self.rank,
            buckets=[], abort=self.control.abort, key_prefix=self.control.prefix + "profile/", device=self.device,
        )  # fmt: skip
        pg_init_s = time.perf_counter() - t0
        link = None
        if self.world_size >= 2 and self.rank in (0, 1):
            link = link_cost(gen, self.rank, 1 - self.rank)
        t0 = time.perf_counter()
        for _ in range(100):
            self.control.add("profile/ping", 0)
        store_rt = (time.perf_counter() - t0) / 100
        self.control.barrier("profile/done", self.world_size, generation=0)
        gen.abandon()
        if self.rank != 0:
            return
        layers = []
        for i, name in enumerate(self.layer_names):
            key = f"{name}.{i}"
            samples = [
                LayerCostWire.model_validate(self.control.get(f"profile/{r}/{key}"))
                for r in members
            ]
            layers.append(
                LayerCost(
                    name=key,
                    num_params=samples[0].num_params,
                    forward_s=statistics.median(s.forward_s for s in samples),
                    backward_s=statistics.median(s.backward_s for s in samples),
                    optimizer_s=statistics.median(s.optimizer_s for s in samples),
                    activation_bytes=samples[0].activation_bytes,
                    stash_bytes=samples[0].stash_bytes,
                )
            )
        table = CostTable(
            device=self.device,
            micro_batch_size=self.batches.micro_batch_size,
            concurrent_workers=self.world_size,
            layers=layers,
            intra_node=LinkCost(bandwidth_gb_per_s=link[1] / 1e9, latency_us=link[0] * 1e6)
            if link
            else None,
            store_round_trip_s=store_rt,
            pg_init_base_s=pg_init_s,
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(table.model_dump_json(indent=2))
        os.replace(tmp, out)

    def checksums(self) -> dict[int, float]:
        """A fingerprint of each layer this worker holds (to compare holders and runs)."""
        return {i: self.shard.checksum(i) for i in self.shard.held()}

    def _checkpoint(self, step: int) -> None:
        """Each layer by its first holder; ``latest`` moves once all are written. A failure
        in between leaves the previous checkpoint in place."""
        assert self.checkpoint_dir is not None
        mine = [i for i in self.shard.held() if min(self.plan.holders(i)) == self.rank]
        checkpoint.save_layers(self.checkpoint_dir, step, self.shard, mine)
        try:
            self.control.barrier(
                f"ckpt/{self.generation}/{step}", len(self.plan.workers), generation=self.generation
            )
        except Aborted:
            return
        if self.rank == min(self.plan.workers):
            checkpoint.publish(self.checkpoint_dir, step, self.num_layers)

    def _honour_exit_request(self) -> None:
        code = self.control.exit_requested()
        if code is not None:
            os._exit(int(code))

    def _idle(self) -> None:
        """A survivor the plan does not use: keep heartbeating until a plan needs it or
        the job ends (the others' progress is in their heartbeats)."""
        self.control.heartbeat(
            step=self.step - 1, generation=self.generation, step_s=None, state="spare"
        )
        latest = self.control.get("gen")
        if self.control.abort.is_set() or (latest is not None and latest > self.generation):
            # A recovery (or a rejoin) is being planned: a spare must report ready too.
            self._recover("a new plan")
            return
        beats = [self.control.get(f"hb/{w}") for w in self.plan.workers]
        if beats and all(b is not None and b.get("state") == "done" for b in beats):
            self.step = max(b["step"] for b in beats) + 1
            return
        time.sleep(0.2)

    # -- recovery ----------------------------------------------------------------------

    def _recover(self, reason: str) -> None:
        """Discard the step in progress and carry out the launcher's next plan."""
        if self.gen is not None:
            self.gen.abandon()
        self.shard.zero_grad()
        target = self.generation + 1
        while True:
            held = self.shard.held()
            # A spare holds nothing and its step is stale (it ran none): the step to
            # resume at is the holders'.
            spare = self.part is None
            self.control.put(
                f"ready/{target}/{self.rank}",
                {"step": None if spare else self.step, "held": held, "reason": reason[:200]},
            )
            message = self._wait_for_plan(target)
            try:
                self._apply(message)
                self.recoveries += 1
                return
            except (Aborted, CommError) as exc:  # a failure during the recovery itself
                self.gen.abandon()
                reason = str(exc)
                target = message.generation + 1

    def _wait_for_plan(self, target: int) -> PlanMessage:
        last_beat = 0.0
        while True:
            self._honour_exit_request()
            latest = self.control.get("gen")
            if latest is not None and latest >= target:
                data = self.control.get(f"plan/{latest}")
                if data is not None:
                    return PlanMessage.model_validate(data)
            if time.monotonic() - last_beat > HEARTBEAT_WHILE_WAITING_S:
                self.control.heartbeat(
                    step=self.step - 1, generation=self.generation, step_s=None, state="recovering"
                )
                last_beat = time.monotonic()
            time.sleep(0.01)

    def _apply(self, message: PlanMessage) -> None:
        if self.part is None:  # a spare (or a replacement) takes the holders' step
            self.step = message.resume_step
        plan = message.plan.to_plan()
        sources = {t.src for t in message.transfers}
        members = sorted(set(plan.workers) | sources)
        if self.rank not in members:  # neither used nor needed: a spare from now on
            self.generation, self.plan, self.part = message.generation, plan, None
            # What it held goes stale with the next step: never let it pass for current
            # state (a later plan would copy it from here), and give the memory back.
            self.shard.keep_only(0, 0)
            self.control.watch(message.generation)
            self.step = message.resume_step
            return
        self._start_generation(message.generation, plan, members=members)
        received = self._migrate(message)
        self.control.barrier(
            f"migrated/{message.generation}", len(members), generation=message.generation
        )
        # Every transfer is confirmed: only now replace and free state.
        for header, tensors in received:
            self.shard.import_layer(header, tensors)
        if self.rank in plan.stage_of:
            stage = plan.stage_of[self.rank]
            self.shard.ensure(stage.first_layer, stage.end_layer)  # no-op unless a bug
            self.shard.keep_only(stage.first_layer, stage.end_layer)
        else:
            self.shard.keep_only(0, 0)
        if message.resume_step != self.step:
            raise RuntimeError(
                f"plan resumes at step {message.resume_step}, this worker is at {self.step}"
            )
        self.step = message.resume_step
        self.control.heartbeat(
            step=self.step - 1, generation=self.generation, step_s=None, state="applied"
        )

    def _migrate(self, message: PlanMessage) -> list[tuple[dict, list[torch.Tensor]]]:
        """Send and receive layer state, round by round (a worker takes part in one
        transfer per round); headers travel as JSON through the store."""
        received = []
        rounds = sorted({t.round for t in message.transfers})
        for r in rounds:
            for n, t in enumerate(message.transfers):
                if t.round != r:
                    continue
                tag_base = 1_000_000 + n * 10_000
                for k, layer in enumerate(range(t.first_layer, t.end_layer)):
                    key = f"mig/{message.generation}/{n}/{layer}"
                    if t.src == self.rank:
                        header, tensors = self.shard.export_layer(layer)
                        self.control.put(key, header)
                        for j, tensor in enumerate(tensors):
                            self.gen.send(tensor, t.dst, tag_base + k * 100 + j)
                    elif t.dst == self.rank:
                        while (header := self.control.get(key)) is None:
                            if self.control.abort.is_set():
                                raise Aborted("migration aborted")
                            time.sleep(0.002)
                        tensors = Shard.empty_tensors(header)
                        for j, tensor in enumerate(tensors):
                            self.gen.recv(tensor, t.src, tag_base + k * 100 + j)
                        received.append((header, tensors))
            self.gen.flush_sends()
        return received


def _optimizer_bytes_per_param(shard: Shard) -> int:
    """Adam keeps two fp32 moments per parameter; SGD with momentum one."""
    name = (
        type(next(iter(shard.optimizers.values()))).__name__.lower() if shard.optimizers else "adam"
    )
    return 8 if "adam" in name else 4


def _memory_per_worker() -> int:
    limit = os.environ.get("CHAMELEON_MEMORY_LIMIT_BYTES")
    if limit:
        return int(limit)
    import psutil

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return int(psutil.virtual_memory().total / max(1, local))
