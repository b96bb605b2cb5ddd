"""In-place recovery of chameleon_runtime jobs, driven by the leader agent.

When every worker has registered as a chameleon_runtime worker, a failure no longer means
a restart. The coordinator, advanced once per monitor tick:

1. ABORT: publishes ``chameleon/abort/<gen>`` so every survivor drops the step it is in
   (the step is never applied: the commit barrier is all-or-none);
2. COLLECT: waits for every survivor's ``ready/<gen+1>/<rank>`` (the step it is at and the
   layers it holds); a survivor that dies meanwhile joins the failed set;
3. PLAN: asks the planner (``planner.selection.decide``) with the job the workers
   described, calibrated by their measured step time: reroute, reparallelize, or restart;
4. PUBLISH: for an in-place policy, ``plan/<gen+1>`` with the step to resume at and the
   migration schedule; for restart, hands back to the ordinary restart path;
5. CONFIRM: the new generation counts as recovered once every worker of it reports the
   plan applied; a failure before that aborts it and starts over from step 1 with the
   last plan every worker applied.

The job's store is the one the leader hosts for the workers of this attempt.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from launcher.rejoin import Rejoins, worth_growing


class Phase(StrEnum):
    RUNNING = "running"
    COLLECT = "collect"
    CONFIRM = "confirm"


@dataclass(frozen=True)
class InPlaceOutcome:
    """What the coordinator asks of the agent: nothing, or a restart (with why)."""

    restart: bool = False
    reason: str = ""


# A layout this much faster than the launched one is worth a note in the run summary.
LAYOUT_HINT_SPEEDUP = 1.1
CALIBRATION_ROUNDS = 4
# The model is fitted to the running plan once its steps have settled (a generation's
# first steps pay for warm-up), and fitted again in every generation: a fit to the
# launched plan alone misses what a new layout changes on this machine, and a failure
# before the first fit must not leave later recoveries planning on the raw description.
CALIBRATE_AFTER_STEPS = 6  # chameleon_runtime.pace: 2 warm-up steps, then means
# Steps after which the workers' means (chameleon_runtime.pace: 2 warm-up steps, a window
# of 8) cover only steps run after a replacement's start-up, which competed for the host.
SETTLE_STEPS = 10


def _waiting(job: Any, extra_s: float) -> Any:
    """``job`` with ``extra_s`` added to every message's latency."""
    if extra_s == 0.0:
        return job
    cluster = job.cluster
    slower = {
        name: replace(link, latency_s=link.latency_s + extra_s)
        for name, link in (("intra_node", cluster.intra_node), ("inter_node", cluster.inter_node))
    }
    return replace(job, cluster=replace(cluster, **slower))


def _scaled(job: Any, k: float) -> Any:
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


def _fit_wait(job: Any, plan: Any, measured: float, rounds: int = 30) -> float | None:
    """The extra latency per message that makes ``plan``'s estimate ``measured`` (the
    estimate grows with it), or None where none does: the estimate without any is
    already there, or no amount of waiting reaches it."""
    from planner.estimate import estimate

    def predicted(extra: float) -> float:
        return estimate(_waiting(job, extra), plan).step_s

    low, high = 0.0, measured
    if predicted(low) >= measured or predicted(high) < measured:
        return None
    for _ in range(rounds):
        mid = (low + high) / 2
        low, high = (mid, high) if predicted(mid) < measured else (low, mid)
    return (low + high) / 2


