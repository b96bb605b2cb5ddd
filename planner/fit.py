"""Fitting the cost model to measured steps, on hosts whose workers share CPU cores.

Used twice, the same way: by ``chameleon profile``, on the steps it runs after measuring
the layers (the fit is stored in the cost table and applied when a config loads it), and
by the launcher on every running generation (launcher/calibration.py).

Layer times become the CPU time the workers measured for their passes (a worker that has
a core runs at that speed); each worker's CPU beyond its layers is its overhead (Python,
messages, the store); the host bound is all of it over the cores. A step slower than
that bound waits on messages: on a busy host a message's wake-up costs far more than the
link's latency, so the latency that makes the measured plan's critical path its measured
step is fitted. Where waiting cannot explain the step, the host is taken to keep busy
only the cores it was measured to keep busy.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, replace

from planner.cost import CostModel
from planner.estimate import estimate, worker_compute_s
from planner.plan import Plan
from planner.workload import Job


def waiting(job: Job, extra_s: float) -> Job:
    """``job`` with ``extra_s`` added to every message's latency."""
    if extra_s == 0.0:
        return job
    cluster = job.cluster
    slower = {
        name: replace(link, latency_s=link.latency_s + extra_s)
        for name, link in (("intra_node", cluster.intra_node), ("inter_node", cluster.inter_node))
    }
    return replace(job, cluster=replace(cluster, **slower))


def scaled(job: Job, k: float) -> Job:
    """``job`` with every layer's compute times multiplied by ``k``."""
    if k == 1.0:
        return job
    layers = tuple(
        replace(
            x, forward_s=x.forward_s * k, backward_s=x.backward_s * k, optimizer_s=x.optimizer_s * k
        )
        for x in job.model.layers
    )
    return replace(job, model=replace(job.model, layers=layers))


def fit_wait(job: Job, plan: Plan, measured: float, rounds: int = 30) -> float | None:
    """The extra latency per message that makes ``plan``'s estimate ``measured`` (the
    estimate grows with it), or None where none does: the estimate without any is
    already there, or no amount of waiting reaches it."""
    def predicted(extra: float) -> float:
        return estimate(waiting(job, extra), plan).step_s

    low, high = 0.0, measured
    if predicted(low) >= measured or predicted(high) < measured:
        return None
    for _ in range(rounds):
        mid = (low + high) / 2
        low, high = (mid, high) if predicted(mid) < measured else (low, mid)
    return (low + high) / 2




@dataclass(frozen=True)
class HostFit:
    factor: float  # on every layer's compute time
    cores: float  # the host's cores the workers keep busy
    overhead_s: float  # per worker per step, CPU beyond its layers
    wait_s: float | None  # extra latency per message; None: waiting does not explain it

    def apply(self, job: Job, *, wait_s: float | None = None) -> Job:
        fitted = scaled(job, self.factor)
        cluster = replace(fitted.cluster, host_cores=self.cores, worker_overhead_s=self.overhead_s)
        wait = self.wait_s if self.wait_s is not None else (wait_s or 0.0)
        return waiting(replace(fitted, cluster=cluster), wait)


def fit_host(
    job: Job,
    plan: Plan,
    measured_step_s: float,
    cpu_s: Mapping[int, float],
    compute_cpu_s: Mapping[int, float],
) -> HostFit | None:
    """Fit ``job`` on a shared host to ``plan``'s measured step and its workers' CPU per
    step (all of it, and their passes'): module doc. None without a host to fit."""
    workers = [w for w in plan.workers if w in cpu_s and w in compute_cpu_s]
    compute = worker_compute_s(plan, CostModel(job))
    modelled = sum(compute.get(w, 0.0) for w in workers)
    if not job.cluster.host_cores or not workers or modelled <= 0:
        return None
    factor = sum(compute_cpu_s[w] for w in workers) / modelled
    overhead = max(0.0, statistics.mean(cpu_s[w] - compute_cpu_s[w] for w in workers))
    cores = float(job.cluster.host_cores)
    fitted = replace(
        scaled(job, factor), cluster=replace(job.cluster, worker_overhead_s=overhead)
    )
    wait = fit_wait(fitted, plan, measured_step_s)
    if wait is None:
        hosts = -(-job.cluster.num_nodes // max(1, job.cluster.nodes_per_host))
        busy = sum(cpu_s[w] for w in workers) * len(plan.workers) / len(workers)
        cores = busy / measured_step_s / hosts
    return HostFit(factor=factor, cores=cores, overhead_s=overhead, wait_s=wait)
