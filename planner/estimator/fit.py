"""Fitting the cost model to measured steps, on hosts whose workers share CPU cores.

Used twice, the same way: by ``chameleon profile``, on the steps it runs after measuring
the layers (the fit is stored in the cost table and applied when a config loads it), and
by the launcher on every running generation (launcher/calibration.py).

Layer times become the CPU time the workers measured for their passes (a worker that has
a core runs at that speed); the CPU the runtime's loop spends around each pass (measured
apart: receiving, sending, stashing, the meter) is charged per pass, whatever the layers;
what the profile measured on its own (CPU per byte messaged, the tail's CPU per parameter
held) is charged as measured; each worker's CPU beyond all that is a base plus a share
per message (other threads, the store), fitted. The step is then the program run with
the host's cores shared (planner.estimator.sharing); on a busy host a message's wake-up costs far
more than the link's latency, so the latency that makes that step the measured one is
fitted. A single-stage plan, which has few messages, fits the cores it keeps busy
instead where the step is longer than its CPU explains.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, replace

from planner.estimator.estimate import (
    estimate,
    message_ops,
    micro_batches_of,
    runtime_cpu_s,
    worker_compute_s,
)
from planner.job.cost import CostModel
from planner.job.workload import Job
from planner.plans.load import busiest_host, scaled, waiting
from planner.plans.plan import Plan

__all__ = ["HostFit", "RunFit", "fit_host", "fit_run", "fit_wait", "scaled", "waiting"]

CALIBRATION_ROUNDS = 4


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
    overhead_s: float  # per worker per step, CPU beyond its layers and its messages
    message_cpu_s: float  # per point-to-point send or receive
    wait_s: float | None  # extra latency per message; None: waiting does not explain it
    workers: int = 0  # per host, when fitted
    contention: float = 0.0  # planner.plans.load
    pass_cpu_s: float = 0.0  # per forward or backward pass, beyond its layers

    def apply(self, job: Job, *, wait_s: float | None = None) -> Job:
        """``job`` fitted; planner.plans.load moves it to other loads when ``contention`` was
        measured."""
        fitted = scaled(job, self.factor)
        wait = self.wait_s if self.wait_s is not None else (wait_s or 0.0)
        cluster = replace(
            fitted.cluster,
            host_cores=self.cores,
            worker_overhead_s=self.overhead_s,
            message_cpu_s=self.message_cpu_s,
            pass_cpu_s=self.pass_cpu_s,
            fitted_workers=self.workers if self.contention or wait else 0,
            contention=self.contention,
            message_wait_s=wait,
        )
        return waiting(replace(fitted, cluster=cluster), wait)


def fit_host(
    job: Job,
    plan: Plan,
    measured_step_s: float,
    cpu_s: Mapping[int, float],
    compute_cpu_s: Mapping[int, float],
    *,
    pass_cpu_s: Mapping[int, float] | None = None,
    alone_passes_cpu_s: float | None = None,
) -> HostFit | None:
    """Fit ``job`` on a shared host to ``plan``'s measured step and its workers' CPU per
    step (all of it, and their passes'): module doc. None without a host to fit. With
    ``alone_passes_cpu_s`` (one step's passes by one process alone), also how a pass's
    CPU grows with the processes sharing the cores (planner.plans.load). With ``pass_cpu_s``
    (per worker, the pass loop's CPU beyond the layers), the CPU of a pass beyond them."""
    # fitted here, afresh
    job = replace(job, cluster=replace(job.cluster, pass_cpu_s=0.0))
    workers = [w for w in plan.workers if w in cpu_s and w in compute_cpu_s]
    compute = worker_compute_s(plan, CostModel(job))
    modelled = sum(compute.get(w, 0.0) for w in workers)
    if not job.cluster.host_cores or not workers or modelled <= 0:
        return None
    factor = sum(compute_cpu_s[w] for w in workers) / modelled
    passes = {w: 2 * m for w, m in micro_batches_of(plan).items()}  # forward and backward
    per_pass = 0.0
    if pass_cpu_s and all(w in pass_cpu_s for w in workers):
        total = sum(passes.get(w, 0) for w in workers)
        per_pass = sum(pass_cpu_s[w] for w in workers) / total if total else 0.0
    # What the profile measured apart (CPU per byte messaged, the tail's per parameter)
    # is known; the base and the CPU per message are fitted to the rest.
    known = runtime_cpu_s(
        replace(job, cluster=replace(job.cluster, worker_overhead_s=0.0, message_cpu_s=0.0)),
        plan, CostModel(job),
    )  # fmt: skip
    beyond = {w: compute_cpu_s[w] + per_pass * passes.get(w, 0) + known[w] for w in workers}
    overhead, per_message = _overhead(plan, job, workers, cpu_s, beyond)
    cores = float(job.cluster.host_cores)
    fitted = replace(
        scaled(job, factor),
        cluster=replace(
            job.cluster,
            worker_overhead_s=overhead,
            message_cpu_s=per_message,
            pass_cpu_s=per_pass,
        ),
    )
    # The step program under processor sharing (planner.estimator.sharing) is fitted to the
    # measured step by a wake-up wait per message: on a busy host a message's wake-up
    # costs far more than the link's latency. Only a pipeline's messages tell it: a
    # single-stage plan has a few exchanges, and a wait fitted to them would carry
    # whatever else slows the host; there the cores it keeps busy are fitted instead.
    if any(len(r.hops) > 1 for r in plan.routes):
        wait = fit_wait(fitted, plan, measured_step_s)
    else:
        wait = None
        if estimate(fitted, plan).step_s < measured_step_s:
            hosts = -(-job.cluster.num_nodes // max(1, job.cluster.nodes_per_host))
            busy = sum(cpu_s[w] for w in workers) * len(plan.workers) / len(workers)
            cores = min(cores, busy / measured_step_s / hosts)
    n0 = busiest_host(job, plan)
    contention = 0.0
    if alone_passes_cpu_s and n0 > 1:
        costs = CostModel(job)
        passes = job.training.num_micro_batches * (
            costs.forward_s(0, job.model.num_layers) + costs.backward_s(0, job.model.num_layers)
        )
        alone = alone_passes_cpu_s / passes if passes > 0 else factor
        contention = max(0.0, (factor / alone - 1) / (n0 - 1)) if alone > 0 else 0.0
    return HostFit(
        factor=factor, cores=cores, overhead_s=overhead, message_cpu_s=per_message,
        pass_cpu_s=per_pass, wait_s=wait, workers=n0, contention=contention,
    )  # fmt: skip


def _overhead(
    plan: Plan,
    job: Job,
    workers: list[int],
    cpu_s: Mapping[int, float],
    compute_cpu_s: Mapping[int, float],
) -> tuple[float, float]:
    """(base, per message) CPU beyond ``compute_cpu_s``, by least squares over the workers: a
    pipeline's middle stages send and receive twice what its ends do, which separates
    the two. One message count for all (data parallel only): all of it is base."""
    ops = message_ops(plan, job.model.layer_params, job.cluster.allreduce)
    xs = [float(ops.get(w, 0)) for w in workers]
    ys = [max(0.0, cpu_s[w] - compute_cpu_s[w]) for w in workers]
    mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return mean_y, 0.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
    slope = max(0.0, slope)
    base = max(0.0, mean_y - slope * mean_x)
    return base, slope


@dataclass(frozen=True)
class RunFit:
    """A running job's model fitted to one generation's measured step: by the launcher on
    every generation (launcher/calibration.py), and by ``chameleon simulate --calibration``
    on the measurements a run logged, so that a replay runs on the run's costs.

    ``host``: (cores, overhead per worker, message wait, CPU per message, CPU per pass)
    where the workers share a host's cores; None where each has a device (one factor on
    every layer's time, iterated to the fixed point: communication does not scale)."""

    factor: float
    host: tuple[float, float, float, float, float] | None = None

    def apply(self, job: Job) -> Job:
        if self.host is None:
            # Fitted as if each worker had a device (``fit_run``'s fallback where the
            # workers report no CPU time): applied the same way, or a host bound the fit
            # never saw keeps the estimate of the running plan above its measured step.
            return scaled(replace(job, cluster=replace(job.cluster, host_cores=None)), self.factor)
        fitted = scaled(job, self.factor)
        cores, overhead, wait, per_message, per_pass = self.host
        cluster = replace(
            fitted.cluster,
            host_cores=cores,
            worker_overhead_s=overhead,
            message_cpu_s=per_message,
            pass_cpu_s=per_pass,
        )
        return waiting(replace(fitted, cluster=cluster), wait)


def fit_run(
    job: Job,
    plan: Plan,
    measured_step_s: float,
    cpu_s: Mapping[int, float],
    compute_cpu_s: Mapping[int, float],
    pass_cpu_s: Mapping[int, float],
    *,
    wait_s: float = 0.0,
) -> tuple[RunFit, HostFit | None]:
    """``job`` fitted to ``plan``'s measured step (and the fit on a shared host, if any).
    ``wait_s``: the message wait an earlier fit found, kept where this plan's messages
    cannot tell it (a data parallel step the host bounds says nothing of waiting)."""
    fit = fit_host(job, plan, measured_step_s, cpu_s, compute_cpu_s, pass_cpu_s=pass_cpu_s)
    if fit is not None:
        wait = fit.wait_s if fit.wait_s is not None else wait_s
        host = (fit.cores, fit.overhead_s, wait, fit.message_cpu_s, fit.pass_cpu_s)
        return RunFit(fit.factor, host), fit
    alone = replace(job, cluster=replace(job.cluster, host_cores=None))
    k = 1.0
    for _ in range(CALIBRATION_ROUNDS):
        predicted = estimate(scaled(alone, k), plan).step_s
        if predicted <= 0:
            break
        k *= measured_step_s / predicted
    return RunFit(k), None
