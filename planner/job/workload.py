"""The job the planner plans for: hardware, model and training, as frozen values.

These are built once at the edge (``planner.config`` turns TOML into them; tests build
them directly) and are the only inputs the cost model reads. Every cost here is already
resolved to what one *worker* pays for one micro-batch: a worker is one tensor-parallel
group of ``tp`` devices (one device when tp = 1), the unit the planner places, loses and
moves. Failing any device of a worker loses the whole worker, as it does in practice.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from itertools import accumulate

import numpy as np

from planner.job.failures import DEFAULT_DEVICE_MTBF_H, FailureRate, Mtbf


class RankOrder(StrEnum):
    """How global ranks map onto the (tp, dp, pp) grid, innermost dimension first.

    ``tp-dp-pp`` is Megatron-LM's default: the replicas of one stage are neighbours, so a
    node tends to hold one stage of many pipelines. ``tp-pp-dp`` keeps each pipeline on
    consecutive ranks, so a node tends to hold whole pipelines.
    """

    TP_DP_PP = "tp-dp-pp"
    TP_PP_DP = "tp-pp-dp"


@dataclass(frozen=True)
class Link:
    """One point-to-point path between two workers (all tp devices of a worker in parallel)."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def transfer_s(self, num_bytes: float) -> float:
        if num_bytes <= 0:
            return 0.0
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s

    def transfers_s(self, num_bytes: np.ndarray) -> np.ndarray:
        """``transfer_s`` of each element: the same float64 arithmetic, so the same bits."""
        return np.where(num_bytes > 0, self.latency_s + num_bytes / self.bandwidth_bytes_per_s, 0.0)


@dataclass(frozen=True)
class Cluster:
    name: str
    num_nodes: int
    devices_per_node: int
    device_memory_bytes: int
    intra_node: Link  # between two devices of a node; Job.link() scales by tp
    inter_node: Link
    spare_nodes: int = 0
    # Relaunching every worker and loading a checkpoint (the torchrun path), in seconds.
    restart_s: float = 60.0
    # From a failure to the moment it is seen (the agent's monitor interval): every
    # policy pays it alike, so only chameleon simulate charges it.
    detection_s: float = 0.1
    # Rebuilding a communicator over n workers costs base + n * per_worker: every member
    # publishes its address in the store and connects to its peers.
    pg_init_base_s: float = 0.5
    pg_init_per_worker_s: float = 0.001
    # One round trip to the job's TCPStore; the per-step commit barrier costs two.
    store_round_trip_s: float = 0.0005
    # How holders sum a bucket's gradients (planner.plans.program): "ring" (chameleon_runtime's
    # default: a collective per bucket, overlapped with the last backward, on gloo, NCCL
    # or HCCL) or "exchange" (chameleon_runtime's exact mode: every holder sends its
    # float64 sums to every other and adds them in holder order, point to point).
    allreduce: str = "ring"
    # Workers that share a host's CPU cores instead of owning a device each (the CPU test
    # bed: 8 gloo workers on 2 cores). 0: a device per worker. When set, a step takes at
    # least the host's total compute divided by its cores, whatever the layout: pipeline
    # bubbles free cores for the other workers instead of wasting a device. None: not
    # said (a live job takes what its workers report). A live job uses the cores its
    # workers were measured to keep busy (fractional), so that the bound of the running
    # plan is its measured step.
    host_cores: float | None = None
    nodes_per_host: int = 1  # several agents on one host (multi-node tests on 127.0.0.1)
    # All of a device's links in a node at once, where that is more than one pair's link
    # (a mesh like Ascend's HCCS: 7 links of 56 GB/s): what an all-reduce within a node
    # can use. None: the pair's link is all a device has (a switch, like NVSwitch).
    intra_node_aggregate_bytes_per_s: float | None = None
    # Mean time between failures of one device (the prior of planner.job.failures).
    device_mtbf_s: float = DEFAULT_DEVICE_MTBF_H * 3600
    # On such hosts, the CPU time a worker spends per step beyond its layers (Python,
    # communication, the store: fewer workers, less of it). Measured live.
    worker_overhead_s: float = 0.0
    # ... and the CPU each point-to-point send or receive costs it (planner.estimator.fit).
    message_cpu_s: float = 0.0
    # ... and the CPU of each forward or backward pass beyond its layers (the runtime's
    # loop: receiving, sending, stashing, metering), whatever the layers: planner.job.cost
    # adds it to every pass.
    pass_cpu_s: float = 0.0
    # CPU per parameter moved, beyond the transfer (pack, unpack, build, load): profiled.
    move_cpu_s_per_param: float = 0.0
    # ... of which the sender spends packing, and the receiver unpacking, within their
    # transfer (profiled).
    pack_cpu_s_per_param: float = 0.0
    unpack_cpu_s_per_param: float = 0.0
    # What a transfer costs beyond its modelled parts (the receiver's wake-up, the
    # hand-off between the sender's and the receiver's threads): fitted to a chain of
    # transfers the profile timed (planner.plans.migration.fit_transfer_wait).
    transfer_wait_s: float = 0.0
    # Measured over modelled in-place transitions (migration, groups, protocol) of this
    # job's recoveries so far (launcher/calibration.py); 1 before any.
    transition_factor: float = 1.0
    # CPU per byte a worker sends or receives point to point (copies, the kernel's TCP):
    # a data parallel worker exchanges its whole model's gradients every step. Profiled.
    message_cpu_s_per_byte: float = 0.0
    # CPU per parameter held of a step's tail beyond the optimizer (flatten, sum and
    # unflatten a bucket, round the sums, zero them): chameleon_runtime.step. Profiled.
    tail_cpu_s_per_param: float = 0.0
    # A fit to measured steps (planner.estimator.fit) was made with this many workers per host
    # (0: none); how a pass's CPU grows per extra process, and the message wake-up wait
    # included in the links' latency at that load (planner.plans.load moves it to others).
    fitted_workers: int = 0
    contention: float = 0.0
    message_wait_s: float = 0.0

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node


