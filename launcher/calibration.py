"""The planner's view of a running chameleon_runtime job: the costs its workers measured at
start (``JobDescription``), on the launch's topology, fitted to the steps they measure
while training, so that the planner's estimate of the running plan is its measured step.

Workers with a device each: one factor on every layer's time, so that the critical path
is the measured step (communication and the commit do not scale with it: iterate to the
fixed point).

Workers sharing a host's cores (CPU), from their own CPU accounting: layer times become CPU
times (a worker that has a core runs at that speed), each worker's CPU beyond its layers
is its overhead, and the host bound is all of it over the host's cores. A step slower
than that bound waits on messages: on a busy host a message's wake-up costs far more than
the link's latency, so the latency that makes the running plan's critical path the
measured step is fitted (a pipeline with many hops pays it often, data parallelism
rarely). Where waiting cannot explain the step (no messages) or the bound already exceeds
it (the host is busier than its workers: the launcher, a replacement starting), the host
is taken to keep busy only the cores it was measured to keep busy.

The model is fitted once per generation, after its steps settle; the planner's search is
warmed up at the same time, so a failure pays for neither.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from chameleon_runtime.protocol.messages import WorkerStatus
from planner.estimator.fit import RunFit, fit_run

# The model is fitted to each generation once its steps settle (a generation's first
# steps pay for warm-up): chameleon_runtime.pace leaves 2 out and averages over 8.
SETTLED_AFTER_STEPS = 6
DEFAULT_RESTART_S = 10.0  # before a start-up was measured (a --config gives its own)
# A layout this much faster than the launched one is worth a note in the run summary.
LAYOUT_HINT_SPEEDUP = 1.1


def statistics_of(statuses: Mapping[int, WorkerStatus], worker: int) -> WorkerStatus | None:
    """A worker's status if it has measured its CPU per step (and its passes')."""
    s = statuses.get(worker)
    return s if s is not None and s.cpu_s and s.compute_cpu_s else None


@dataclass
class JobModel:
    emit: Callable[..., object]
    rate: Any  # planner.job.failures.FailureRate: D's prior, updated by the failures seen
    num_nodes: int
    workers_per_node: int
    nodes_per_host: int = 1
    # The most workers on one machine (launcher/rendezvous.machine_id): agents in network
    # namespaces or containers of one machine share its cores (0: as nodes_per_host says).
    workers_per_machine: int = 0
    restart_s: float | None = None  # a checkpoint restart: measured start-up (None: not yet)
    cluster: Any = None  # planner.job.workload.Cluster from --config
    description: Any = (
        None  # chameleon_runtime.protocol.wire.JobDescription, once the workers published it
    )
    factor: float | None = None
    # cores, overhead per worker, message wait, CPU per message, CPU per pass (planner.estimator.fit)
    host: tuple[float, float, float, float, float] | None = None
    wait_s: float = 0.0  # the last message wait a fit could determine
    measured_s: float | None = None
    fitted_generation: int = -1
    # Measured over modelled in-place transitions (planner.job.workload.Cluster), and what the
    # newest plan chosen was predicted to cost beside its decision: (generation,
    # predicted s, the decision's own s).
    transition_factor: float = 1.0
    _expected: tuple[int, float, float] | None = None
    _search: Any = None
    _exposed: tuple[float, int] | None = None  # since when, on how many devices
    # Workers found slower than their peers (launcher/stragglers.py), as Job.slow: a
    # failure's or a growth's plan is made at the speeds measured. Written by the
    # coordinator's thread as a whole tuple; the planner reads the job built from it.
    slow: tuple[tuple[int, float], ...] = ()

    # -- D, the mean time to the next failure (planner.job.failures) ---------------------------

    def expose(self, now: float, devices: int, failures: int = 0, node_failures: int = 0) -> None:
        """``failures`` ended the time since the last call (``node_failures`` of them took
        a whole node); from now ``devices`` run."""
        since, running = self._exposed if self._exposed is not None else (now, 0)
        self.rate = self.rate.observe(
            devices=running, seconds=now - since, failures=failures, node_failures=node_failures
        )
        self._exposed = (now, devices)

    def mtbf(self, devices: int) -> Any:
        """D (a planner.job.failures.Mtbf) for ``devices`` devices, as of now."""
        return self.rate.mtbf(devices)

    def measured_step_s(
        self, statuses: Mapping[int, WorkerStatus], generation: int
    ) -> float | None:
        """The median step time the generation's workers report over their recent steps."""
        times = [
            s.mean_step_s or s.step_s
            for s in statuses.values()
            if s.step_s and s.generation == generation and s.phase == "train"
        ]
        return statistics.median(times) if times else None

    def job(self, current: Any, statuses: Mapping[int, WorkerStatus], generation: int) -> Any:
        """The described job, fitted (once per ``refit``) to the measured steps."""
        measured = self.measured_step_s(statuses, generation)
        if measured is not None:
            self.measured_s = measured
        job = self.description.to_job(
            num_nodes=self.num_nodes,
            workers_per_node=self.workers_per_node,
            mtbf_s=None,
            step_s=self.measured_s or 1.0,
            restart_s=self.restart_s if self.restart_s is not None else DEFAULT_RESTART_S,
            cluster=self.cluster,
            nodes_per_host=self.nodes_per_host,
        )
        job = replace(
            job,
            cluster=replace(job.cluster, transition_factor=self.transition_factor),
            slow=self.slow,
        )
        if self.factor is None:
            if measured is None:
                return job
            self._fit(job, current, statuses, generation, measured)
        assert self.factor is not None
        return RunFit(self.factor, self.host).apply(job)

    def expect_transition(self, generation: int, *, predicted_s: float, decision_s: float) -> None:
        """The plan of ``generation`` was chosen for an in-place transition of
        ``predicted_s`` (migration, groups, protocol: already scaled by the factor) after a
        decision of ``decision_s``."""
        self._expected = (generation, predicted_s, decision_s)  # only the newest counts

    def observe_transition(self, generation: int, measured_s: float) -> float:
        """The recovery into ``generation`` took ``measured_s`` (collect, plan, confirm):
        move the factor halfway (geometrically) to what it measured beside the decision,
        as steps calibrate the step model. One noisy recovery moves it by at most 2x."""
        expected, self._expected = self._expected, None
        if expected is None or expected[0] != generation or expected[1] <= 0:
            return self.transition_factor
        _, predicted, decision = expected
        ratio = min(4.0, max(0.25, max(0.0, measured_s - decision) / predicted))
        self.transition_factor = min(4.0, max(0.25, self.transition_factor * math.sqrt(ratio)))
        return self.transition_factor

    # -- what a successor leader starts from (launcher/coordinator.py, Coordinator.snapshot) -------------------------

    def snapshot(self) -> dict[str, Any]:
        """What this model has learned from the run, as JSON: its fit, the transitions'
        factor, the measured restart, and what it knows of failures."""
        r = self.rate
        return {
            "factor": self.factor,
            "host": list(self.host) if self.host is not None else None,
            "wait_s": self.wait_s,
            "measured_s": self.measured_s,
            "fitted_generation": self.fitted_generation,
            "transition_factor": self.transition_factor,
            "restart_s": self.restart_s,
            "failures": r.failures,
            "node_failures": r.node_failures,
            "exposure_device_s": r.exposure_device_s,
        }

    def restore(self, snap: dict[str, Any]) -> None:
        """Start from a predecessor's ``snapshot``: a new leader's first plan is made on
        the costs the old one had learned, not on the uncalibrated description."""
        host = snap.get("host")
        self.factor = snap.get("factor")
        self.host = tuple(host) if host is not None else None  # type: ignore[assignment]
        self.wait_s = float(snap.get("wait_s") or 0.0)
        self.measured_s = snap.get("measured_s")
        self.fitted_generation = int(snap.get("fitted_generation", -1))
        self.transition_factor = float(snap.get("transition_factor") or 1.0)
        if snap.get("restart_s") is not None:
            self.restart_s = float(snap["restart_s"])
        self.rate = replace(
            self.rate,
            failures=int(snap.get("failures", 0)),
            node_failures=int(snap.get("node_failures", 0)),
            exposure_device_s=float(snap.get("exposure_device_s", 0.0)),
        )
        self.emit(
            "calibration_restored",
            factor=self.factor,
            transition_factor=self.transition_factor,
            fitted_generation=self.fitted_generation,
            failures=self.rate.failures,
        )

    def refit(self) -> None:
        """Fit again at the next ``job`` (a new generation's steps have settled)."""
        self.factor, self.host = None, None

    def settle(
        self, current: Any, statuses: Mapping[int, WorkerStatus], generation: int, steps: int
    ) -> None:
        """Once a generation has run ``SETTLED_AFTER_STEPS`` steps: fit the model to them
        and warm the search up for the next failure; on generation 0, point out a clearly
        faster layout."""
        if generation == self.fitted_generation or steps < SETTLED_AFTER_STEPS:
            return
        self.fitted_generation = generation
        self.refit()
        job = self.job(current, statuses, generation)
        self.search(job)
        if generation == 0 and self.description.layout == "given":
            # (a layout the planner launched is judged again instead: Coordinator's
            # _rebalance_launch)
            self.hint_layout(job, current)

    def _fit(
        self,
        job: Any,
        current: Any,
        statuses: Mapping[int, WorkerStatus],
        generation: int,
        measured: float,
    ) -> None:
        from planner.estimator.estimate import estimate

        beats = {
            w: s
            for w in current.workers
            if (s := statistics_of(statuses, w)) and s.generation == generation
        }
        cpu = {w: s.mean_cpu_s or s.cpu_s for w, s in beats.items()}
        compute = {w: s.mean_compute_cpu_s or s.compute_cpu_s for w, s in beats.items()}
        passes = {w: s.mean_pass_cpu_s or s.pass_cpu_s or 0.0 for w, s in beats.items()}
        # Keep what an earlier plan with more messages showed of waiting: a data parallel
        # step that the host bounds says nothing about it.
        fit, _ = fit_run(job, current, measured, cpu, compute, passes, wait_s=self.wait_s)
        self.factor, self.host = fit.factor, fit.host
        if fit.host is not None:
            self.wait_s = fit.host[2]
        host = self.host
        self.emit(
            "calibrated",
            generation=generation,
            measured_step_s=measured,
            estimated_step_s=estimate(job, current).step_s,
            factor=self.factor,
            host_cores=host[0] if host else None,
            worker_overhead_s=host[1] if host else None,
            message_wait_s=host[2] if host else None,
            message_cpu_s=host[3] if host else None,
            pass_cpu_s=host[4] if host else None,
            # What the fit was made from, per worker: CPU per step, all of it and its passes'.
            cpu_s={w: round(x, 6) for w, x in cpu.items()},
            compute_cpu_s={w: round(x, 6) for w, x in compute.items()},
            pass_loop_cpu_s={w: round(x, 6) for w, x in passes.items()},
        )

    def pass_s(self) -> float:
        """The runtime's own CPU per pass beyond its layers, as fitted on a host whose
        workers share cores (0 before a fit, and on devices)."""
        return self.host[4] if self.host is not None else 0.0

    def search(self, job: Any) -> Any:
        from planner.search.layouts import Search

        if self._search is None or self._search.job != job:
            self._search = Search(job).warm_up()
        return self._search

    def hint_layout(self, job: Any, current: Any) -> None:
        """Say so when the planner knows a clearly faster layout on the same workers than
        the one the script asked for: after a failure it may pick that layout, and the run
        then goes faster than before, which would otherwise look like a bug. (Changing the
        layout of a healthy job unasked is left to the user.)"""
        from planner.estimator.estimate import estimate

        launched = estimate(job, current).step_s
        best = self.search(job).propose(current, current.workers)
        if best and best[0].estimate.step_s < launched / LAYOUT_HINT_SPEEDUP:
            self.emit(
                "layout_hint",
                launched_step_s=launched,
                best_step_s=best[0].estimate.step_s,
                label=best[0].label,
                pipelines=[list(p) for p in best[0].plan.pipelines],
            )

    def growth(
        self, job: Any, current: Any, alive: list[int]
    ) -> tuple[float, float, float, str] | None:
        """(step now, step after, transition, label) when moving to the best-scoring
        layout over every live worker, risk included, pays before the next failure
        (planner.choice.selection.growth_choice, as chameleon simulate grows), else None."""
        from planner.choice.policy import reparallelize_candidates
        from planner.choice.selection import Outlook, growth_choice

        search = self.search(job)
        if job.training.shards > 1:  # whole replica groups back (planner.choice.sharded)
            from planner.choice.sharded import regrow

            candidates = [regrow(search, current, alive)]
        else:
            proposals = search.propose(current, alive)
            if not proposals:
                return None
            candidates = reparallelize_candidates(
                search, proposals, current, alive, failed=(), search_s=0.0
            )
        current_s = search.estimate(current).step_s
        outlook = Outlook(self.mtbf(len(alive)).seconds, None, self.rate.node_share())
        best = growth_choice(job, current, current_s, candidates, outlook)
        if best is None:
            return None
        return current_s, best.estimate.step_s, best.transition.total_s, best.label

    def launch(self, workers: list[int]) -> Any:
        """The layout to start on when the script left it to the planner
        (``Trainer(pipeline_stages="auto")``): planner.choice.selection.launch_choice on
        the described job, before any step was measured (a Proposal; None: none fits)."""
        from planner.choice.selection import Outlook, launch_choice

        job = self.job(None, {}, 0)
        outlook = Outlook(self.mtbf(len(workers)).seconds, None, self.rate.node_share())
        return launch_choice(job, workers, outlook)

    def since_checkpoint_s(self, resume_step: int, job: Any) -> float:
        """The work a checkpoint restart would redo, at the measured pace."""
        every = self.description.checkpoint_interval_steps
        step_s = job.training.checkpoint_interval_s / max(1, every)
        return (resume_step % every) * step_s if every else resume_step * step_s
