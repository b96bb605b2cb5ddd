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
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


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
    restart_s: float = 10.0
    cluster: Any = None  # planner.workload.Cluster from --config, or None: measured defaults
    # When this attempt's workers were spawned: spawn to first step is what a restart
    # costs here (start-up, imports, group creation, checkpoint load), used as restart_s
    # when no config gives one.
    started_at: float | None = None
    _startup_s: float | None = None
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

    def on_failures(self, ranks: set[int]) -> None:
        """Workers died (or hung and were killed): start or widen a recovery."""
        new = ranks - self.dead
        if not new:
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
                self.emit("resumed", attempt=self.attempt, resume_step=first["resume_step"])
        if self.phase is Phase.RUNNING:
            self._progress()
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
        steps = {v["step"] for v in ready.values()}
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
        t0 = time.perf_counter()
        decision = decide(
            job,
            current,
            failed,
            policy=forced,
            mtbf_s=self.mtbf_s,
            since_checkpoint_s=self._since_checkpoint(description, resume_step, job),
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
            reason=f"ranks {failed} failed; {chosen.policy.value}: {chosen.label}",
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
            failure_free_step_s=decision.baseline.step_s,
            calibration=self._calibration,
            transition_s=chosen.transition.total_s,
            moved_bytes=chosen.migration.num_bytes,
            transfers=len(message.transfers),
            candidates=candidates,
            search_ms=search_ms,
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
            "recovered",
            generation=self.generation,
            policy=self._published["policy"],
            resume_step=self._published["resume_step"],
            steps_lost=0,
        )
        self.phase = Phase.RUNNING
        self._last_step = self._published["resume_step"] - 1
        self._last_step_event = 0.0
        self._published = None
        return InPlaceOutcome()

    # -- the planner's view of the job -------------------------------------------------------

    def _job(self, description: Any, current: Any) -> Any:
        """The described job, with layer times scaled so that the planner's estimate of the
        running plan matches the step time the workers measure (one calibration factor
        for everything a shared host's contention adds)."""
        from dataclasses import replace

        from planner.estimate import estimate

        step_s = self._measured_step_s()
        job = description.to_job(
            num_nodes=self.num_nodes,
            workers_per_node=self.workers_per_node,
            mtbf_s=self.mtbf_s,
            step_s=step_s or 1.0,
            restart_s=self._startup_s if self._startup_s is not None else self.restart_s,
            cluster=self.cluster,
        )
        if step_s is None:
            return job
        if self._calibration is None:
            predicted = estimate(job, current).step_s
            self._calibration = step_s / predicted if predicted > 0 else 1.0
            self.emit(
                "calibrated",
                measured_step_s=step_s,
                estimated_step_s=predicted,
                factor=self._calibration,
            )
        k = self._calibration
        layers = tuple(
            replace(
                x,
                forward_s=x.forward_s * k,
                backward_s=x.backward_s * k,
                optimizer_s=x.optimizer_s * k,
            )
            for x in job.model.layers
        )
        return replace(job, model=replace(job.model, layers=layers))

    def calibrate_now_if_due(self, after_step: int = 1) -> None:
        if self._calibration is None and self._top_step >= after_step:
            self.calibrate_now()

    def calibrate_now(self) -> None:
        """Fix the calibration on failure-free steps, before any failure changes the plan."""
        if self._calibration is not None:
            return
        from planner.plan import Plan  # noqa: F401  (import cost paid here, not at failure)
        from planner.wire import JobDescription, PlanWire

        described, current_msg, step_s = (
            self._get("job"),
            self._get("plan/0"),
            self._measured_step_s(),
        )
        if described is None or current_msg is None or step_s is None:
            return
        description = JobDescription.model_validate(described)
        current = PlanWire.model_validate(current_msg["plan"]).to_plan()
        job = self._job(description, current)
        search = self._search_for(job)
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
        times = [
            hb["step_s"]
            for r in self._survivors()
            if (hb := self.heartbeat(r)) and hb.get("step_s")
        ]
        return statistics.median(times) if times else None

    def _since_checkpoint(self, description: Any, resume_step: int, job: Any) -> float:
        every = description.checkpoint_interval_steps
        step_s = job.training.checkpoint_interval_s / max(1, every)
        return (resume_step % every) * step_s if every else resume_step * step_s
