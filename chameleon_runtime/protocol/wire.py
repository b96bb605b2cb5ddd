"""Messages between the launcher and chameleon_runtime workers, as JSON (pydantic).

- ``JobDescription``: what a running job is, published by its workers at start: every
  layer's measured costs and sizes, the batch, the layout. The launcher turns it into a
  planner ``Job`` when a failure needs a plan.
- ``PlanMessage``: a plan generation for the workers to apply: the plan, the step to
  resume at, the policy that produced it and the weight migration to carry out.

Converted once at the edge: everything inside the planner and the runtime works on the
frozen dataclasses of ``planner.plans.plan`` and ``planner.job.workload``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from planner.job.costtable import LayerCost
from planner.job.workload import Cluster, Job, Link, Model, Training
from planner.plans.migration import Migration
from planner.plans.plan import Plan
from planner.plans.planjson import PlanWire
from planner.plans.program import reads_global_norm

NonNegative = Annotated[float, Field(ge=0)]


class _Wire(BaseModel):
    # Floats as JSON's Infinity and NaN where they are not finite (protocol.messages).
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")


class JobDescription(_Wire):
    model: str
    layers: list[LayerCost]  # measured by the workers: a cost table's rows
    global_batch_size: int
    micro_batch_size: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    dp: int
    pp: int
    memory_limit_bytes: int  # per worker
    link_bandwidth_bytes_per_s: float
    link_latency_s: float
    checkpoint_interval_steps: int
    # Trainer(max_grad_norm=...): None when gradients are not clipped.
    max_grad_norm: float | None = None
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # CPU workers share their host's cores (workload.Cluster.host_cores); 0 on devices.
    host_cores: int = 0
    # Trainer(exact=True): float64 sums exchanged point to point, not a ring's collectives.
    exact: bool = False
    # Trainer(pipeline_stages="auto"): no layout was launched; the leader plans generation
    # 0 from this description (planner.choice.selection.launch_choice), to start at
    # ``resume_step`` (after the last checkpoint). dp and pp then say W and 1.
    layout: Literal["given", "auto"] = "given"
    resume_step: Annotated[int, Field(ge=0)] = 0
    # The drop-in's sharded model: replica groups of this many workers (HSDP,
    # chameleon_runtime.sharding).
    shards: Annotated[int, Field(ge=1)] = 1
    # its largest FSDP unit's parameters (a block, or the root's own), 0 unsharded
    shard_unit_params: Annotated[int, Field(ge=0)] = 0

    @property
    def allreduce(self) -> str:
        """What the runtime executes (planner.plans.program), whatever a config says."""
        return "exchange" if self.exact else "ring"

    def to_job(
        self,
        *,
        num_nodes: int,
        workers_per_node: int,
        mtbf_s: float | None,
        step_s: float,
        restart_s: float,
        pg_init_base_s: float = 0.2,
        pg_init_per_worker_s: float = 0.02,
        store_round_trip_s: float = 0.0005,
        cluster: Cluster | None = None,
        nodes_per_host: int = 1,
    ) -> Job:
        """The running job as the planner sees it, on the launch's topology. ``cluster``
        (from ``chameleon run --config``) supplies the figures a worker cannot know: device
        memory, links, restart and group-creation costs."""
        link = Link(self.link_bandwidth_bytes_per_s, self.link_latency_s)
        live = Cluster(
            name="live",
            num_nodes=num_nodes,
            devices_per_node=workers_per_node,
            device_memory_bytes=self.memory_limit_bytes,
            intra_node=link,
            inter_node=link,
            restart_s=restart_s,
            pg_init_base_s=pg_init_base_s,
            pg_init_per_worker_s=pg_init_per_worker_s,
            store_round_trip_s=store_round_trip_s,
            allreduce=self.allreduce,
            host_cores=self.host_cores,
            nodes_per_host=nodes_per_host,
        )
        if cluster is not None:
            live = replace(
                cluster,
                num_nodes=num_nodes,
                devices_per_node=workers_per_node,
                spare_nodes=0,
                allreduce=self.allreduce,
                host_cores=self.host_cores if cluster.host_cores is None else cluster.host_cores,
                nodes_per_host=nodes_per_host,
            )
        cluster = live
        layers = tuple(x.to_layer() for x in self.layers)
        training = Training(
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            param_bytes=self.param_bytes,
            grad_bytes=self.grad_bytes,
            optimizer_bytes=self.optimizer_bytes,
            dp=self.dp,
            pp=self.pp,
            mtbf_s=mtbf_s,
            checkpoint_interval_s=max(step_s, 1e-3) * self.checkpoint_interval_steps,
            global_norm=reads_global_norm(self.max_grad_norm, self.precision),
            shards=self.shards,
            shard_unit_params=self.shard_unit_params,
        )
        return Job(cluster=cluster, model=Model(self.model, layers), training=training)


class TransferWire(_Wire):
    src: int
    dst: int
    first_layer: int
    end_layer: int
    round: int


class RollForwardWire(_Wire):
    """Step ``step`` was committed (some survivor saw its commit end): a worker that
    posted that commit without seeing it end applies its gradients with the commit's
    sums (``values``: chameleon_runtime.protocol.messages.Ready.committed) before the plan."""

    step: int
    values: list[float]


class PlanMessage(_Wire):
    generation: int
    policy: str
    resume_step: int
    plan: PlanWire
    transfers: list[TransferWire] = []
    estimated_step_s: float | None = None
    roll_forward: RollForwardWire | None = None
    # the replica groups whose rows the transfers re-shard (planner.plans.rows); empty:
    # each transfer heals its destination whole (chameleon_runtime.heal)
    reshard_from: list[list[int]] = []
    # a preemption notice: the members save at ``resume_step`` and stop (the Trainer;
    # the drop-in's members agree in their commit: chameleon_runtime.preemption)
    stop: bool = False

    @classmethod
    def build(
        cls,
        *,
        generation: int,
        policy: str,
        resume_step: int,
        plan: Plan,
        migration: Migration | None = None,
        estimated_step_s: float | None = None,
        roll_forward: tuple[int, tuple[float, ...]] | None = None,
        stop: bool = False,
    ) -> PlanMessage:
        transfers = []
        if migration is not None:
            transfers = [
                TransferWire(
                    src=t.src, dst=t.dst, first_layer=t.first_layer, end_layer=t.end_layer, round=r
                )
                for t, r in zip(migration.transfers, migration.rounds, strict=True)
            ]
        return cls(
            generation=generation,
            policy=policy,
            resume_step=resume_step,
            plan=PlanWire.of(plan),
            transfers=transfers,
            estimated_step_s=estimated_step_s,
            roll_forward=RollForwardWire(step=roll_forward[0], values=list(roll_forward[1]))
            if roll_forward is not None
            else None,
            reshard_from=[list(g) for g in migration.reshard_from] if migration else [],
            stop=stop,
        )
