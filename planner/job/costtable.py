"""The cost table ``chameleon profile`` writes and the planner reads (JSON).

Measured per-layer forward, backward and optimizer times for one micro-batch of a given
size on one worker, the layer's parameter count and activation sizes, plus the measured
links, store round trip and communicator rebuild cost. A config names it with
``[model] cost_table = "..."``; measured figures then replace the analytic ones.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from planner.job.errors import ConfigError
from planner.job.workload import Layer, Link

NonNegative = Annotated[float, Field(ge=0)]
FORMAT = "chameleon-cost-table/1"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LayerCost(_Strict):
    name: str
    num_params: Annotated[int, Field(ge=0)]
    forward_s: NonNegative
    backward_s: NonNegative
    optimizer_s: NonNegative
    activation_bytes: Annotated[int, Field(ge=0)]
    stash_bytes: Annotated[int, Field(ge=0)]

    def to_layer(self) -> Layer:
        return Layer(
            name=self.name,
            num_params=self.num_params,
            forward_s=self.forward_s,
            backward_s=self.backward_s,
            optimizer_s=self.optimizer_s,
            activation_bytes=self.activation_bytes,
            stash_bytes=self.stash_bytes,
        )


class LinkCost(_Strict):
    bandwidth_gb_per_s: Annotated[float, Field(gt=0)]
    latency_us: NonNegative

    def to_link(self) -> Link:
        return Link(self.bandwidth_gb_per_s * 1e9, self.latency_us * 1e-6)


class StepsMeasured(_Strict):
    """Real steps of one layout, run by ``chameleon profile`` after the layers: what a
    step costs beyond them (planner.estimator.fit fits it when a config loads the table)."""

    plan: dict  # chameleon_runtime.protocol.wire.PlanWire of the layout the steps ran
    step_s: NonNegative  # median over workers of each one's median step
    cpu_s: dict[int, NonNegative]  # per worker: the process's CPU per step
    compute_cpu_s: dict[int, NonNegative]  # per worker: its passes' and optimizer's CPU
    # per worker: the pass loop's CPU beyond the layers (None: a table from before it)
    pass_cpu_s: dict[int, NonNegative] | None = None
    # One process alone, every layer: one step's forward and backward passes, CPU time.
    alone_passes_cpu_s: NonNegative | None = None


class MigrationMeasured(_Strict):
    """A chain of transfers timed by ``chameleon profile`` through the runtime's own
    migration code: layer ``layer`` sent round the ring of ``workers`` (worker w to
    w + 1), one transfer at a time. planner.plans.migration fits what a transfer costs beyond
    its modelled parts (the receiver's wake-up, the hand-off) to it."""

    workers: Annotated[int, Field(ge=2)]
    layer: Annotated[int, Field(ge=0)]
    wall_s: NonNegative


class CostTable(_Strict):
    format: Literal["chameleon-cost-table/1"] = FORMAT
    device: str
    micro_batch_size: Annotated[int, Field(gt=0)]
    tp: Annotated[int, Field(gt=0)] = 1
    # Workers that ran at once while measuring: on a shared host (the CPU test bed) a
    # layer's time depends on how many processes compete for the cores.
    concurrent_workers: Annotated[int, Field(gt=0)] = 1
    layers: list[LayerCost]
    intra_node: LinkCost | None = None
    inter_node: LinkCost | None = None
    store_round_trip_s: NonNegative | None = None
    pg_init_base_s: NonNegative | None = None
    pg_init_per_worker_s: NonNegative | None = None
    # CPU per parameter to move a layer besides the transfer: export and pack it on the
    # sender, unpack, build and load it on the receiver (chameleon_runtime.membership).
    move_cpu_s_per_param: NonNegative | None = None
    # ... of which the sender's: export and pack, within its transfer's round.
    pack_cpu_s_per_param: NonNegative | None = None
    # ... and the receiver's unpacking, within its transfer.
    unpack_cpu_s_per_param: NonNegative | None = None
    migration: MigrationMeasured | None = None
    # CPU per byte sent or received point to point (one worker's, both ways).
    message_cpu_s_per_byte: NonNegative | None = None
    # CPU per parameter held of a step's tail beyond the optimizer: a bucket flattened,
    # summed with one other holder's and put back, rounded, zeroed.
    tail_cpu_s_per_param: NonNegative | None = None
    steps: StepsMeasured | None = None

    def to_layers(self, *, micro_batch_size: int, tp: int) -> tuple[Layer, ...]:
        if micro_batch_size != self.micro_batch_size or tp != self.tp:
            raise ConfigError(
                f"cost table was measured at micro_batch_size={self.micro_batch_size}, tp={self.tp}; "
                f"the config trains at micro_batch_size={micro_batch_size}, tp={tp}: profile again"
            )
        return tuple(x.to_layer() for x in self.layers)
