"""What each operation of a step costs in time, and what each worker holds in memory.

Durations (PAPER.md, unified performance model):
- forward/backward of a micro-batch on a worker: the sum over its layers (profiled or
  analytic, see ``planner.config``), plus the runtime's own CPU per pass where measured;
- activation or gradient transfer between two workers: latency + bytes / bandwidth on
  the intra- or inter-node link between the two (one pair's link, not a device's
  aggregate: a migration between two NPUs of a mesh uses the one link between them);
- all-reduce of a bucket among n holders: ring all-reduce, 2(n-1)/n of the bytes over the
  slowest link among them plus 2(n-1) latencies (or, for the runtime's exact point-to-point
  exchange, n-1 sends of the whole bucket); within a node over a mesh, on the device's
  aggregate bandwidth; a ring's starts as soon as the last backward has made the bucket's
  gradients (planner.estimator.timing);
- commit barrier: exchange: two store round trips, and the loss one round trip to write a
  last stage's share, one to read the step's; ring: votes (with the loss and the
  squared norm) up a binary tree of the workers and the decision back down, point to
  point (planner.plans.program.commit_tree): twice the tree's depth in small messages, no store
  operation; optimizer: the sum over the worker's layers.

Memory of a worker (what chameleon_runtime.memory measures): parameters, gradients and
optimizer state of its layers, plus the largest of what a step holds beside them: the
activations saved for the micro-batches in flight (1F1B keeps n - k of them on stage k of
n) with each one's output and the input gradient a backward has just made. A ring's
gradients are the buckets' buffers that autograd accumulates into and the all-reduce sums
in place (``grad_bytes`` each); the exchange keeps float64 sums (``grad_bytes`` 8) and
holds besides them the gradients a backward has just made, a bucket's exchange buffers,
or the rounded gradients the optimizer steps with.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from planner.job.workload import Job, Link

# A ring's commit message: the vote, the loss and the squared norm, as float64.
COMMIT_BYTES = 24


@dataclass(frozen=True)
class CostModel:
    job: Job

    # ``worker``: whose compute it is, for a job with slow workers (Job.slow); None: a
    # worker at the cost table's speed.

    def forward_s(self, first: int, end: int, worker: int | None = None) -> float:
        s = self.job.model.total("forward_s", first, end) + self.job.cluster.pass_cpu_s
        return s * self.job.slowdown(worker) if self.job.slow else s

    def backward_s(self, first: int, end: int, worker: int | None = None) -> float:
        s = self.job.model.total("backward_s", first, end) + self.job.cluster.pass_cpu_s
        return s * self.job.slowdown(worker) if self.job.slow else s

    def bucket_ready_s(
        self, compute_end_s: float, first: int, bucket_first: int, worker: int | None = None
    ) -> float:
        """When a ring's bucket starting at layer ``bucket_first`` is ready on a worker
        holding layers from ``first`` whose last pass (a backward) ended at
        ``compute_end_s``: that backward had the layers below the bucket still to do."""
        below = self.job.model.total("backward_s", first, bucket_first)
        if self.job.slow:
            below *= self.job.slowdown(worker)
        return max(0.0, compute_end_s - below)

    def optimizer_s(self, first: int, end: int, worker: int | None = None) -> float:
        s = self.job.model.total("optimizer_s", first, end)
        return s * self.job.slowdown(worker) if self.job.slow else s

    def boundary_bytes(self, layer: int) -> int:
        """Bytes crossing the boundary before ``layer`` (the previous layer's output)."""
        return self.job.model.layers[layer - 1].activation_bytes if layer > 0 else 0

    def transfer_s(self, src: int, dst: int, num_bytes: float) -> float:
        return self.job.link(src, dst).transfer_s(num_bytes)

    def transfers_s(self, src: np.ndarray, dst: np.ndarray, num_bytes: np.ndarray) -> np.ndarray:
        """``transfer_s`` of each (src, dst, bytes), element by element, the same bits."""
        job = self.job
        same_node = job.node_of(src) == job.node_of(dst)
        return np.where(
            same_node, job.intra_link.transfers_s(num_bytes), job.inter_link.transfers_s(num_bytes)
        )

    def slowest_link(self, workers: Iterable[int]) -> Link:
        node_of = self.job.node_of
        it = iter(workers)
        first = next(it, None)
        one_node = first is None or all(node_of(w) == node_of(first) for w in it)
        return self.job.intra_link if one_node else self.job.inter_link

    def allreduce_s(self, holders: tuple[int, ...], first: int, end: int) -> float:
        shards = self.job.training.shards
        # sharded (planner.job.fsdp): a column of one member per group, 1/S of the bytes
        n = len(holders) // shards
        if n < 2:
            return 0.0
        grad_bytes = (
            self.job.model.total("num_params", first, end) * self.job.training.grad_bytes / shards
        )
        link = self.slowest_link(holders)
        aggregate = self.job.cluster.intra_node_aggregate_bytes_per_s
        if aggregate and link is self.job.intra_link:
            # Within a node over a mesh every device drives all its links at once.
            link = Link(aggregate * self.job.tp, link.latency_s)
        if self.job.cluster.allreduce == "exchange":
            # Each holder sends its n - 1 copies one after another on its link.
            return (n - 1) * (grad_bytes / link.bandwidth_bytes_per_s + link.latency_s)
        return (
            2 * (n - 1) / n * grad_bytes / link.bandwidth_bytes_per_s + 2 * (n - 1) * link.latency_s
        )

    def commit_s(self, num_workers: int) -> float:
        """The commit barrier over ``num_workers`` (module doc)."""
        cluster = self.job.cluster
        if cluster.allreduce == "exchange":
            return 2 * cluster.store_round_trip_s
        if num_workers < 2:
            return 0.0
        spans = num_workers * self.job.tp > cluster.devices_per_node and cluster.num_nodes > 1
        link = self.job.inter_link if spans else self.job.intra_link
        depth = int(math.log2(num_workers))  # of a binary heap of num_workers
        return 2 * depth * link.transfer_s(COMMIT_BYTES)

    def store_s(self) -> float:
        """One store operation (a share of the loss written or read)."""
        return self.job.cluster.store_round_trip_s

    def state_bytes(self, first: int, end: int) -> int:
        """Parameters, gradients and optimizer state held (a shard's: planner.job.fsdp)."""
        training = self.job.training
        params = self.job.model.total("num_params", first, end)
        return int(params * training.state_bytes_per_param / training.shards)

    def unit_bytes(self, first: int, end: int) -> int:
        """A sharded model's largest FSDP unit whole, parameters and gradients, while it
        computes (planner.job.fsdp); nothing unsharded."""
        training = self.job.training
        if training.shards < 2:
            return 0
        unit = training.shard_unit_params or max(
            (layer.num_params for layer in self.job.model.layers[first:end]), default=0
        )
        return int(unit * (training.param_bytes + training.grad_bytes))

    def moved_bytes(self, first: int, end: int) -> int:
        training = self.job.training
        return int(self.job.model.total("num_params", first, end) * training.moved_bytes_per_param)

    def exchange_bytes(self, holders: int, first: int, end: int) -> int:
        """A bucket's exchange (chameleon_runtime.step) holds three bucket-sized buffers
        at once: this worker's sums, their running total and the one just received,
        however many holders share it; a bucket held alone is not exchanged."""
        if holders < 2:
            return 0
        params = self.job.model.total("num_params", first, end)
        return int(3 * params * self.job.training.grad_bytes)

    def memory_bytes(self, first: int, end: int, in_flight: int, exchange: int = 0) -> int:
        """Peak bytes of a worker's tensors: its state, plus the largest of what a step
        holds beside it at one time (``exchange``: its largest bucket's exchange_bytes)."""
        model, training = self.job.model, self.job.training
        stash = model.total("stash_bytes", first, end)
        # What a micro-batch in flight keeps besides what autograd saves: its output, for
        # the backward (the last stage keeps only the loss).
        out = model.layers[end - 1].activation_bytes if end < model.num_layers else 0
        params = model.total("num_params", first, end)
        held = stash + out
        if self.job.cluster.allreduce == "ring":
            # The gradients are state (module doc): beside it, the micro-batches in
            # flight, or one fewer and the input gradient of the backward just run.
            transient = max(
                in_flight * held, max(0, in_flight - 1) * held + self.boundary_bytes(first)
            )
            return int(self.state_bytes(first, end) + transient + self.unit_bytes(first, end))
        transient = max(
            in_flight * held,  # after a forward at the most micro-batches in flight
            # after a backward: one fewer in flight; the layers' .grad and the input's
            max(0, in_flight - 1) * held
            + params * training.param_bytes
            + self.boundary_bytes(first),
            exchange,
            params * training.param_bytes,  # every layer's rounded .grad for the optimizer
        )
        return int(self.state_bytes(first, end) + transient)
