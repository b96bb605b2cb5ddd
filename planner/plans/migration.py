"""The migration schedule of a plan change and its estimated time, ours and naive.

Ours: survivors placed by matching, sources balanced, transfers run in rounds from
colouring the conflict graph (a worker takes part in one transfer per round).
Naive (Oobleck's restorer): every missing piece from its first surviving holder, one
transfer at a time. Both are estimated on the same transfers' link costs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from planner.job.cost import CostModel
from planner.job.workload import Job
from planner.plans.colouring import Task, colour_rounds, rounds_time_s
from planner.plans.load import wait_at_s
from planner.plans.matching import Range, Transfer, choose_sources
from planner.plans.plan import Plan


@dataclass(frozen=True)
class Migration:
    transfers: tuple[Transfer, ...]
    rounds: tuple[int, ...]  # round of each transfer
    est_time_s: float
    naive_est_time_s: float
    # Oobleck's restorer on the same plan change, for comparison: one transfer per round.
    naive_transfers: tuple[Transfer, ...] = ()
    # A sharded job's replica groups the transfers move rows from, when they re-shard
    # groups (planner.plans.rows; a heal's transfers send whole states: empty).
    reshard_from: tuple[tuple[int, ...], ...] = ()

    @property
    def num_bytes(self) -> int:
        return sum(t.num_bytes for t in self.transfers)

    @property
    def num_rounds(self) -> int:
        return max(self.rounds, default=-1) + 1

    def naive(self) -> Migration:
        """This migration carried out under the naive schedule."""
        return Migration(
            transfers=self.naive_transfers,
            rounds=tuple(range(len(self.naive_transfers))),
            est_time_s=self.naive_est_time_s,
            naive_est_time_s=self.naive_est_time_s,
            naive_transfers=self.naive_transfers,
            reshard_from=self.reshard_from,
        )


NO_MIGRATION = Migration(transfers=(), rounds=(), est_time_s=0.0, naive_est_time_s=0.0)


def holdings_of(plan: Plan, alive: set[int] | frozenset[int] | None = None) -> dict[int, Range]:
    return {
        s.worker: (s.first_layer, s.end_layer)
        for s in plan.stages
        if alive is None or s.worker in alive
    }


def transfer_s(costs: CostModel, t: Transfer, *, runnable: int = 2) -> float:
    """One transfer as the runtime makes it: the sender exports and packs its layers,
    then two messages back to back (its sizes, then the packed buffer), which the
    receiver unpacks: the packing and unpacking, one latency, the bytes, the CPU of both
    messages, and the hand-off the profile measured beyond them. On a shared host the
    link's latency holds a fitted wake-up wait for the job's load (planner.plans.load), and
    the packing shares the cores: a migration wakes only its ``runnable`` senders and
    receivers, so the wait and the share are theirs."""
    job = costs.job
    c = job.cluster
    link = job.link(t.src, t.dst)
    latency = link.latency_s - c.message_wait_s + wait_at_s(job, runnable)
    params = job.model.total("num_params", t.first_layer, t.end_layer)
    cpu = (c.pack_cpu_s_per_param + c.unpack_cpu_s_per_param) * params
    if c.host_cores:
        cpu *= max(1.0, runnable / c.host_cores)
    return (
        cpu
        + latency
        + t.num_bytes / link.bandwidth_bytes_per_s
        + 2 * c.message_cpu_s
        + c.transfer_wait_s
    )


def ring(job: Job, workers: int, layer: int) -> list[Transfer]:
    """``layer`` sent round the ring of ``workers``, w to w + 1 (the profile's chain)."""
    size = CostModel(job).moved_bytes(layer, layer + 1)
    return [Transfer(w, (w + 1) % workers, layer, layer + 1, size) for w in range(workers)]


def fit_transfer_wait(job: Job, chain: Sequence[Transfer], wall_s: float) -> float:
    """The hand-off per transfer that makes ``chain``, one transfer at a time, take the
    measured ``wall_s``: on the test bed a receiver blocked in its receive takes a
    millisecond or two to run again once the bytes are there, beyond the link's
    latency and the CPU the transfer costs."""
    if not chain:
        return 0.0
    costs = CostModel(replace(job, cluster=replace(job.cluster, transfer_wait_s=0.0)))
    modelled = sum(transfer_s(costs, t) for t in chain)
    return max(0.0, (wall_s - modelled) / len(chain))


def schedule_s(costs: CostModel, transfers: Sequence[Transfer], rounds: Sequence[int]) -> float:
    """Round after round, each as long as its slowest transfer, with every transfer of
    the round (two processes each) running at once; then the layers installed."""
    per_round = Counter(rounds)
    tasks = [
        Task((t.src, t.dst), transfer_s(costs, t, runnable=2 * per_round[r]))
        for t, r in zip(transfers, rounds, strict=True)
    ]
    return rounds_time_s(tasks, rounds) + install_s(costs, transfers)


def install_s(costs: CostModel, transfers: Sequence[Transfer]) -> float:
    """The CPU a migration spends on its layers after the transfers (unpacking, building
    each received layer and loading its state: profiled per parameter), the
    same under any schedule: each receiver installs what it got, at once with the others,
    so the busiest receiver's share, or on hosts whose workers share cores, all of it
    over the cores if that is longer."""
    job = costs.job
    # The packing and unpacking are paid within the transfer (transfer_s).
    c = job.cluster
    per_param = max(0.0, c.move_cpu_s_per_param - c.pack_cpu_s_per_param - c.unpack_cpu_s_per_param)
    if not per_param:
        return 0.0
    work: dict[int, float] = {}
    for t in transfers:
        params = job.model.total("num_params", t.first_layer, t.end_layer)
        work[t.dst] = work.get(t.dst, 0.0) + params * per_param
    busiest = max(work.values(), default=0.0)
    cores = job.cluster.host_cores
    return max(busiest, sum(work.values()) / cores) if cores else busiest


def plan_migration(costs: CostModel, *, holdings: Mapping[int, Range], target: Plan) -> Migration:
    """Transfers that give every worker of ``target`` the layers it lacks, scheduled. The
    members' agreement that every transfer arrived is the protocol's, charged with it
    (planner.estimator.transition.protocol)."""
    targets = {s.worker: (s.first_layer, s.end_layer) for s in target.stages}
    transfers = choose_sources(costs, holdings=holdings, targets=targets)
    if not transfers:
        return NO_MIGRATION
    tasks = [Task((t.src, t.dst), transfer_s(costs, t)) for t in transfers]
    rounds = colour_rounds(tasks)
    est = schedule_s(costs, transfers, rounds)
    # Transfers side by side win where each has its own devices and links; on a host
    # whose cores its workers share they contend for the CPU that packs and copies
    # them (measured on the test bed: 12 transfers in 5 rounds 47 ms, one at a time 24),
    # so where the model says so, one at a time.
    one_by_one = tuple(range(len(transfers)))
    sequential = schedule_s(costs, transfers, one_by_one)
    if sequential < est:
        rounds, est = list(one_by_one), sequential
    naive = choose_sources(costs, holdings=holdings, targets=targets, balanced=False)
    return Migration(
        transfers=tuple(transfers),
        rounds=tuple(rounds),
        est_time_s=est,
        naive_est_time_s=sum(transfer_s(costs, t) for t in naive) + install_s(costs, naive),
        naive_transfers=tuple(naive),
    )