@dataclass(frozen=True)
class Layer:
    """One pipeline-partitionable layer, with costs for one micro-batch on one worker."""

    name: str
    num_params: int
    forward_s: float
    backward_s: float
    optimizer_s: float  # optimizer update of this layer's parameters
    activation_bytes: int  # output sent to the next stage (and its gradient sent back)
    stash_bytes: int  # kept per in-flight micro-batch until its backward


@dataclass(frozen=True)
class Model:
    name: str
    layers: tuple[Layer, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @cached_property
    def layer_params(self) -> tuple[int, ...]:
        return tuple(x.num_params for x in self.layers)

    @cached_property
    def _prefix(self) -> dict[str, tuple[float, ...]]:
        def prefix(values: list[float]) -> tuple[float, ...]:
            return (0.0, *accumulate(values))

        layers = self.layers
        return {
            "forward_s": prefix([x.forward_s for x in layers]),
            "backward_s": prefix([x.backward_s for x in layers]),
            "optimizer_s": prefix([x.optimizer_s for x in layers]),
            "num_params": prefix([float(x.num_params) for x in layers]),
            "stash_bytes": prefix([float(x.stash_bytes) for x in layers]),
        }

    def total(self, field: str, first: int, end: int) -> float:
        """Sum of a per-layer field over layers [first, end), in O(1)."""
        column = self._prefix[field]
        return column[end] - column[first]


@dataclass(frozen=True)
class Training:
    global_batch_size: int  # samples per optimizer step, whatever the layout
    micro_batch_size: int
    param_bytes: int  # per parameter: weights as stored for compute
    grad_bytes: int
    optimizer_bytes: int  # per parameter: master weights and moments
    dp: int
    pp: int
    tp: int = 1
    rank_order: RankOrder = RankOrder.TP_PP_DP
    # D given outright (a config's mtbf_hours, --mtbf); None: from the devices' failure
    # rate (Cluster.device_mtbf_s) and what the job observes (planner.job.failures).
    mtbf_s: float | None = None
    checkpoint_interval_s: float = 1800.0
    # Each step reports and reads the layers' squared gradient norms through the store
    # (planner.plans.program.TailKind.REPORT_NORM): to clip the gradients to a global norm, or
    # for fp16's overflow check.
    global_norm: bool = False
    # HSDP (the drop-in's sharded model, chameleon_runtime.sharding): the plan's workers,
    # sorted, form replica groups of this many, each holding the model sharded over its
    # members; a group that lost a member cannot compute (planner.choice.selection).
    shards: int = 1
    # The largest FSDP unit's parameters, all-gathered whole while it computes (the
    # drop-in measures them: a block); 0: each layer is a unit.
    shard_unit_params: int = 0

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    @property
    def state_bytes_per_param(self) -> int:
        """Resident bytes per parameter on its holder: weights, gradients, optimizer state."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def moved_bytes_per_param(self) -> int:
        """Bytes per parameter a worker must receive to take a layer over (gradients are
        recomputed every step, so only weights and optimizer state travel)."""
        return self.param_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class Job:
    cluster: Cluster
    model: Model
    training: Training
    # Workers slower than the others (a throttled device, a noisy neighbour, a host whose
    # loader falls behind: launcher/stragglers.py measures them), as (worker, factor):
    # every pass and optimizer update of theirs takes ``factor`` times what the cost table
    # says. Empty: every worker at the table's speed.
    slow: tuple[tuple[int, float], ...] = ()

    @cached_property
    def slowdowns(self) -> dict[int, float]:
        return dict(self.slow)

    def slowdown(self, worker: int | None) -> float:
        """How many times the cost table's time ``worker``'s compute takes (1: none)."""
        if not self.slow or worker is None:
            return 1.0
        return self.slowdowns.get(worker, 1.0)

    @property
    def tp(self) -> int:
        return self.training.tp

    @property
    def interchangeable_workers(self) -> bool:
        """Whether any renaming of workers (spares included) keeps every cost the same:
        each worker is a node of its own on a host of its own, at the cost table's speed,
        so every pair of workers is joined by the same link and shares nothing else."""
        c = self.cluster
        return (
            c.devices_per_node == self.tp
            and c.nodes_per_host <= 1
            and not c.host_cores
            and not self.slow
        )

    @property
    def num_workers(self) -> int:
        return self.cluster.num_devices // self.tp

    @property
    def num_spare_workers(self) -> int:
        return self.cluster.spare_nodes * self.cluster.devices_per_node // self.tp

    @property
    def worker_memory_bytes(self) -> int:
        return self.cluster.device_memory_bytes * self.tp

    def failure_rate(self) -> FailureRate:
        """The prior over failures (planner.job.failures); fixed when the job gives D."""
        fixed = self.training.mtbf_s
        return FailureRate(
            self.cluster.device_mtbf_s, fixed_s=fixed, fixed_source="config mtbf_hours"
        )

    def mtbf(self, workers: int) -> Mtbf:
        """D for this job on ``workers`` workers (tp devices each), before it has run."""
        return self.failure_rate().mtbf(workers * self.tp)

    def ranks_of(self, worker: int) -> range:
        """Global ranks (devices) of a worker; tp is always the innermost dimension."""
        return range(worker * self.tp, (worker + 1) * self.tp)

    def worker_of(self, rank: int) -> int:
        return rank // self.tp

    def node_of(self, worker: int) -> int:
        return worker * self.tp // self.cluster.devices_per_node

    def host_of(self, worker: int) -> int:
        """The host whose CPU cores ``worker`` shares (several nodes may be agents on one
        host: ``Cluster.nodes_per_host``)."""
        return self.node_of(worker) // max(1, self.cluster.nodes_per_host)

    def workers_on_node(self, node: int) -> range:
        per_node = self.cluster.devices_per_node // self.tp
        return range(node * per_node, (node + 1) * per_node)

    @cached_property
    def intra_link(self) -> Link:
        """Between workers on one node: the tp devices of each talk pairwise in parallel."""
        base = self.cluster.intra_node
        return Link(base.bandwidth_bytes_per_s * self.tp, base.latency_s)

    @cached_property
    def inter_link(self) -> Link:
        base = self.cluster.inter_node
        return Link(base.bandwidth_bytes_per_s * self.tp, base.latency_s)

    def link(self, a: int, b: int) -> Link:
        return self.intra_link if self.node_of(a) == self.node_of(b) else self.inter_link
