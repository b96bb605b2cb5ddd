"""Synthetic jobs for planner tests: uniform ones with round numbers, and seeded random
ones (heterogeneous layers, tight memory, several nodes) for fast-vs-reference checks."""

from __future__ import annotations

import random

from planner.job.cost import CostModel
from planner.job.workload import Cluster, Job, Layer, Link, Model, RankOrder, Training
from planner.plans.layout import initial_plan

FREE = Link(bandwidth_bytes_per_s=1e30, latency_s=0.0)


def uniform_job(
    *,
    dp: int,
    pp: int,
    num_layers: int = 8,
    micro_batches: int | None = None,
    forward_s: float = 1.0,
    backward_s: float = 2.0,
    per_node: int | None = None,
    memory_bytes: int = 10**12,
    intra: Link = FREE,
    inter: Link = FREE,
    spare_nodes: int = 0,
    rank_order: RankOrder = RankOrder.TP_PP_DP,
    commit_s: float = 0.0,
    stash_bytes: int = 100,
) -> Job:
    """Identical layers, free communication by default: step times are round numbers."""
    num_workers = dp * pp
    per_node = per_node or num_workers
    cluster = Cluster(
        name="synthetic",
        num_nodes=num_workers // per_node,
        devices_per_node=per_node,
        device_memory_bytes=memory_bytes,
        intra_node=intra,
        inter_node=inter,
        spare_nodes=spare_nodes,
        store_round_trip_s=commit_s / 2,
        restart_s=100.0,
        pg_init_base_s=1.0,
        pg_init_per_worker_s=0.0,
    )
    layers = tuple(
        Layer(
            f"l{i}",
            num_params=1000,
            forward_s=forward_s,
            backward_s=backward_s,
            optimizer_s=0.0,
            activation_bytes=100,
            stash_bytes=stash_bytes,
        )
        for i in range(num_layers)
    )
    training = Training(
        global_batch_size=micro_batches or 2 * dp * pp,
        micro_batch_size=1,
        param_bytes=2,
        grad_bytes=2,
        optimizer_bytes=12,
        dp=dp,
        pp=pp,
        rank_order=rank_order,
        mtbf_s=3600.0,
        checkpoint_interval_s=600.0,
    )
    return Job(cluster, Model("uniform", layers), training)


def random_job(rng: random.Random) -> Job:
    """A small job with uneven layers, slow inter-node links and memory that is tight for
    some seeds: the cases where plan search has real choices to make."""
    pp = rng.randint(1, 4)
    dp = rng.randint(1, 4)
    n = dp * pp
    per_node = rng.choice([d for d in (1, 2, 3, 4, 6, 8, 12, 16) if n % d == 0])
    num_layers = rng.randint(max(pp, 2), 10)
    layers = []
    for i in range(num_layers):
        f = rng.uniform(0.5, 2.0)
        layers.append(
            Layer(
                f"l{i}",
                num_params=rng.randint(1, 10) * 1000,
                forward_s=f,
                backward_s=f * rng.uniform(1.5, 2.5),
                optimizer_s=rng.uniform(0, 0.05),
                activation_bytes=rng.randint(1, 50) * 1000,
                stash_bytes=rng.randint(1, 50) * 1000,
            )
        )
    training = Training(
        global_batch_size=dp * rng.randint(1, 8),
        micro_batch_size=1,
        param_bytes=2,
        grad_bytes=2,
        optimizer_bytes=12,
        dp=dp,
        pp=pp,
    )
    model = Model("random", tuple(layers))

    def cluster(memory: int) -> Cluster:
        return Cluster(
            "random",
            num_nodes=n // per_node,
            devices_per_node=per_node,
            device_memory_bytes=memory,
            intra_node=Link(1e7, 1e-3),
            inter_node=Link(1e6, 5e-3),
            store_round_trip_s=1e-3,
        )

    # Size memory to what the initial layout needs, times a slack from tight to roomy.
    roomy = Job(cluster(10**15), model, training)
    plan = initial_plan(roomy)
    costs = CostModel(roomy)
    bounds = [plan.stage_of[w].first_layer for w in plan.pipelines[0]] + [num_layers]
    need = max(
        costs.memory_bytes(a, b, pp - i, costs.exchange_bytes(dp, a, b))
        for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
    )
    return Job(cluster(int(need * rng.choice([1.0, 1.1, 1.5, 3.0]))), model, training)
