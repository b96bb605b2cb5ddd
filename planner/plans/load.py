"""How a shared host's load changes what a step costs, and the job at another load.

On a host whose workers share CPU cores, the CPU a pass costs grows with the processes
sharing the cores (caches, context switches), and a message's wake-up waits for a core
once more processes are runnable than there are cores. A job fitted at one load
(``Cluster.fitted_workers`` per host: planner.estimator.fit) is moved to a plan's load here:

- c (``Cluster.contention``) comes from the profile's two measurements of the same
  passes, one process alone and n0 at once: linear between them;
- layer times scale by (1 + c (n - 1)) / (1 + c (n0 - 1)) [see above]; the runtime's own
  CPU (per worker, per pass, per message) does not: measured on this test bed, 4 workers
  spent as much of it per step as 8 did, or more, while their passes ran 20% faster;
- the fitted wake-up wait per message scales by sqrt((n - cores) / (n0 - cores)): a
  woken worker waits for a core only while more processes than cores share the host,
  and less than in proportion to the queue. Measured on the test bed, with the step run
  under processor sharing (planner.estimator.sharing), 7 layouts of 2 to 8 workers against one
  profile of 8: the square root puts every one within 9% of its measured step; in
  proportion to the queue put a 4-stage pipeline on 4 workers 22% low, the same wait at
  every load 23% high. (No model of the scheduler is claimed: this is the measured
  shape between n = cores, where nothing waits, and the n0 the wait was fitted at.)

Nothing changes where the job was not fitted (``fitted_workers`` 0) or on devices.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

from planner.job.workload import Job
from planner.plans.plan import Plan


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


def busiest_host(job: Job, plan: Plan | Iterable[int]) -> int:
    """Workers of ``plan`` (or of a set of workers) on its busiest host."""
    per_host: dict[int, int] = {}
    for w in plan.workers if isinstance(plan, Plan) else plan:
        host = job.host_of(w)
        per_host[host] = per_host.get(host, 0) + 1
    return max(per_host.values(), default=0)


def wait_at_s(job: Job, runnable: int) -> float:
    """The fitted wake-up wait of a message while ``runnable`` processes share its host's
    cores (module doc); unchanged where nothing was fitted."""
    c = job.cluster
    if not c.host_cores or not c.fitted_workers:
        return c.message_wait_s
    queued = c.fitted_workers - c.host_cores
    if queued <= 0:  # fitted where every worker had a core: no queue to scale by
        return c.message_wait_s * runnable / c.fitted_workers
    return c.message_wait_s * math.sqrt(max(0.0, runnable - c.host_cores) / queued)


def wake_s(job: Job, active: Iterable[int]) -> float:
    """The fitted wake-up wait of a worker blocked on a message, while the ``active``
    workers run."""
    c = job.cluster
    if not c.host_cores or not c.fitted_workers:  # no host shared: nothing to count
        return c.message_wait_s
    return wait_at_s(job, busiest_host(job, active))


def at_load(job: Job, plan: Plan) -> tuple[Job, int | None]:
    """``job`` at ``plan``'s load, and that load (None: unchanged)."""
    c = job.cluster
    n0 = c.fitted_workers
    if not c.host_cores or not n0:
        return job, None
    n = busiest_host(job, plan)
    if n == n0 or n == 0:
        return job, None
    k = (1 + c.contention * (n - 1)) / (1 + c.contention * (n0 - 1))
    return waiting(scaled(job, k), wait_at_s(job, n) - c.message_wait_s), n
