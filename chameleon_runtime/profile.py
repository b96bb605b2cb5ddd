"""What the planner needs to know about a model, measured.

- ``probe``, ``measure`` (chameleon_runtime.layercost): each layer's parameters, shapes,
  times and stashed bytes;
- ``link_cost``: latency, bandwidth and CPU per byte between two workers, by ping-pong.
- ``measure_move``, ``measure_tail``: the CPU per parameter of moving a layer, and of a
  step's tail.
- ``describe_job``: the job as the planner sees it, which every run publishes at start.

``chameleon profile`` runs a training script with CHAMELEON_PROFILE set: the Trainer then
measures instead of training (``profile_job``) and writes a cost table.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from chameleon_runtime.layercost import measure, probe
from chameleon_runtime.protocol.wire import JobDescription
from chameleon_runtime.shard import Shard
from planner.job.costtable import LayerCost


def link_cost(
    gen: Any,
    me: int,
    peer: int,
    *,
    sizes: tuple[int, ...] = (256, 1 << 22),
    reps: int = 5,
    device: str = "cpu",
) -> tuple[float, float, float]:
    """(latency s, bandwidth bytes/s, CPU s per byte) between two workers, from ping-pongs
    of a small and a large float32 message: latency from the small, bandwidth and this
    process's CPU per byte sent or received (all its threads: the copies and the
    kernel's TCP) from the difference."""
    times, cpu = {}, {}
    for size in sizes:
        buf = torch.zeros(size // 4, device=device)  # staged to host on gloo, as a step's
        samples, cpu_samples = [], []
        for rep in range(reps + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            if me < peer:
                gen.send(buf, peer)
                gen.flush_sends()
                gen.recv(buf, peer)
            else:
                gen.recv(buf, peer)
                gen.send(buf, peer)
                gen.flush_sends()
            if rep:
                samples.append((time.perf_counter() - t0) / 2)
                cpu_samples.append(time.process_time() - c0)  # one send, one receive
        times[size] = statistics.median(samples)
        cpu[size] = statistics.median(cpu_samples)
    small, large = sizes[0], sizes[-1]
    latency = times[small]
    bandwidth = (large - small) / max(times[large] - times[small], 1e-9)
    per_byte = max(0.0, cpu[large] - cpu[small]) / (2 * (large - small))
    return latency, bandwidth, per_byte


def measure_tail(shard: Shard, layers: list[int], reps: int = 5, *, exact: bool = False) -> float:
    """CPU per parameter held of a step's tail beyond the optimizer and the messages, as
    chameleon_runtime.step runs it with one other holder: ``exact``, the float64 sums
    flattened, summed with a received copy, put back, rounded and zeroed; a ring, the
    received half added into the bucket's buffer (the reduce-scatter's adds, which gloo
    does on its thread) and the buffer zeroed after the optimizer. The median of
    ``reps``."""
    first, end = min(layers), max(layers) + 1
    params = sum(p.numel() for i in layers for p in shard.layers[i].parameters())
    flat = torch.ones(params)
    half = flat[: params // 2]
    times = []
    for _ in range(reps + 1):
        c0 = time.thread_time()
        if exact:
            mine = shard.flat_sums(first, end)
            total = mine.clone()
            total += mine
            shard.set_flat_sums(first, end, total)
            shard.round_grads(first, end)
            shard.zero_grad()
        else:
            half.add_(half)
            flat.zero_()
        times.append(time.thread_time() - c0)
    return statistics.median(times[1:]) / max(1, params)


# Real steps run first, in processes as fresh as a run's; the first few pay for warm-up.
# A step's time varies by 10% or more from one to the next on a shared host: 34 steps
# give a median within a few percent of a long run's.
PROFILE_STEPS = 40
PROFILE_WARMUP_STEPS = 6
# What measure_move returns, in order: each worker's goes to the store under its name and
# the table keeps the median as ``<name>_cpu_s_per_param`` (as it does for the tail's).
PER_PARAM = ("move", "pack", "unpack")


def measure_steps(trainer: Any, steps: int) -> dict[str, float]:
    """Run ``steps`` real training steps of the script's own layout (generation 0) and
    return this worker's medians over all but the first few: wall time per step, the
    process's CPU per step, and the CPU its layers' passes took. What a step costs beyond
    the layers (Python, messages, the store) shows only in such steps, and the planner
    fits it from them (planner.estimator.fit)."""
    from chameleon_runtime.step import run_step

    plan = trainer.initial_plan()
    stage = plan.stage_of[trainer.rank]
    trainer.shard.ensure(stage.first_layer, stage.end_layer)
    trainer.shard.keep_only(stage.first_layer, stage.end_layer)
    member = trainer.membership()
    member.enter(0, plan, plan.workers)
    rows = []
    forget: list[str] = []
    mark = time.process_time()
    try:
        for step in range(steps):
            result = run_step(
                step=step, part=member.part, shard=trainer.shard, gen=member.gen,
                control=trainer.control, batches=trainer.batches, loss_fn=trainer.loss_fn,
                activation_shapes=trainer.activation_shapes, meter=trainer.meter, forget=forget,
                max_grad_norm=trainer.max_grad_norm, reducer=member.ring_reducer(),
            )  # fmt: skip
            now = time.process_time()
            rows.append((result.seconds, now - mark, result.compute_cpu_s, result.pass_cpu_s))
            mark = now
            trainer.control.status.update(
                phase="train", step=step + 1, progress=step + 1, step_s=result.seconds
            )  # as a run reports every step
            forget = trainer.control.keys.step_keys(
                0, step, member.part.last_stage_workers(), checkpointed=False,
                norm_owners=member.part.norm_owners(),
            )  # fmt: skip
    finally:
        member.leave()
        member.let_go_of_collectives()
    settled = rows[PROFILE_WARMUP_STEPS:] or rows
    return {
        "step_s": statistics.median(r[0] for r in settled),
        "cpu_s": statistics.median(r[1] for r in settled),
        "compute_cpu_s": statistics.median(r[2] for r in settled),
        "pass_cpu_s": statistics.median(r[3] for r in settled),
    }


def measure_move(shard: Shard, layers: list[int]) -> tuple[float, float, float]:
    """CPU per parameter of moving ``layers`` besides the transfer itself, as a migration
    does (chameleon_runtime.membership): (all of it, the sender's share, the receiver's
    unpacking). The sender exports and packs, and the receiver unpacks, within their
    transfer; the receiver builds the layer and loads its state (here into a fresh
    shard) after the transfers."""
    from chameleon_runtime.shard import pack_layers, unpack_layers

    fresh = Shard(shard.factory, shard.make_optimizer, seed=shard.seed, device=shard.device)
    params = sum(p.numel() for i in layers for p in shard.layers[i].parameters())
    packing = unpacking = 0.0
    c0 = time.thread_time()
    for i in layers:
        p0 = time.thread_time()
        blob, header_len = pack_layers([shard.export_layer(i)])
        p1 = time.thread_time()
        received = unpack_layers(blob, header_len)
        p2 = time.thread_time()
        packing, unpacking = packing + p1 - p0, unpacking + p2 - p1
        for header, tensors in received:
            fresh.import_layer(header, tensors)
    per = 1 / max(1, params)
    return (time.thread_time() - c0) * per, packing * per, unpacking * per


def measure_chain(gen: Any, shard: Shard, me: int, world: int, layer: int, reps: int = 3) -> float:
    """Wall time of a migration's transfers one after another, through the runtime's own
    code (``recovery.move_layers``): ``layer`` goes round the ring of workers, each
    sending it on once it has it, so one transfer runs at a time while the others wait
    blocked, as in a migration scheduled one at a time. The median over ``reps`` (after
    a warm-up) of the whole chain as the first worker sees it; the planner fits the
    hand-off a transfer costs beyond its modelled parts to it (planner.plans.migration)."""
    from chameleon_runtime.membership import move_layers
    from chameleon_runtime.protocol.wire import TransferWire

    chain = [
        TransferWire(src=w, dst=(w + 1) % world, first_layer=layer, end_layer=layer + 1, round=w)
        for w in range(world)
    ]
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        move_layers(gen, shard, chain, me)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def measure_alone(trainer: Any, reps: int = 3) -> float:
    """CPU time of one whole step's passes and optimizer in this one process (it holds
    every layer while profiling): the median of ``reps`` after a warm-up."""
    shard, batches, n = trainer.shard, trainer.batches, trainer.num_layers
    m = batches.num_micro_batches
    times = []
    for _ in range(reps + 1):
        c0 = time.thread_time()
        for mb in range(m):
            y = shard.forward(batches.inputs(0, mb), 0, n, step=0, micro_batch=mb)
            (trainer.loss_fn(y, batches.targets(0, mb)) / m).backward()
            shard.accumulate(0, n)
        shard.round_grads(0, n)
        shard.zero_grad()  # the optimizer's cost is measured per layer; no update here
        times.append(time.thread_time() - c0)
    return statistics.median(times[1:])


def _steps_measured(control: Any, world: int, plan: Any) -> Any:
    from planner.job.costtable import StepsMeasured
    from planner.plans.planjson import PlanWire

    rows = {r: json.loads(control.wait(control.keys.profile(f"steps/{r}"))) for r in range(world)}
    return StepsMeasured(
        plan=PlanWire.of(plan).model_dump(mode="json"),
        step_s=statistics.median(x["step_s"] for x in rows.values()),
        cpu_s={r: x["cpu_s"] for r, x in rows.items()},
        compute_cpu_s={r: x["compute_cpu_s"] for r, x in rows.items()},
        pass_cpu_s={r: x["pass_cpu_s"] for r, x in rows.items()},
        alone_passes_cpu_s=float(control.wait(control.keys.profile("alone"))),
    )


def profile_job(trainer: Any, out: Path) -> None:
    """``chameleon profile``: every worker measures every layer at once (contention
    included), workers 0 and 1 the link between them, all of them the store; rank 0 writes
    the per-layer medians as a cost table (atomically). ``trainer`` is connected."""
    from chameleon_runtime.comm import Generation
    from planner.job.costtable import CostTable, LayerCost, LinkCost, MigrationMeasured

    control, rank, world = trainer.control, trainer.rank, trainer.world_size
    keys = control.keys
    sample = trainer.batches.inputs(0, 0)
    trainer.layer_params, trainer.activation_shapes, trainer.layer_names = probe(
        trainer.factory, trainer.num_layers, sample, seed=trainer.seed,
        wire_dtype=trainer.shard.wire_dtype, device=trainer.device,
    )  # fmt: skip
    sample_steps = measure_steps(trainer, PROFILE_STEPS)
    trainer.shard.ensure(0, trainer.num_layers)
    names = trainer.layer_names
    for cost in measure(trainer.shard, list(range(trainer.num_layers)), sample, names, reps=5):
        control.put(keys.profile(f"{rank}/{cost.name}"), cost.model_dump_json())
    every = list(range(trainer.num_layers))
    per_param = dict(zip(PER_PARAM, measure_move(trainer.shard, every), strict=True))
    per_param["tail"] = measure_tail(trainer.shard, every, exact=trainer.exact)
    for name, value in per_param.items():
        control.put(keys.profile(f"{name}/{rank}"), repr(value))
    control.agree(0, "profile/start", world)
    t0 = time.perf_counter()
    gen = Generation(
        store=control.store, prefix=keys.profile("groups"), generation=0,
        members=list(range(world)), me=rank, interrupts=control.interrupts,
        status=control.status, transport=trainer.transport,
    )  # fmt: skip
    pg_init_s = time.perf_counter() - t0
    pair_s = _pair_group_s(trainer, control, rank, world)
    link = (
        link_cost(gen, rank, 1 - rank, device=trainer.device)
        if world >= 2 and rank in (0, 1)
        else None
    )
    t0 = time.perf_counter()
    for _ in range(100):
        control.store.add(keys.profile("ping"), 0)
    store_rt = (time.perf_counter() - t0) / 100
    chain = None
    if world >= 2:
        control.agree(0, "profile/chain", world)
        biggest = max(range(trainer.num_layers), key=lambda i: trainer.layer_params[i])
        chain = (biggest, measure_chain(gen, trainer.shard, rank, world, biggest))
    gen.abandon()
    # One worker computes a whole step alone while the others wait (blocked in the store,
    # not spinning): against the same work spread over every worker at once, it shows how
    # much a pass's CPU grows with the processes sharing the cores (planner.estimator.fit).
    if rank == 0:
        control.put(keys.profile("alone"), repr(measure_alone(trainer)))
    control.agree(0, "profile/alone", world)
    control.put(keys.profile(f"steps/{rank}"), json.dumps(sample_steps))
    control.agree(0, "profile/done", world)
    if rank != 0:
        return
    layers = []
    for i, name in enumerate(names):
        key = f"{name}.{i}"
        samples = [
            LayerCost.model_validate_json(control.wait(keys.profile(f"{r}/{key}")))
            for r in range(world)
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
        device=trainer.device,
        micro_batch_size=trainer.batches.micro_batch_size,
        concurrent_workers=world,
        layers=layers,
        intra_node=LinkCost(bandwidth_gb_per_s=link[1] / 1e9, latency_us=link[0] * 1e6)
        if link
        else None,
        store_round_trip_s=store_rt,
        **_group_costs(pg_init_s, pair_s, world),
        **{
            f"{name}_cpu_s_per_param": statistics.median(
                float(control.wait(keys.profile(f"{name}/{r}"))) for r in range(world)
            )
            for name in (*PER_PARAM, "tail")
        },
        migration=MigrationMeasured(workers=world, layer=chain[0], wall_s=chain[1])
        if chain
        else None,
        message_cpu_s_per_byte=link[2] if link else None,
        steps=_steps_measured(control, world, trainer.initial_plan()),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(table.model_dump_json(indent=2))
    os.replace(tmp, out)


def _pair_group_s(trainer: Any, control: Any, rank: int, world: int) -> float | None:
    """Time for ranks 0 and 1 to build a group of two (both there first), beside the
    whole world's: two sizes give the cost of a group per member (``_group_costs``);
    a ring's recoveries build groups of a bucket's holders (planner.estimator.transition)."""
    from datetime import timedelta

    import torch.distributed as dist

    if world < 3:
        return None
    control.agree(0, "profile/pair", world)
    if rank > 1:
        return None
    store = dist.PrefixStore(control.keys.profile("pair"), control.store)
    t0 = time.perf_counter()
    group = trainer.transport.make_group(store, rank, 2, timedelta(seconds=30))
    elapsed = time.perf_counter() - t0
    del group
    return elapsed


def _group_costs(world_s: float, pair_s: float | None, world: int) -> dict[str, float]:
    """``pg_init_base_s`` and ``pg_init_per_worker_s`` from the builds of the world's
    group and of a pair (a line through the two); the world's alone as the base when
    there is no pair."""
    if pair_s is None:
        return {"pg_init_base_s": world_s}
    per = max(0.0, (world_s - pair_s) / (world - 2))
    return {"pg_init_base_s": max(0.0, pair_s - 2 * per), "pg_init_per_worker_s": per}


def describe_job(
    trainer: Any, plan: Any, costs: list[LayerCost], *, resume_step: int = 0
) -> JobDescription:
    """The job as the planner sees it: the layers' measured costs and what the trainer
    was given (batch, layout, precision, clipping), published by the chief at start.
    ``plan`` None: no layout launched, the leader plans it (``layout="auto"``)."""
    return JobDescription(
        model=type(trainer).__name__,
        layers=costs,
        global_batch_size=trainer.batches.global_batch_size,
        micro_batch_size=trainer.batches.micro_batch_size,
        param_bytes=4,
        # ring: the fp32 gradients, all-reduced in their buffers (chameleon_runtime.
        # reducer); exact: float64 sums, exchanged as such (chameleon_runtime.shard), and
        # the float32 gradient of the pass in flight adds up to 4 more at the peak.
        grad_bytes=8 if trainer.exact else 4,
        optimizer_bytes=optimizer_bytes_per_param(trainer.shard.optimizer),
        dp=len(plan.pipelines) if plan is not None else trainer.world_size,
        pp=trainer.pipeline_stages if plan is not None else 1,
        memory_limit_bytes=memory_per_worker(),
        link_bandwidth_bytes_per_s=1e9,
        link_latency_s=1e-4,
        checkpoint_interval_steps=max(1, trainer.checkpoint_every),
        max_grad_norm=trainer.max_grad_norm,
        precision=trainer.precision,
        host_cores=host_cores(trainer.device),
        exact=trainer.exact,
        layout="given" if plan is not None else "auto",
        resume_step=resume_step,
    )


def optimizer_bytes_per_param(optimizer: torch.optim.Optimizer | None) -> int:
    """Adam keeps two fp32 moments per parameter; SGD with momentum one."""
    name = type(optimizer).__name__.lower() if optimizer is not None else "adam"
    return 8 if "adam" in name else 4


def host_cores(device: str) -> int:
    """The cores a CPU job's workers share (workload.Cluster.host_cores); 0 on devices."""
    return len(os.sched_getaffinity(0)) if device == "cpu" else 0


def memory_per_worker() -> int:
    limit = os.environ.get("CHAMELEON_MEMORY_LIMIT_BYTES")
    if limit:
        return int(limit)
    import psutil

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return int(psutil.virtual_memory().total / max(1, local))
