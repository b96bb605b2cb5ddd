"""What each operation of a step costs in time, and what each worker holds in memory.

Durations (PAPER.md, unified performance model):
- forward/backward of a micro-batch on a worker: the sum over its layers (profiled or
  analytic, see ``planner.config``);
- activation or gradient transfer between two workers: latency + bytes / bandwidth on
  the intra- or inter-node link between the two (one pair's link, not a device's
  aggregate: a migration between two NPUs of a mesh uses the one link between them);
- all-reduce of a bucket among n holders: ring all-reduce, 2(n-1)/n of the bytes over the
  slowest link among them plus 2(n-1) latencies (or, for the runtime's point-to-point
  exchange, n-1 sends of the whole bucket); within a node over a mesh, on the device's
  aggregate bandwidth;
- commit barrier: two store round trips; optimizer: the sum over the worker's layers.

Memory of a worker: parameters, gradients and optimizer state of its layers, plus the
activations stashed for the micro-batches in flight (1F1B keeps n - k of them on stage k
of n), plus one micro-batch's input and output buffers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from planner.workload import Job, Link


@dataclass(frozen=True)
class CostModel:
    job: Job

    def forward_s(self, first: int, end: int) -> float:
        return self.job.model.total("forward_s", first, end)

    def backward_s(self, first: int, end: int) -> float:
        return self.job.model.total("backward_s", first, end)

    def optimizer_s(self, first: int, end: int) -> float:
        return self.job.model.total("optimizer_s", first, end)

    def boundary_bytes(self, layer: int) -> int:
        """Bytes crossing the boundary before ``layer`` (the previous layer's output)."""
        return self.job.model.layers[layer - 1].activation_bytes if layer > 0 else 0

    def transfer_s(self, src: int, dst: int, num_bytes: float) -> float:
        return self.job.link(src, dst).transfer_s(num_bytes)

    def slowest_link(self, workers: Iterable[int]) -> Link:
        nodes = {self.job.node_of(w) for w in workers}
        return self.job.intra_link if len(nodes) <= 1 else self.job.inter_link

    def allreduce_s(self, holders: tuple[int, ...], first: int, end: int) -> float:
        n = len(holders)
        if n < 2:
            return 0.0
        grad_bytes = self.job.model.total("num_params", first, end) * self.job.training.grad_bytes
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

    def commit_s(self) -> float:
        return 2 * self.job.cluster.store_round_trip_s

    def state_bytes(self, first: int, end: int) -> int:
        training = self.job.training
        return int(self.job.model.total("num_params", first, end) * training.state_bytes_per_param)

    def moved_bytes(self, first: int, end: int) -> int:
        training = self.job.training
        return int(self.job.model.total("num_params", first, end) * training.moved_bytes_per_param)

    def memory_bytes(self, first: int, end: int, in_flight: int) -> int:
        stash = self.job.model.total("stash_bytes", first, end)
        buffers = self.boundary_bytes(first) + self.job.model.layers[end - 1].activation_bytes
        return int(self.state_bytes(first, end) + in_flight * stash + buffers)
