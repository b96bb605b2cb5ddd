"""What sharding a replica over a group costs (HSDP: ``Training.shards`` = S, the drop-in's
sharded model, chameleon_runtime.sharding), layer by layer, as FSDP2 runs it:

- before a layer's forward its parameters are all-gathered within the group, and again
  before its backward (resharded after the forward), and its gradients reduce-scattered
  after: rings of S over the group's slowest link, (S - 1) / S of the layer's bytes each
  (parameters in their compute type, gradients as summed). FSDP2 prefetches the next
  layer's all-gather while a layer computes, so a layer's forward takes the longer of its
  compute and its all-gather, and its backward the longer of its compute and an
  all-gather with a reduce-scatter (``fsdp_layers``);
- each member updates its shard only: a layer's optimizer time is 1/S of the whole;
- each member holds 1/S of the parameters, gradients and optimizer state, and, beside
  them, one FSDP unit's parameters and gradients whole while it computes
  (planner.job.cost.CostModel.memory_bytes);
- the sum across groups is an all-reduce among the R members of a column of 1/S of the
  gradients (planner.job.cost.CostModel.allreduce_s).

A live job's measured passes include its collectives already: only the configured
(analytic or profiled) layers are priced here.
"""

from __future__ import annotations

from dataclasses import replace

from planner.job.workload import Cluster, Layer, Link, Training


def group_link(cluster: Cluster, shards: int, tp: int) -> Link:
    """The slowest link of a replica group: S consecutive workers of tp devices."""
    within = shards * tp <= cluster.devices_per_node
    return cluster.intra_node if within else cluster.inter_node


def ring_s(link: Link, shards: int, num_bytes: float) -> float:
    """An all-gather or reduce-scatter of ``num_bytes`` (whole) over a ring of S."""
    if shards < 2 or num_bytes <= 0:
        return 0.0
    return (shards - 1) / shards * num_bytes / link.bandwidth_bytes_per_s + (
        shards - 1
    ) * link.latency_s


def fsdp_layers(
    layers: tuple[Layer, ...], training: Training, cluster: Cluster
) -> tuple[Layer, ...]:
    """``layers`` with FSDP's collectives and the sharded optimizer step (module doc)."""
    shards = training.shards
    if shards < 2:
        return layers
    link = group_link(cluster, shards, training.tp)
    out = []
    for layer in layers:
        gather = ring_s(link, shards, layer.num_params * training.param_bytes)
        scatter = ring_s(link, shards, layer.num_params * training.grad_bytes)
        out.append(
            replace(
                layer,
                forward_s=max(layer.forward_s, gather),
                backward_s=max(layer.backward_s, gather + scatter),
                optimizer_s=layer.optimizer_s / shards,
            )
        )
    return tuple(out)
