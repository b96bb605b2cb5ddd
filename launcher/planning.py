"""The planner, run for the coordinator (launcher/coordinator.py) on a thread of its own, so
that failures keep being seen while it works: a failure meanwhile makes the state machine
start another plan, and the answer to the abandoned one is simply not waited for.

``Planner.start`` fits the job to what the workers measured (launcher/calibration.py) and
hands ``planner.choice.selection.decide`` to the thread; ``Planner.answer`` turns a finished
decision into the state machine's ``Planned`` event and the ``PlanMessage`` to publish,
and logs the choice (``decision``, ``plan_chosen`` with every candidate weighed).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from chameleon_runtime.protocol.messages import WorkerStatus
from launcher import recovery as rc
from launcher.calibration import JobModel


@dataclass
class _Pending:
    start: rc.StartPlanning
    future: Future


class Planner:
    def __init__(
        self,
        *,
        model: JobModel,
        policy: str,
        gone: set[int],
        emit: Callable[..., object],
        attempt: int,
        naive_migration: bool = False,
        on_done: Callable[[], None] | None = None,
        restarts_left: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.restarts_left = restarts_left  # the launcher's budget, read at each decision
        self.model = model
        self.policy = policy
        self.naive_migration = naive_migration  # --migration-schedule naive
        self.gone = gone  # ranks whose node is lost (shared with the coordinator)
        self.emit = emit
        self.attempt = attempt
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="planner")
        self._pending: _Pending | None = None
        self.on_done = on_done  # wakes the coordinator's loop: a decision is ready

    def start(
        self, start: rc.StartPlanning, base: Any, statuses: Mapping[int, WorkerStatus]
    ) -> None:
        """Plan ``start.generation`` from ``base`` (the PlanMessage of the layout held)."""
        current = base.plan.to_plan()
        job = self.model.job(current, statuses, start.base)
        future = self._pool.submit(self._decide, start, current, job)
        if self.on_done is not None:
            on_done = self.on_done
            future.add_done_callback(lambda _: on_done())
        self._pending = _Pending(start, future)

    def fail(self, start: rc.StartPlanning, reason: str) -> None:
        """Answer ``start`` with a restart: there is nothing to plan with."""
        future: Future = Future()
        future.set_exception(RuntimeError(reason))
        self._pending = _Pending(start, future)

    def answer(self, first: Any) -> tuple[rc.Planned, Any | None] | None:
        """The finished plan, if any: the event and the message to publish (None for a
        restart). ``first`` is generation 0's PlanMessage (the failure-free estimate)."""
        pending = self._pending
        if pending is None or not pending.future.done():
            return None
        self._pending = None
        return self._answer(pending, first)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- on the planner's thread ----------------------------------------------------------

    def _decide(self, start: rc.StartPlanning, current: Any, job: Any) -> dict:
        from planner.choice.policy import Policy
        from planner.choice.selection import decide

        if start.replan is not None:
            return self._replan(start, current, job)
        forced = None if self.policy == "auto" else Policy(self.policy)
        if start.joining or start.rebalance:
            forced = Policy.REPARALLELIZE  # taking replacements in, or a calibrated re-partition
        if start.deferred and not start.failed and not start.rebalance:
            forced = Policy.REROUTE  # nothing lost, nobody taken in: the layout as it is
        if start.stop and not start.failed:
            forced = Policy.REROUTE  # stopping for a preemption: the layout as it is
        t0 = time.perf_counter()
        survivors = (set(current.workers) | set(start.idle)) - set(start.failed)
        mtbf = self.model.mtbf(len(survivors) * job.tp)
        decision = decide(
            job,
            current,
            list(start.failed),
            policy=forced,
            mtbf_s=mtbf.seconds,
            mtbf_source=mtbf.source,
            since_checkpoint_s=self.model.since_checkpoint_s(start.resume_step, job),
            # A restart brings back every rank whose node lives.
            spares=[r for r in start.failed if r not in self.gone],
            idle=list(start.idle),
            search=self.model.search(job),
            restarts_left=self.restarts_left(),
            node_share=self.model.rate.node_share(),
        )
        return {"decision": decision, "job": job, "search_ms": (time.perf_counter() - t0) * 1e3}

    def _replan(self, start: rc.StartPlanning, current: Any, job: Any) -> dict:
        """Around slow workers (planner.choice.stragglers), or back to an even deal."""
        from planner.choice.stragglers import dealt_unevenly, even_plan, straggler_choice
        from planner.estimator.estimate import estimate

        t0 = time.perf_counter()
        replan = start.replan
        assert replan is not None
        options: dict = {}
        transition_s = 0.0
        try:
            if replan.slow:
                # The coordinator judged the move to pay (launcher/stragglers.py): the
                # uneven deal is taken, not decided again (a second opinion that said stay
                # would have aborted the generation for nothing).
                slow_job = replace(job, slow=replan.slow)
                choice = straggler_choice(
                    slow_job, current, replan.horizon_s, leave_out=False, repartition=False
                )
                uneven = next(o for o in choice.options if o.name == "uneven deal")
                if not uneven.feasible:
                    raise ValueError(uneven.reason)
                plan, label = uneven.plan, f"uneven deal: {uneven.label}"
                if not dealt_unevenly(plan):
                    # Dealt again at factors near the recovered bar, the deal rounds to
                    # even counts: that is the even deal, and said so (named "uneven",
                    # the next look saw no uneven plan, and the move back was never told).
                    label = "even deal"
                step_s, transition_s = uneven.estimate.step_s, uneven.transition_s
                options = {
                    o.name: {
                        "step_s": o.estimate.step_s if o.estimate else None,
                        "transition_s": o.transition_s,
                        "samples": o.samples,
                        "reason": o.reason,
                    }
                    for o in choice.options
                }
                even_s = choice.even_step_s
            else:
                plan, label = even_plan(current), "even deal"
                step_s = even_s = estimate(job, plan).step_s
        except Exception as exc:  # (a healthy job is never restarted over an optimisation)
            plan, label = current, f"the layout as it is ({str(exc)[:80]})"
            step_s = even_s = estimate(replace(job, slow=()), current).step_s
        return {
            "replan": replan, "job": job, "plan": plan, "label": label, "step_s": step_s,
            "even_step_s": even_s, "transition_s": transition_s, "options": options,
            "search_ms": (time.perf_counter() - t0) * 1e3,
        }  # fmt: skip

    # -- back on the coordinator's ----------------------------------------------------------

    def _answer(self, pending: _Pending, first: Any) -> tuple[rc.Planned, Any | None]:
        from chameleon_runtime.protocol.wire import PlanMessage
        from planner.choice.policy import Policy

        start = pending.start
        try:
            result = pending.future.result()
        except Exception as exc:  # nothing to plan with, or a planner bug: never wedge
            return rc.Planned(start.generation, restart=True, reason=f"no plan: {exc}"), None
        if "replan" in result:
            return self._answer_replan(start, result)
        decision, job = result["decision"], result["job"]
        basis = {
            "memory_limit_bytes": job.cluster.device_memory_bytes,
            "mtbf_s": decision.mtbf_s,
            "mtbf_source": decision.mtbf_source,
            "node_share": decision.outlook.node_share,
            "restart_s": job.cluster.restart_s,
            "candidates": {
                c.policy.value: {
                    "feasible": c.feasible,
                    "reason": c.reason,
                    "step_s": c.estimate.step_s if c.estimate else None,
                    "peak_memory_bytes": c.estimate.peak_memory_bytes if c.estimate else None,
                    "transition_s": c.transition.total_s if c.feasible else None,
                    "risk_s": decision.risk_s(job, c) if c.feasible else None,
                    "score": decision.score(job, c) if c.feasible else None,
                }
                for c in decision.candidates
            },
            "search_ms": result["search_ms"],
            "failed": list(start.failed),
            "generation": start.generation,
        }
        chosen = decision.chosen
        if chosen is None or chosen.plan is None or chosen.policy is Policy.RESTART:
            self.emit("plan_chosen", policy="restart", **basis)
            in_place = any(
                c.feasible for c in decision.candidates if c.policy is not Policy.RESTART
            )
            # (a restart chosen over a feasible in-place recovery says so: the soak and
            # the timeline tell a forced restart from a chosen one)
            why = "the planner chose restart" if in_place else "no in-place policy is feasible"
            first = decision.candidates[0]  # (rerouting's reason: the most direct)
            if not in_place and first.reason:
                why = f"{why}: {first.reason}"
            return rc.Planned(start.generation, restart=True, reason=why), None
        migration = chosen.migration.naive() if self.naive_migration else chosen.migration
        message = PlanMessage.build(
            generation=start.generation,
            policy=chosen.policy.value,
            resume_step=start.resume_step,
            plan=chosen.plan,
            migration=migration,
            estimated_step_s=chosen.estimate.step_s if chosen.estimate else None,
            roll_forward=start.roll_forward,
            stop=start.stop,
        )
        if start.stop:
            why = "a preemption notice: save and stop"
        elif start.joining:
            why = f"ranks {list(start.joining)} rejoin"
        elif start.rebalance:
            why = "a faster layout, calibrated"
        else:
            why = f"ranks {list(start.failed)} failed"
        self.emit(
            "decision",
            attempt=self.attempt,
            generation=start.generation,
            action="recover",
            policy=chosen.policy.value,
            reason=f"{why}; {chosen.policy.value}: {chosen.label}",
            exit_code=0,
        )
        self.emit(
            "plan_chosen",
            policy=chosen.policy.value,
            label=chosen.label,
            resume_step=start.resume_step,
            estimated_step_s=chosen.estimate.step_s if chosen.estimate else None,
            failure_free_step_s=self.model.search(job).estimate(first.plan.to_plan()).step_s,
            before_step_s=decision.baseline.step_s,
            calibration=self.model.factor,
            transition_s=chosen.transition.total_s,
            transition_parts_s={
                "search": chosen.transition.search_s,
                "migration": job.cluster.transition_factor * migration.est_time_s,
                "groups": chosen.transition.groups_s,
                "protocol": chosen.transition.protocol_s,
            },
            moved_bytes=migration.num_bytes,
            migration_schedule="naive" if self.naive_migration else "matched",
            transfers=len(message.transfers),
            joined=list(start.joining),
            rebalance=start.rebalance,
            plan=message.plan.model_dump(mode="json"),
            **basis,
        )
        self.model.expect_transition(
            start.generation,
            predicted_s=chosen.transition.total_s - chosen.transition.search_s,
            decision_s=result["search_ms"] / 1e3,
        )
        members = frozenset(chosen.plan.workers) | {t.src for t in message.transfers}
        layout = {s.worker: (s.first_layer, s.end_layer) for s in chosen.plan.stages}
        planned = rc.Planned(
            start.generation, layout=layout, members=members, transition_s=chosen.transition.total_s
        )
        return planned, message

    def _answer_replan(self, start: rc.StartPlanning, result: dict) -> tuple[rc.Planned, Any]:
        """A healthy job's move (``_replan``): the same workers and layers, another deal.
        Nothing moves, so the plan is published as a reroute's (the layout as it is)."""
        from chameleon_runtime.protocol.wire import PlanMessage

        plan, replan = result["plan"], result["replan"]
        message = PlanMessage.build(
            generation=start.generation,
            policy="reroute",
            resume_step=start.resume_step,
            plan=plan,
            estimated_step_s=result["step_s"],
            roll_forward=start.roll_forward,
            stop=start.stop,
        )
        slow = ", ".join(f"rank {w} {f:.2f}x" for w, f in replan.slow)
        why = f"slow: {slow}" if replan.slow else "slow ranks back to speed"
        self.emit(
            "decision", attempt=self.attempt, generation=start.generation, action="replan",
            policy="reroute", reason=f"{why}; {result['label']}", exit_code=0,
        )  # fmt: skip
        self.emit(
            "plan_chosen", policy="reroute", label=result["label"],
            resume_step=start.resume_step, estimated_step_s=result["step_s"],
            failure_free_step_s=result["even_step_s"], transition_s=result["transition_s"],
            search_ms=result["search_ms"], failed=[], generation=start.generation,
            slow={str(w): f for w, f in replan.slow}, horizon_s=replan.horizon_s,
            options=result["options"], load=plan.load(),
            plan=message.plan.model_dump(mode="json"),
        )  # fmt: skip
        layout = {s.worker: (s.first_layer, s.end_layer) for s in plan.stages}
        planned = rc.Planned(
            start.generation,
            layout=layout,
            members=frozenset(plan.workers),
            transition_s=result["transition_s"],
        )
        return planned, message