@dataclass
class Coordinator:
    store: Any  # the TCPStore hosted for this attempt's workers
    world_size: int
    emit: Callable[..., object]
    policy: str = "auto"  # or a forced policy
    mtbf_s: float = 3600.0
    ready_timeout_s: float = 30.0
    workers_per_node: int = 1
    num_nodes: int = 1
    nodes_per_host: int = 1  # agents sharing one host (and its cores)
    restart_s: float = 10.0
    cluster: Any = None  # planner.workload.Cluster from --config, or None: measured defaults
    # When this attempt's workers were spawned: spawn to first step is what a restart
    # costs here (start-up, imports, group creation, checkpoint load), used as restart_s
    # when no config gives one.
    started_at: float | None = None
    _startup_s: float | None = None
    max_rejoins: int = 0  # replacements per rank (launcher/rejoin.py); 0: never
    gone: set[int] = field(default_factory=set)  # ranks whose node is lost: no replacement
    reported: set[tuple[int, float]] = field(default_factory=set)  # failures handed in
    attempt: int = 0  # the launcher round these workers belong to
    generation: int = 0
    phase: Phase = Phase.RUNNING
    dead: set[int] = field(default_factory=set)
    _collect_since: float = 0.0
    _pending_failed: set[int] = field(default_factory=set)
    _published: dict | None = None
    _last_step: int = -1
    _top_step: int = -1
    _resumed_reported: bool = False
    _last_step_event: float = 0.0
    _search: Any = None
    _calibration: float | None = None
    _host: tuple[float, float, float] | None = None  # cores, overhead, wait: _calibrate
    _calibrated_gen: int = -1
    _wait_s: float = 0.0  # the last message wait a fit could determine
    _gen_start: int = 0  # the step the current generation resumed at
    _joined: list[int] = field(default_factory=list)  # announced, growth not yet judged
    _settle_until: int = 0
    _last_measured_s: float | None = None
    _rejoins: Rejoins | None = None
    _growing: list[int] = field(default_factory=list)  # replacements being taken in

    # -- store helpers -------------------------------------------------------------------

    @property
    def _prefix(self) -> str:
        return f"chameleon/{self.attempt}/"  # as chameleon_runtime.control.key_prefix

    def _get(self, name: str) -> Any | None:
        import json

        key = self._prefix + name
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key).decode())

    def _put(self, name: str, value: Any) -> None:
        import json

        self.store.set(self._prefix + name, json.dumps(value, separators=(",", ":")))

    # -- state -------------------------------------------------------------------------

    @property
    def recovering(self) -> bool:
        return self.phase is not Phase.RUNNING

    def all_aware(self) -> bool:
        return all(self.store.check([f"{self._prefix}aware/{r}"]) for r in range(self.world_size))

    def heartbeat(self, rank: int) -> dict | None:
        return self._get(f"hb/{rank}")

    def request_exit(self, rank: int, code: int) -> None:
        self._put(f"exit/{rank}", code)

    def current_plan_message(self) -> dict | None:
        gen = self._get("gen")
        return None if gen is None else self._get(f"plan/{gen}")

    # -- the tick ------------------------------------------------------------------------

    def on_failures(
        self, ranks: set[int], *, gone: set[int] | frozenset[int] = frozenset()
    ) -> None:
        """Workers died (or hung and were killed): start or widen a recovery. ``gone``:
        those of them whose node is lost (no replacement can start there)."""
        self.gone |= set(gone)
        new = ranks - self.dead
        if not new:
            return
        if self._rejoins is None:
            self._rejoins = Rejoins(self.max_rejoins)
        self._rejoins.forget(new)
        asked = self._rejoins.request(new, gone=self.gone, put=self._put)
        if asked:
            self.emit("respawn_requested", attempt=self.attempt, ranks=asked)
        if self.phase is not Phase.COLLECT and not new & self._members():
            # Spares (and replacements not yet taken in) run no step: nothing to abort.
            self.dead |= new
            self.emit("spare_lost", attempt=self.attempt, ranks=sorted(new))
            return
        if self.phase is Phase.RUNNING:
            self._progress()  # the step reached, read now: it is what a restart would lose
        self.dead |= new
        if self.phase is Phase.CONFIRM:
            # The new plan was not applied everywhere yet: abandon it and plan again from
            # the last plan every worker applied.
            self._put(
                f"abort/{self.generation}",
                {"reason": f"ranks {sorted(new)} failed during recovery"},
            )
            self.generation -= 1
            self._published = None
        elif self.phase is Phase.RUNNING:
            self._put(f"abort/{self.generation}", {"reason": f"ranks {sorted(new)} failed"})
            self.emit(
                "abort",
                attempt=self.attempt,
                generation=self.generation,
                ranks=sorted(new),
                last_step=self._top_step,
            )
        self._pending_failed |= new
        self.phase = Phase.COLLECT
        self._collect_since = time.monotonic()

    def tick(self) -> InPlaceOutcome:
        if not self._resumed_reported:
            first = self._get("plan/0")
            if first is not None:
                self._resumed_reported = True
                self._gen_start = first["resume_step"]
                self.emit("resumed", attempt=self.attempt, resume_step=first["resume_step"])
        if self.phase is Phase.RUNNING:
            self._progress()
            self._admit_replacements()
            return InPlaceOutcome()
        if self.phase is Phase.COLLECT:
            return self._collect()
        return self._confirm()

    def _progress(self) -> None:
        """Step events for the timeline: the first step of a generation and then at most
        one a second."""
        steps = [
            hb["step"]
            for r in range(self.world_size)
            if r not in self.dead and (hb := self.heartbeat(r)) and hb.get("state") == "training"
        ]
        if not steps:
            return
        top = max(steps)
        self._top_step = max(self._top_step, top)
        now = time.monotonic()
        if self._startup_s is None and self.started_at is not None:
            self._startup_s = now - self.started_at
        if top > self._last_step and (now - self._last_step_event >= 1.0 or self._last_step < 0):
            self.emit("step", step=top, generation=self.generation)
            self._last_step, self._last_step_event = top, now

    def _survivors(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.dead]

    def _members(self) -> set[int]:
        """Workers of the current generation's groups: its plan's workers and the sources
        of its transfers (the others are spares)."""
        message = self._get(f"plan/{self.generation}")
        if message is None:
            return set(range(self.world_size))
        workers = {s["worker"] for s in message["plan"]["stages"]}
        return workers | {t["src"] for t in message.get("transfers", [])}

    # -- replacements (launcher/rejoin.py) -------------------------------------------------

    def _admit_replacements(self) -> None:
        """Take announced replacements in: as spares, and into the plan when the planner
        finds a layout with them that pays for the move before the next failure."""
        if self._rejoins is not None and self._rejoins.waiting:
            joined = [
                r
                for r in self._rejoins.announced(self._get)
                if (hb := self.heartbeat(r)) is not None
                and hb.get("state") == "spare"
                and hb.get("gen") == self.generation
            ]
            if joined:
                self._rejoins.forget(joined)
                self.dead -= set(joined)  # a spare from now on
                self._joined += joined
                self._settle_until = self._top_step + SETTLE_STEPS
        # Judge the layout with them on a model fitted after their start-up (importing
        # torch, building the model) stopped competing with the workers for the host.
        if not self._joined or self._top_step < self._settle_until:
            return
        if self._rejoins is not None and self._rejoins.waiting:
            return  # another one is still starting
        joined, self._joined = self._joined, []
        if set(joined) <= self._members():  # a recovery while they settled took them in
            self.emit("rejoined", attempt=self.attempt, ranks=joined, taken_in=True)
            return
        self._calibrated_gen = -1
        self.calibrate_now()
        growth = self._growth()
        if growth is None:
            self.emit("rejoined", attempt=self.attempt, ranks=joined, taken_in=False)
            return
        current_s, grown_s, transition_s, label = growth
        self.emit(
            "rejoin",
            attempt=self.attempt,
            generation=self.generation,
            ranks=joined,
            step_s=current_s,
            estimated_step_s=grown_s,
            transition_s=transition_s,
            label=label,
        )
        self._put(f"abort/{self.generation}", {"reason": f"ranks {joined} rejoin"})
        self._growing = joined
        self.phase = Phase.COLLECT
        self._collect_since = time.monotonic()

    def _growth(self) -> tuple[float, float, float, str] | None:
        """(step now, step with every live worker, transition, label) when moving to the
        best layout over every live worker is worth it, else None. Never under a forced
        ``reroute`` (the user asked to keep the layout) or ``restart``."""
        from planner.policy import reparallelize_candidates
        from planner.wire import JobDescription, PlanWire

        if self.policy not in ("auto", "reparallelize"):
            return None
        described, current_msg = self._get("job"), self._get(f"plan/{self.generation}")
        if described is None or current_msg is None:
            return None
        current = PlanWire.model_validate(current_msg["plan"]).to_plan()
        job = self._job(JobDescription.model_validate(described), current)
        search = self._search_for(job)
        alive = self._survivors()
        proposals = search.propose(current, alive)[:1]
        if not proposals:
            return None
        (best,) = reparallelize_candidates(search, proposals, current, alive, search_s=0.0)
        if best.estimate is None or best.plan is None:
            return None
        current_s = search.estimate(current).step_s
        if not worth_growing(
            current_s=current_s,
            grown_s=best.estimate.step_s,
            transition_s=best.transition.total_s,
            mtbf_s=self.mtbf_s,
        ):
            return None
        return current_s, best.estimate.step_s, best.transition.total_s, best.label

    def _collect(self) -> InPlaceOutcome:
        target = self.generation + 1
        survivors = self._survivors()
        ready = {r: self._get(f"ready/{target}/{r}") for r in survivors}
        missing = [r for r, v in ready.items() if v is None]
        if missing and time.monotonic() - self._collect_since < self.ready_timeout_s:
            return InPlaceOutcome()
        if missing:
            return InPlaceOutcome(
                restart=True, reason=f"ranks {missing} never reported ready for a new plan"
            )
        steps = {v["step"] for v in ready.values() if v["step"] is not None}  # spares: None
        if not steps:
            return InPlaceOutcome(restart=True, reason="no worker that held state survived")
        if len(steps) != 1:
            return InPlaceOutcome(
                restart=True, reason=f"survivors disagree on the step to resume ({sorted(steps)})"
            )
        resume_step = steps.pop()
        return self._plan(target, resume_step, {r: v["held"] for r, v in ready.items()})

    def _plan(self, target: int, resume_step: int, held: dict[int, list[int]]) -> InPlaceOutcome:
        from planner.plan import Plan
        from planner.policy import Policy
        from planner.selection import decide
        from planner.wire import JobDescription, PlanMessage, PlanWire

        described = self._get("job")
        current_msg = self._get(f"plan/{self.generation}")
        if described is None or current_msg is None:
            return InPlaceOutcome(restart=True, reason="the workers had not described the job yet")
        description = JobDescription.model_validate(described)
        current: Plan = PlanWire.model_validate(current_msg["plan"]).to_plan()
        failed = sorted(self._pending_failed | {w for w in current.workers if w in self.dead})
        job = self._job(description, current)
        forced = None if self.policy == "auto" else Policy(self.policy)
        if self._growing and failed:
            self._growing = []  # a failure came first: this is a recovery again
        if self._growing:
            forced = Policy.REPARALLELIZE  # taking replacements in: only a re-partition can
        # Live workers outside the plan (spares, replacements) hold nothing but can work;
        # a failed rank whose replacement already runs is among them, and not lost twice.
        idle = [r for r in self._survivors() if r not in current.workers]
        t0 = time.perf_counter()
        decision = decide(
            job,
            current,
            failed,
            policy=forced,
            mtbf_s=self.mtbf_s,
            since_checkpoint_s=self._since_checkpoint(description, resume_step, job),
            # A restart brings back every rank whose node lives.
            spares=[r for r in failed if r not in self.gone],
            idle=idle,
            search=self._search_for(job),
        )
        search_ms = (time.perf_counter() - t0) * 1e3
        candidates = {
            c.policy.value: {
                "feasible": c.feasible,
                "reason": c.reason,
                "step_s": c.estimate.step_s if c.estimate else None,
                "peak_memory_bytes": c.estimate.peak_memory_bytes if c.estimate else None,
                "transition_s": c.transition.total_s if c.feasible else None,
                "score": decision.score(job, c) if c.feasible else None,
            }
            for c in decision.candidates
        }
        chosen = decision.chosen
        # What the choice was made against, for the event log.
        basis = {
            "memory_limit_bytes": job.cluster.device_memory_bytes,
            "mtbf_s": self.mtbf_s,
            "restart_s": job.cluster.restart_s,
        }
        if chosen is None or chosen.plan is None or chosen.policy is Policy.RESTART:
            why = (
                "the planner chose restart"
                if chosen is not None
                else "no in-place policy is feasible"
            )
            self.emit(
                "plan_chosen",
                generation=target,
                policy="restart",
                candidates=candidates,
                search_ms=search_ms,
                failed=failed,
                **basis,
            )
            return InPlaceOutcome(restart=True, reason=why)
        self.emit(
            "decision",
            attempt=self.attempt,
            generation=target,
            action="recover",
            policy=chosen.policy.value,
            reason=(f"ranks {self._growing} rejoin" if self._growing else f"ranks {failed} failed")
            + f"; {chosen.policy.value}: {chosen.label}",
            exit_code=0,
        )
        message = PlanMessage.build(
            generation=target,
            policy=chosen.policy.value,
            resume_step=resume_step,
            plan=chosen.plan,
            migration=chosen.migration,
            estimated_step_s=chosen.estimate.step_s if chosen.estimate else None,
        )
        self._put(f"plan/{target}", message.model_dump())
        self._put("gen", target)
        self.generation = target
        self._published = {
            "policy": chosen.policy.value,
            "resume_step": resume_step,
            "workers": sorted(set(chosen.plan.workers) | {t.src for t in message.transfers}),
        }
        self.emit(
            "plan_chosen",
            generation=target,
            policy=chosen.policy.value,
            label=chosen.label,
            resume_step=resume_step,
            failed=failed,
            estimated_step_s=chosen.estimate.step_s if chosen.estimate else None,
            failure_free_step_s=self._failure_free_s(job),
            before_step_s=decision.baseline.step_s,
            calibration=self._calibration,
            transition_s=chosen.transition.total_s,
            moved_bytes=chosen.migration.num_bytes,
            transfers=len(message.transfers),
            candidates=candidates,
            search_ms=search_ms,
            joined=self._growing,
            **basis,
        )
        self._pending_failed = set()
        self.phase = Phase.CONFIRM
        return InPlaceOutcome()

    def _confirm(self) -> InPlaceOutcome:
        assert self._published is not None
        for r in self._published["workers"]:
            hb = self.heartbeat(r)
            if hb is None or hb.get("gen", -1) < self.generation:
                return InPlaceOutcome()
        self.emit(
            "rejoined" if self._growing else "recovered",
            generation=self.generation,
            policy=self._published["policy"],
            resume_step=self._published["resume_step"],
            steps_lost=0,
            **({"ranks": self._growing, "taken_in": True} if self._growing else {}),
        )
        self._growing = []
        self.phase = Phase.RUNNING
        self._last_step = self._published["resume_step"] - 1
        self._gen_start = self._published["resume_step"]
        self._last_step_event = 0.0
        self._published = None
        return InPlaceOutcome()

    # -- the planner's view of the job -------------------------------------------------------

    def _job(self, description: Any, current: Any) -> Any:
        """The described job, fitted to what the workers measure (``_calibrate``): the
        planner's estimate of the running plan is its measured step time."""
        measured = self._measured_step_s()  # None while the workers are recovering
        if measured is not None:
            self._last_measured_s = measured
        job = description.to_job(
            num_nodes=self.num_nodes,
            workers_per_node=self.workers_per_node,
            mtbf_s=self.mtbf_s,
            step_s=self._last_measured_s or 1.0,
            restart_s=self._startup_s if self._startup_s is not None else self.restart_s,
            cluster=self.cluster,
            nodes_per_host=self.nodes_per_host,
        )
        if self._calibration is None:
            if measured is None:
                return job
            self._calibrate(job, current, measured)
        job = _scaled(job, self._calibration)
        if self._host is not None:
            cores, overhead, wait = self._host
            job = replace(
                job, cluster=replace(job.cluster, host_cores=cores, worker_overhead_s=overhead)
            )
            job = _waiting(job, wait)
        return job

    def _calibrate(self, job: Any, current: Any, measured: float) -> None:
        """Fit the model to the running plan's measured step.

        Workers with a device each: one factor on every layer's time, so that the critical
        path is the measured step (communication and the commit do not scale with it:
        iterate to the fixed point).

        Workers sharing a host's cores (CPU), from their own CPU accounting: layer times
        become CPU times (a worker that has a core runs at that speed), each worker's CPU
        beyond its layers is its overhead, and the host bound is all of it over the
        host's cores. A step slower than that bound waits on messages: on a busy host a
        message's wake-up costs far more than the link's latency, so the latency that
        makes the running plan's critical path the measured step is fitted (a pipeline
        with many hops pays it often, data parallelism rarely). Where waiting cannot
        explain the step (no messages) or the bound already exceeds it (the host is
        busier than its workers: the launcher, a replacement starting), the host is
        taken to keep busy only the cores it was measured to keep busy."""
        from planner.cost import CostModel
        from planner.estimate import estimate, worker_compute_s

        beats = {
            w: hb
            for w in current.workers
            if (hb := self.heartbeat(w))
            and hb.get("cpu_s")
            and hb.get("compute_cpu_s")
            and hb.get("gen", self.generation) == self.generation
        }
        compute = worker_compute_s(current, CostModel(job))
        modelled = sum(compute.get(w, 0.0) for w in beats)
        if job.cluster.host_cores and beats and modelled > 0:
            cpu = [hb.get("mean_cpu_s") or hb["cpu_s"] for hb in beats.values()]
            compute_cpu = [
                hb.get("mean_compute_cpu_s") or hb["compute_cpu_s"] for hb in beats.values()
            ]
            self._calibration = sum(compute_cpu) / modelled
            overhead = max(
                0.0, statistics.mean(c - k for c, k in zip(cpu, compute_cpu, strict=True))
            )
            cores = job.cluster.host_cores
            fitted = replace(
                _scaled(job, self._calibration),
                cluster=replace(job.cluster, worker_overhead_s=overhead),
            )
            wait = _fit_wait(fitted, current, measured)
            if wait is None:
                # Keep what an earlier plan with more messages showed of waiting: a data
                # parallel step that the host bounds says nothing about it.
                hosts = -(-self.num_nodes // max(1, self.nodes_per_host))
                busy = sum(cpu) * len(current.workers) / len(beats) / measured / hosts
                cores, wait = busy, self._wait_s
            self._wait_s = wait
            self._host = (cores, overhead, wait)
        else:
            alone = replace(job, cluster=replace(job.cluster, host_cores=None))
            k = 1.0
            for _ in range(CALIBRATION_ROUNDS):
                predicted = estimate(_scaled(alone, k), current).step_s
                if predicted <= 0:
                    break
                k *= measured / predicted
            self._calibration = k
        host = self._host
        self.emit(
            "calibrated",
            measured_step_s=measured,
            estimated_step_s=estimate(job, current).step_s,
            factor=self._calibration,
            host_cores=host[0] if host else None,
            worker_overhead_s=host[1] if host else None,
            message_wait_s=host[2] if host else None,
        )

    def _failure_free_s(self, job: Any) -> float | None:
        """The estimate of the launched plan (generation 0) under ``job``."""
        from planner.estimate import estimate
        from planner.wire import PlanWire

        first = self._get("plan/0")
        if first is None:
            return None
        return estimate(job, PlanWire.model_validate(first["plan"]).to_plan()).step_s

    def calibrate_now_if_due(self) -> None:
        if (
            self.phase is Phase.RUNNING
            # a replacement starting up competes for the host: not a fit of the layout
            and not (self._rejoins is not None and self._rejoins.waiting)
            and self._calibrated_gen != self.generation
            and self._top_step >= self._gen_start + CALIBRATE_AFTER_STEPS
        ):
            self.calibrate_now()

    def calibrate_now(self) -> None:
        """Fit the model to the current generation's measured steps (and warm the search
        up for the next failure)."""
        from planner.plan import Plan  # noqa: F401  (import cost paid here, not at failure)
        from planner.wire import JobDescription, PlanWire

        described, current_msg, step_s = (
            self._get("job"),
            self._get(f"plan/{self.generation}"),
            self._measured_step_s(),
        )
        if described is None or current_msg is None or step_s is None:
            return
        self._calibrated_gen = self.generation
        self._calibration, self._host = None, None  # refit (in _job) on these steps
        description = JobDescription.model_validate(described)
        current = PlanWire.model_validate(current_msg["plan"]).to_plan()
        job = self._job(description, current)
        search = self._search_for(job)
        if self.generation == 0:
            self._hint_layout(job, search, current)

    def _hint_layout(self, job: Any, search: Any, current: Any) -> None:
        """Say so when the planner knows a clearly faster layout on the same workers than
        the one the script asked for: after a failure it may pick that layout, and the run
        then goes faster than before, which would otherwise look like a bug. (Changing the
        layout of a healthy job unasked is left to the user.)"""
        from planner.estimate import estimate

        launched = estimate(job, current).step_s
        best = search.propose(current, current.workers)
        if best and best[0].estimate.step_s < launched / LAYOUT_HINT_SPEEDUP:
            self.emit(
                "layout_hint",
                launched_step_s=launched,
                best_step_s=best[0].estimate.step_s,
                label=best[0].label,
                pipelines=[list(p) for p in best[0].plan.pipelines],
            )

    def _search_for(self, job: Any) -> Any:
        from planner.search import Search

        if self._search is None or self._search.job != job:
            self._search = Search(job).warm_up()
        return self._search

    def _measured_step_s(self) -> float | None:
        """The median step time the current generation's workers report, over their
        recent steps where they say (None while they recover: then they report none)."""
        times = [
            hb.get("mean_step_s") or hb["step_s"]
            for r in self._survivors()
            if (hb := self.heartbeat(r))
            and hb.get("step_s")
            and hb.get("gen", self.generation) == self.generation
        ]
        return statistics.median(times) if times else None

    def _since_checkpoint(self, description: Any, resume_step: int, job: Any) -> float:
        every = description.checkpoint_interval_steps
        step_s = job.training.checkpoint_interval_s / max(1, every)
        return (resume_step % every) * step_s if every else resume_step * step_s
