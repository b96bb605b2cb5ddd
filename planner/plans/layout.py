"""The job's current parallel layout (dp x pp x tp) as a plan, and failures mapped to workers.

Workers are numbered by ``worker = rank // tp`` (tp is always innermost, inside a node).
``rank_order`` decides how the remaining (dp, pp) grid is laid over workers: with
``tp-pp-dp`` pipeline d is workers d*pp .. d*pp+pp-1; with ``tp-dp-pp`` (Megatron) stage s
of every pipeline sits on consecutive workers s*dp .. s*dp+dp-1.
"""

from __future__ import annotations

from collections.abc import Iterable

from planner.job.cost import CostModel
from planner.job.errors import LayoutError
from planner.job.workload import Job, RankOrder
from planner.plans.partition import Partitioner
from planner.plans.plan import Plan, pipelines_plan, split_evenly


def pipeline_workers(job: Job) -> list[list[int]]:
    """Workers of each of the dp pipelines, stage by stage."""
    dp, pp = job.training.dp, job.training.pp
    if job.training.rank_order is RankOrder.TP_PP_DP:
        return [[d * pp + s for s in range(pp)] for d in range(dp)]
    return [[s * dp + d for s in range(pp)] for d in range(dp)]


def initial_plan(job: Job, partitioner: Partitioner | None = None) -> Plan:
    """The failure-free plan: dp identical pipelines, layers split for the fastest stage
    under memory, micro-batches split evenly across pipelines."""
    t = job.training
    if t.dp * t.pp * t.tp != job.cluster.num_devices:
        raise LayoutError(
            f"layout dp*pp*tp = {t.dp}*{t.pp}*{t.tp} = {t.dp * t.pp * t.tp} does not match "
            f"the cluster's {job.cluster.num_devices} devices "
            f"({job.cluster.num_nodes} nodes x {job.cluster.devices_per_node})"
        )
    if job.cluster.devices_per_node % t.tp:
        raise LayoutError(
            f"tp = {t.tp} does not divide the {job.cluster.devices_per_node} devices of a node"
        )
    if t.pp > job.model.num_layers:
        raise LayoutError(f"pp = {t.pp} is more than the model's {job.model.num_layers} layers")
    if t.global_batch_size % t.micro_batch_size:
        raise LayoutError(
            f"global batch {t.global_batch_size} is not a multiple of micro-batch {t.micro_batch_size}"
        )
    partitioner = partitioner or Partitioner(CostModel(job), replicated=t.dp > 1)
    split = partitioner.fastest(t.pp)
    if split is None:
        raise LayoutError(
            f"the model does not fit: no split of {job.model.num_layers} layers into {t.pp} "
            f"stages fits in {job.worker_memory_bytes / 2**30:.1f} GiB per worker"
        )
    return pipelines_plan(
        num_layers=job.model.num_layers,
        num_micro_batches=t.num_micro_batches,
        pipelines=pipeline_workers(job),
        boundaries=[split.boundaries] * t.dp,
        micro_batch_counts=split_evenly(t.num_micro_batches, [1.0] * t.dp),
    )


def failed_workers(
    job: Job, *, ranks: Iterable[int] = (), nodes: Iterable[int] = ()
) -> tuple[int, ...]:
    """Workers lost when the given device ranks and whole nodes fail."""
    lost: set[int] = set()
    for rank in ranks:
        if not 0 <= rank < job.cluster.num_devices:
            raise LayoutError(
                f"rank {rank} is not in the cluster (0..{job.cluster.num_devices - 1})"
            )
        lost.add(job.worker_of(rank))
    for node in nodes:
        if not 0 <= node < job.cluster.num_nodes:
            raise LayoutError(f"node {node} is not in the cluster (0..{job.cluster.num_nodes - 1})")
        lost.update(job.workers_on_node(node))
    return tuple(sorted(lost))
