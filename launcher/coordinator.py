"""The in-place recovery coordinator: the I/O shell around the state machine of
launcher/recovery.py, run by the leader agent for a chameleon_runtime job.

Each tick it turns what happened into events (failures from the agents, the workers'
``Ready``/``Applied``/``Joined`` messages popped from the leader's inbox queue, the
planner's answer, the passing of time), asks ``recovery.decide`` what to do, and does it:
publish aborts and plans, kill what did not answer, emit events, delete the keys of
generations no worker reads any more. The planner runs on a thread of its own, so
failures keep being seen while it works.

While the job trains, once a second, it reads every worker's status (one ``multi_get``)
and from it emits step events (with the store's key count, the chief's threads and
descriptors, the largest worker's peak memory), settles the model's calibration
(launcher/calibration.py), admits replacements and takes them in when that pays
(launcher/rejoin.py), and runs the progress watch that blames a stalled worker
(launcher/watch.py).

A successor (``--rdzv-backend etcd``). The coordinator's state lives in the leader's
memory and in the worker store it hosts, and both go with its node. So while the job
trains, the leader mirrors into etcd what a successor needs to go on from the last
settled generation (``snapshot``): that generation's plan and the first, which ranks are
live and which are gone with their node, where the last recovery resumed, the job's
description that the workers wrote, how many failures were handled, and what the
planner's model has learned (its fit to the measured steps, the transitions' factor, the
failure posterior), so that the successor plans on the same costs. Before publishing any
plan it also writes the generation's number, so that a successor never hands out a
number a worker may have seen. The successor (launcher/agent.py ``_take_over``) serves a
new worker store, publishes its address (the agents write it to their workers' store
file: chameleon_runtime.storeaddr), and starts its coordinator from the snapshot
(``resume``): the old leader's ranks are then lost like any node's, the survivors, who
lost their store, report Ready to the new one, and the recovery runs as for any other
node loss. Without a snapshot (the old leader died before the first one, or the job is
not a chameleon_runtime job), the round is restarted, as on the TCPStore backends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from chameleon_runtime.protocol.messages import (
    INBOX,
    Abort,
    Applied,
    Joined,
    Keys,
    Ready,
    RecoveryPhase,
    Settled,
    WorkerStatus,
    encode,
)
from chameleon_runtime.protocol.seal import Seal
from chameleon_runtime.protocol.wire import JobDescription, PlanMessage
from launcher import recovery as rc
from launcher.calibration import JobModel
from launcher.planning import Planner
from launcher.rejoin import Rejoins
from launcher.store import drain
from launcher.stragglers import SpeedWatch, unit_costs
from launcher.supervisor import Failure, FailureKind, root_cause, summary
from launcher.watch import Progress
from launcher.watch import Timeouts as WatchTimeouts
from launcher.worker_store import WorkerStoreView

SNAPSHOT_PERIOD_S = 1.0
REJOIN_SNAPSHOT_PERIOD_S = 0.1


@dataclass(frozen=True)
class InPlaceOutcome:
    """What the coordinator asks of the agent: nothing, or a restart (with why)."""

    restart: bool = False
    reason: str = ""


class Coordinator:
    def __init__(
        self,
        *,
        store: Any,
        attempt: int,
        world_size: int,
        emit: Callable[..., object],
        kill: Callable[[list[int], str, float], None],  # ranks, why, silent for (s)
        model: JobModel,
        policy: str = "auto",
        migration_schedule: str = "matched",
        stragglers: str = "auto",
        timeouts: rc.Timeouts | None = None,
        watch: WatchTimeouts | None = None,
        max_rejoins: int = 0,
        started_at: float | None = None,
        on_phase: Callable[[RecoveryPhase], None] | None = None,
        on_planned: Callable[[], None] | None = None,
        on_settled: Callable[[dict], None] | None = None,
        on_publish: Callable[[int], None] | None = None,
        seal: Seal | None = None,
        restarts_left: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.store = store
        # The job token's signature on every control message (chameleon_runtime.protocol.seal.Seal).
        self.seal = seal or Seal(None, "")
        self.keys = Keys(attempt)
        self.attempt = attempt
        self.world_size = world_size
        self.emit = emit
        self.kill = kill
        self.model = model
        self.policy = policy
        self.progress = Progress(watch or WatchTimeouts())
        self.speeds = SpeedWatch(plan_around=stragglers != "off")  # launcher/stragglers.py
        self._stragglers = stragglers
        self._break_even: tuple[Any, float | None] = (None, None)  # (plan and slow set, s)
        # A survivor may be mid-step when an abort comes: it has the step timeout to answer.
        self._timeouts = replace(  # the state's own from the start
            timeouts or rc.Timeouts(), collect_s=self.progress.step_timeout_s()
        )
        self.rejoins = Rejoins(max_rejoins)
        self.started_at = started_at
        self.on_phase = on_phase
        # For a successor (``snapshot``): the state of each settled generation,
        # and each generation's number before it is published.
        self.on_settled, self.on_publish = on_settled, on_publish
        self._mirror_due, self._mirrored = on_settled is not None, None
        self.state: rc.State | None = None
        self.plans: dict[int, Any] = {}  # generation -> PlanMessage (published or planned)
        self.gone: set[int] = set()  # ranks whose node is lost: never replaced
        self.failures: list[Failure] = []
        self.recovered = 0  # the first ``recovered`` failures were recovered from in place
        self._fatal: str | None = None
        self._preempting = False  # a preemption notice came (preempt)
        self._settled_generation = 0  # the generation the last recovery confirmed
        self.planner = Planner(
            model=model,
            policy=policy,
            gone=self.gone,
            emit=emit,
            attempt=attempt,
            naive_migration=migration_schedule == "naive",
            on_done=on_planned,
            restarts_left=restarts_left,
        )
        self.view = WorkerStoreView(attempt, "", 0, hosted=lambda: store, seal=self.seal)
        self._statuses: dict[int, WorkerStatus] = {}
        self._next_snapshot = 0.0
        self._last_step_event = (-1, 0.0)
        self._gen_start = 0
        self._blamed: set[int] = set()  # ranks sent to be killed for a stall
        self._top_step = -1
        self._first_step_pending = False
        self._applied: dict[int, Applied] = {}  # the latest per rank: what applying cost

    # -- the agent's interface -----------------------------------------------------------

    @property
    def recovering(self) -> bool:
        """In a recovery, or waiting for the first step after one (the agent polls fast
        then: the first good step is what a recovery is measured by)."""
        return self.state is not None and (self.state.recovering or self._first_step_pending)

    def all_aware(self) -> bool:
        return self.store.check([self.keys.aware(r) for r in range(self.world_size)])

    def on_failures(self, failures: list[Failure]) -> None:
        """Workers died, hung or were lost with their node."""
        new = [f for f in failures if f not in self.failures]
        if not new:
            return
        self.failures += new
        ranks = {f.rank for f in new}
        self.gone |= {f.rank for f in new if f.kind is FailureKind.NODE_LOST}
        self.rejoins.forget(ranks)
        if self.state is None and not self._start():
            self._fatal = f"ranks {sorted(ranks)} failed before training started"
            return
        # D learns from failures: one per node that lost workers (a node's workers
        # usually go together), over the devices that ran until now.
        per_node = max(1, self.model.workers_per_node)
        nodes = {r // per_node for r in ranks}
        lost_nodes = {f.rank // per_node for f in new if f.kind is FailureKind.NODE_LOST}
        running = len(self.state.live) if self.state is not None else 0
        self.model.expose(
            time.monotonic(),
            running - len(ranks),
            failures=len(nodes),
            node_failures=len(lost_nodes),
        )
        if self.state is not None and self.state.phase is rc.Phase.RUNNING:
            self._note_progress(self._snapshot(time.monotonic()))  # the step a restart loses
        cause = root_cause(new)
        self._apply(rc.Failed(frozenset(ranks), summary(cause) if cause else ""))
        self._ask_replacements(ranks)

    def can_adopt(self, ranks: list[int]) -> bool:
        """Whether a hot spare node can take these ranks: lost with their node (seen
        here), and each with a replacement left."""
        return all(r in self.gone and self.rejoins.can_replace(r) for r in ranks)

    def adopt(self, ranks: list[int]) -> None:
        """A hot spare node took these ranks of a lost node (launcher/leader.py): they
        can be replaced again, there."""
        self.gone.difference_update(ranks)  # (the planner holds this set)
        self._mirror_due = self.on_settled is not None  # a successor must not count them gone
        self._ask_replacements(ranks)

    def _ask_replacements(self, ranks: Iterable[int]) -> None:
        """Replacements for ``ranks``, where their node lives and budget is left."""
        asked = self.rejoins.request(ranks, gone=self.gone, put=self._put_respawn)
        if asked:
            self.emit("respawn_requested", attempt=self.attempt, ranks=asked)

    def preempt(self) -> None:
        """A preemption notice: a Trainer's members stop at a step a recovery brings them
        to (rc.Preempt), once the job is described as one. The drop-in's members agree on
        the step in their commit (chameleon_runtime.preemption): no recovery for them."""
        self._preempting = True

    def _preempt_if_due(self) -> None:
        if not self._preempting or self.state is None or self.state.stopping:
            return
        if self._described() and self.model.description.model != "DataParallel":
            self._apply(rc.Preempt())

    def tick(self) -> InPlaceOutcome:
        if self._fatal is not None:
            return InPlaceOutcome(restart=True, reason=self._fatal)
        if self.state is None and not self._start():
            return InPlaceOutcome()
        self._preempt_if_due()
        for raw in self._inbox():
            body = self.seal.open(raw, self.keys.inbox)
            if body is None:  # not a worker of this job
                continue
            try:
                message = INBOX.validate_json(body)
            except ValidationError as exc:
                # Signed with our token, so one of our workers: another version of the
                # protocol, or a bug. Said, never fatal to the job.
                self.emit("bad_message", attempt=self.attempt, error=str(exc).splitlines()[0])
                continue
            if isinstance(message, Ready):
                report = rc.Report(
                    message.after,
                    message.applied,
                    message.step,
                    tuple(message.held),
                    message.reason,
                    pending=message.pending,
                    committed=tuple(message.committed) if message.committed else None,
                )
                self._apply(rc.ReadyReported(message.rank, report))
            elif isinstance(message, Applied):
                self._applied[message.rank] = message
                # On one host the clocks agree; across hosts the state machine bounds
                # what skew can do (never before the phase began, nor after this read).
                lag = max(0.0, time.time() - message.sent_at) if message.sent_at else 0.0
                self._apply(rc.AppliedReported(message.rank, message.generation, lag))
            elif isinstance(message, Joined) and self.rejoins.up(
                message.rank, message.count, message.generation
            ):
                self._next_snapshot = 0.0  # admitted at the next look, now

        answer = self.planner.answer(self.plans[0])
        if answer is not None:
            planned, message = answer
            if message is not None:
                self.plans[planned.generation] = message
            self._apply(planned)
        now = time.monotonic()
        if self.state.phase is rc.Phase.RUNNING and (
            now >= self._next_snapshot or self._first_step_pending
        ):
            statuses = self._snapshot(now)
            self._next_snapshot = now + self.speeds.look_period_s(statuses, SNAPSHOT_PERIOD_S)
            self._while_running(statuses, now)
            if self.rejoins.announced or self.rejoins.joined:
                # A replacement is up or settling: its admission and the judgement of the
                # layout with it wait for a look at the workers, so look often meanwhile
                # (a second's period cost the replacement up to two seconds).
                self._next_snapshot = now + REJOIN_SNAPSHOT_PERIOD_S
        self._apply(rc.Tick())
        if self._mirror_due:
            self._mirror()
        if self.state.phase is rc.Phase.ENDED:
            return InPlaceOutcome(restart=True, reason=self._fatal or "restart")
        return InPlaceOutcome()

    def close(self) -> None:
        self.planner.close()

    def _mirror(self) -> None:
        snap = self.snapshot()
        if snap is None or snap == self._mirrored:
            return
        self.on_settled(snap)
        self._mirrored = snap
        self._mirror_due = snap["description"] is None  # the workers write it soon

    # -- the state machine ---------------------------------------------------------------

    def _start(self) -> bool:
        """The state machine starts from generation 0, once its chief published it (or,
        where the script left the layout to the planner, once this leader did)."""
        if not self.store.check([self.keys.plan(0)]):
            self._plan_launch()
            if not self.store.check([self.keys.plan(0)]):
                return False
        body = self.seal.open(self.store.get(self.keys.plan(0)), self.keys.plan(0))
        if body is None:
            return False
        first = PlanMessage.model_validate_json(body)
        if first.generation != 0:
            return False
        self.plans[0] = first
        plan = first.plan.to_plan()
        self.state = rc.State.initial(
            world=frozenset(range(self.world_size)),
            layout={s.worker: (s.first_layer, s.end_layer) for s in plan.stages},
            resume_step=first.resume_step,
            timeouts=self._timeouts,
        )
        self._gen_start = first.resume_step
        self._mirror_due = self.on_settled is not None
        # The devices have run since the workers were spawned (the coordinator itself may
        # start only at the first failure).
        self.model.expose(self.started_at or time.monotonic(), len(plan.workers))
        self.emit(
            "resumed",
            attempt=self.attempt,
            resume_step=first.resume_step,
            plan=first.plan.model_dump(mode="json"),
        )
        return True

    def _plan_launch(self) -> None:
        """Generation 0 for a job described with ``layout="auto"``: the planner's launch
        layout over every worker, published as the chief publishes a given one (every
        worker waits for it before building its layers). Written once (compare_set): a
        successor that finds it published leaves it."""
        if not self._described() or self.model.description.layout != "auto":
            return
        if self._fatal is not None:
            return
        t0 = time.perf_counter()
        # A worker already lost is left out (a replacement may join later as a spare):
        # nothing is held yet, so losing it before the launch costs nothing else.
        lost = {f.rank for f in self.failures}
        choice = self.model.launch([r for r in range(self.world_size) if r not in lost])
        if choice is None:
            d = self.model.description
            self._fatal = (
                f"no layout of the model's {len(d.layers)} layers fits {self.world_size} "
                f"workers of {d.memory_limit_bytes / 2**30:.1f} GiB"
            )
            return
        message = PlanMessage.build(
            generation=0,
            policy="launch",
            resume_step=self.model.description.resume_step,
            plan=choice.plan,
            estimated_step_s=choice.estimate.step_s,
        )
        sealed = self.seal.seal(message.model_dump_json())
        self.store.compare_set(self.keys.plan(0), "", sealed)
        self.store.set(self.keys.latest, self.seal.seal("0"))
        self.emit(
            "launch_planned",
            attempt=self.attempt,
            layout=choice.label,
            workers=len(choice.plan.workers),
            spares=self.world_size - len(choice.plan.workers),
            estimated_step_s=choice.estimate.step_s,
            search_s=time.perf_counter() - t0,
        )

    def _apply(self, event: rc.Event) -> None:
        assert self.state is not None
        self.state, actions = rc.decide(self.state, event, time.monotonic())
        for action in actions:
            self._do(action)

    def _do(self, action: rc.Action) -> None:
        if isinstance(action, rc.Abort):
            self._abort(action)
        elif isinstance(action, rc.StartPlanning):
            self._start_planning(action)
        elif isinstance(action, rc.Publish):
            self._publish(action)
        elif isinstance(action, rc.Kill):
            self.emit(
                "unresponsive", attempt=self.attempt, ranks=list(action.ranks), reason=action.reason
            )
            self.kill(list(action.ranks), action.reason, self.state.timeouts.collect_s)
        elif isinstance(action, rc.Restart):
            self._fatal = action.reason
            # what each survivor reported: why no in-place recovery was left, for a user
            # (and a developer) reading the log
            reports = self.state.reports if self.state is not None else {}
            self.emit(
                "abandoned",
                attempt=self.attempt,
                reason=action.reason,
                reached_step=action.reached,
                reports={
                    str(r): {
                        "step": v.step,
                        "applied": v.applied,
                        "after": v.after,
                        "held": [min(v.held), max(v.held) + 1] if v.held else [],
                        "pending": v.pending,
                        "reason": v.reason,
                    }  # fmt: skip
                    for r, v in sorted(reports.items())
                },
            )
        elif isinstance(action, rc.Recovered):
            self._recovered(action)
        elif isinstance(action, rc.Forget):
            self._forget(action.below)
        elif isinstance(action, rc.PhaseChanged):
            phase = RecoveryPhase(
                recovery=action.recovery, phase=action.phase.value, generation=action.generation
            )
            self.store.set(self.keys.phase, self.seal.seal(encode(phase)))
            if self.on_phase is not None:
                self.on_phase(phase)
        elif isinstance(action, rc.Note):
            self.emit(action.name, attempt=self.attempt, **action.fields)

    def _abort(self, action: rc.Abort) -> None:
        message = self.seal.seal(encode(Abort(generation=action.generation, reason=action.reason)))
        self.store.set(self.keys.abort(action.generation), message)
        assert self.state is not None
        # Everyone who may be listening: live workers and replacements on their way.
        for rank in sorted(self.state.live | self.rejoins.listening):
            self.store.queue_push(self.keys.mailbox(rank), message)
        self.emit(
            "abort",
            attempt=self.attempt,
            generation=action.generation,
            recovery=action.recovery,
            ranks=list(action.lost),
            reason=action.reason,
            last_step=self._top_step,
        )

    def _publish(self, action: rc.Publish) -> None:
        message = self.plans[action.generation]
        if self.on_publish is not None:
            self.on_publish(action.generation)
        sign = self.seal.seal
        self.store.set(self.keys.plan(action.generation), sign(message.model_dump_json()))
        self.store.set(self.keys.latest, sign(str(action.generation)))
        self.store.set(self.keys.next(action.after), sign(str(action.generation)))

    def _recovered(self, action: rc.Recovered) -> None:
        message = self.plans[action.generation]
        self.model.expose(time.monotonic(), len(message.plan.to_plan().workers))
        fields = {
            "generation": action.generation,
            "policy": message.policy,
            "resume_step": action.resume_step,
            "steps_lost": action.steps_lost,
            "reached_step": action.resume_step + action.steps_lost,
            "duration_s": action.duration_s,
            "phases_s": dict(action.phases_s),
            "last_answer": action.last_answer,
            **self._measured_parts(action.generation),
            # The model of the next transitions, moved toward what this one measured: only
            # by a recovery that made one plan (one hit by another failure ran several,
            # and its time is theirs together).
            "transition_factor": self.model.observe_transition(action.generation, action.duration_s)
            if action.generation == self._settled_generation + 1
            else self.model.transition_factor,
        }
        self._settled_generation = action.generation
        self._mirror_due = self.on_settled is not None
        self._release_reserves(action.generation)
        if action.joined:
            self.emit("rejoined", ranks=list(action.joined), taken_in=True, **fields)
        else:
            self.emit("recovered", **fields)
        self.recovered = len(self.failures)
        self._gen_start = action.resume_step
        self._last_step_event = (action.resume_step - 1, 0.0)
        self._first_step_pending = True

    def _release_reserves(self, generation: int) -> None:
        """The live workers ``generation`` leaves out kept the layers they held, in case a
        failure ended it before every member applied it (chameleon_runtime.membership):
        it is applied, so they let them go. (Its members, once it is recovered, are the
        workers of its layout: rc._applied.)"""
        assert self.state is not None
        message = self.seal.seal(encode(Settled(generation=generation)))
        for rank in sorted(self.state.live - self.state.members):
            self.store.queue_push(self.keys.mailbox(rank), message)

    def _measured_parts(self, generation: int) -> dict:
        """The workers' measured share of the transition (slowest worker per part), to
        set beside the planner's prediction in ``plan_chosen``."""
        applied = [a for a in self._applied.values() if a.generation == generation]
        if not applied:
            return {}
        return {
            "groups_s": max(a.groups_s for a in applied),
            "migration_s": max(a.migrate_s for a in applied),
            "groups_carried": all(a.carried for a in applied),
            # the collective groups each set of holders built anew, carried over
            "collectives_built": len({h for a in applied for h in a.collectives_built}),
            "collectives_carried": len({h for a in applied for h in a.collectives_carried}),
        }

    def _forget(self, below: int) -> None:
        """Delete every key of generations before ``below``; no worker reads them again."""
        gen_prefix = self.keys.prefix + "g"
        for key in self.store.list_keys():
            if key.startswith(gen_prefix):
                number = key[len(gen_prefix) :].split("/", 1)[0]
                if number.isdigit() and int(number) < below:
                    self.store.delete_key(key)
        for g in [g for g in self.plans if 0 < g < below]:
            del self.plans[g]

    def _put_respawn(self, rank: int, count: int) -> None:
        self.store.set(self.keys.respawn(rank), self.seal.seal(str(count)))

    def _inbox(self) -> list[bytes]:
        return drain(self.store, self.keys.inbox)

    # -- planning (the planner runs on its own thread) ------------------------------------

    def _described(self) -> bool:
        """Whether the model has the workers' description of the job (read once)."""
        if self.model.description is None and self.store.check([self.keys.job]):
            raw = self.seal.open(self.store.get(self.keys.job), self.keys.job)
            if raw is None:
                return False
            self.model.description = JobDescription.model_validate_json(raw)
        return self.model.description is not None

    def _start_planning(self, start: rc.StartPlanning) -> None:
        if not self._described():
            self.planner.fail(start, "the workers had not described the job yet")
            return
        self.planner.start(start, self.plans[start.base], self._statuses)

    # -- while running -----------------------------------------------------------------

    def _snapshot(self, now: float) -> dict[int, WorkerStatus]:
        """Every live worker's status, in one round trip (those that posted one)."""
        assert self.state is not None
        self._statuses = self.view.statuses(sorted(self.state.live))
        return self._statuses

    def finish(self) -> None:
        """Every worker finished: the job's last step as a step event, whenever the last
        one was (step events are sampled at most once a second; a reader of the events,
        such as a test of what stayed bounded to the end, should see the end)."""
        if self.state is None or not self.state.live:
            return
        now = time.monotonic()
        statuses = self._snapshot(now)
        done = [s.step - 1 for s in statuses.values() if s.phase == "done"]
        self._top_step = max([self._top_step, *done])
        self._tell_step(statuses, now, force=True)  # (told only when past the last told)

    def _note_progress(self, statuses: dict[int, WorkerStatus]) -> None:
        # (a survivor whose collective failed with its peer reports "ready" at once, its
        # step still the last it did: the leader's look at a failure must count it)
        steps = [
            s.step - 1 for s in statuses.values() if s.phase in ("train", "checkpoint", "ready")
        ]
        if steps:
            self._top_step = max(self._top_step, max(steps))

    def observe(self) -> None:
        """etcd is out of reach (launcher/outage.py): decide nothing, act on nothing, but
        read the workers' steps on our own store and tell them."""
        if self.state is None or self.state.phase is not rc.Phase.RUNNING:
            return
        now = time.monotonic()
        if now < self._next_snapshot:
            return
        self._next_snapshot = now + SNAPSHOT_PERIOD_S
        statuses = self._snapshot(now)
        self._note_progress(statuses)
        self._tell_step(statuses, now)

    def _while_running(self, statuses: dict[int, WorkerStatus], now: float) -> None:
        state = self.state
        assert state is not None
        self._note_progress(statuses)
        top = self._top_step
        self._described()
        self._tell_step(statuses, now)
        if self.started_at is not None and self.model.restart_s is None and top >= 0:
            self.model.restart_s = now - self.started_at  # a restart costs this start-up
        collect_s = self.progress.step_timeout_s()  # a survivor may be mid-step at an abort
        if collect_s != state.timeouts.collect_s:
            self.state = replace(state, timeouts=replace(state.timeouts, collect_s=collect_s))
        if (
            self.model.description is not None
            and not self.rejoins.waiting
            and not self.speeds.slowed
        ):
            # (a replacement starting up competes for the host, a straggler slows the
            # steps it is in: no fit meanwhile, or the model would take either for the
            # host's own pace)
            current = self.plans[state.generation].plan.to_plan()
            fitted = self.model.fitted_generation
            self.model.settle(current, statuses, state.generation, top - self._gen_start)
            if self.model.fitted_generation != fitted:
                if self.on_settled is not None:
                    self._mirror_due = True  # a successor should plan on the new fit
                self._rebalance_launch(current, statuses)
        self._admit(statuses, top)
        self.progress.observe(statuses, now)
        self._watch_speeds(statuses, now)
        stalls = self.progress.stalled(statuses, now)
        if stalls:
            from launcher.watch import blame

            for rank, why in blame(statuses, stalls).items():
                if rank not in self._blamed:
                    self._blamed.add(rank)
                    self.emit("stalled", attempt=self.attempt, rank=rank, reason=why)
                    self.kill([rank], why, stalls[rank].stalled_s)

    def _watch_speeds(self, statuses: dict[int, WorkerStatus], now: float) -> None:
        """A worker slower than its peers is told (launcher/stragglers.py)."""
        state = self.state
        if self.model.description is None or state.generation not in self.plans:
            return
        plan = self.plans[state.generation].plan
        stages = {
            s.worker: (s.first_layer, s.end_layer) for s in plan.stages if s.worker in state.live
        }
        layer_s = [x.forward_s + x.backward_s for x in self.model.description.layers]
        # (with the runtime's own time per pass where the model has measured it: what a
        # cheap stage's passes mostly are)
        units = unit_costs(stages, layer_s, 2 * self.model.pass_s())
        self.speeds.forget(set(self.speeds.stragglers.found) - set(units))
        current = plan.to_plan()
        load = {w: n for w, n in current.load().items() if w in units}
        for found in self.speeds.observe(statuses, state.generation, units, now, stages, load):
            status = statuses[found.rank]
            self.emit(
                "straggler_recovered" if found.recovered else "straggler",
                attempt=self.attempt, rank=found.rank, factor=round(found.factor, 2),
                step=status.step, generation=state.generation,
                busy_s_per_mb=status.busy_s_per_mb,
                **({"worst_factor": round(found.worst, 2)} if found.worst is not None else {}),
            )  # fmt: skip
        if self._stragglers == "auto":
            # CPU workers that outnumber their host's cores run at the scheduler's shares,
            # which differ from one to the next with nothing slow (seen at 1.4x on this
            # 2-core host): told, not planned around, unless --stragglers on.
            cores = self.model.description.host_cores
            per_host = self.model.workers_per_machine or (
                self.model.workers_per_node * max(1, self.model.nodes_per_host)
            )
            self.speeds.plan_around = not (cores and per_host > cores)
        if self.speeds.plan_around:  # (failures' and growths' plans at the speeds seen)
            self.model.slow = tuple(sorted(self.speeds.stragglers.found.items()))
        if self.rejoins.waiting or state.phase is not rc.Phase.RUNNING:
            return
        from planner.choice.stragglers import break_even_s, dealt_unevenly, straggler_choice

        def choose(slow: tuple[tuple[int, float], ...], horizon_s: float) -> bool:
            # The horizon from which a move pays, worked out once per plan and slow set
            # (factors to a tenth): each look compares the time the slowdown has lasted.
            key = (state.generation, tuple((w, round(f, 1)) for w, f in slow))
            if self._break_even[0] != key:
                job = replace(self.model.job(current, statuses, state.generation), slow=slow)
                choice = straggler_choice(job, current, 1.0, leave_out=False, repartition=False)
                self._break_even = (key, break_even_s(choice))
            needed = self._break_even[1]
            return needed is not None and horizon_s >= needed

        move = self.speeds.move(now, dealt_unevenly(current), choose)
        if move is not None:
            self._apply(move)

    def _tell_step(
        self, statuses: dict[int, WorkerStatus], now: float, force: bool = False
    ) -> None:
        """A step event at most once a second (the first of a generation, and the job's
        last, at once)."""
        state = self.state
        assert state is not None
        top = self._top_step
        last, at = self._last_step_event
        if top > last and (force or now - at >= 1.0 or last < self._gen_start):
            chief = statuses.get(min(state.live)) if state.live else None
            peaks = [
                (s.peak_bytes, r)
                for r, s in statuses.items()
                if s.peak_bytes is not None and s.generation == state.generation
            ]
            peak = max(peaks, default=(None, None))
            self.emit(
                "step",
                step=top,
                generation=state.generation,
                store_keys=self.store.num_keys(),
                rank=min(state.live) if chief else None,
                fds=chief.fds if chief else None,
                threads=chief.threads if chief else None,
                # the largest worker's tensors at their peak, this generation
                peak_bytes=peak[0],
                peak_rank=peak[1],
            )
            self._last_step_event = (top, now)
            self._first_step_pending = False

    def _rebalance_launch(self, current: Any, statuses: dict[int, WorkerStatus]) -> None:
        """A layout the planner launched on (``pipeline_stages="auto"``) was chosen before
        any step was measured: once generation 0's steps have calibrated the model, judge
        it again as a growth is judged (speed, the transition, the risk; planner.choice.
        selection.growth_choice) and re-partition in place when another layout over the
        live workers pays. Once per job: a later generation was planned calibrated."""
        state = self.state
        if (
            state.generation != 0
            or self.model.description.layout != "auto"
            or self.policy not in ("auto", "reparallelize")
        ):
            return
        job = self.model.job(current, statuses, state.generation)
        growth = self.model.growth(job, current, sorted(state.live))
        if growth is None:
            return
        self._emit_growth("rebalance", growth)
        self._apply(rc.Rebalance())

    def _admit(self, statuses: dict[int, WorkerStatus], top: int) -> None:
        """Replacements up as spares of this generation join the live set; once their
        start-up stops competing for the host, they are taken into the plan if it pays."""
        up = self.view.statuses(sorted(self.rejoins.announced))  # one round trip for all
        generation = self.state.generation
        spares = {r for r, s in up.items() if s.phase == "spare" and s.generation == generation}
        if spares:
            self.rejoins.admit(spares, top)
            self._apply(rc.Admit(frozenset(spares)))
        joined = self.rejoins.settled(top)
        if joined:
            self._grow(joined, statuses)

    def _grow(self, joined: list[int], statuses: dict[int, WorkerStatus]) -> None:
        """Take ``joined`` into the plan when the planner finds that it pays; never under a
        forced reroute (the user asked to keep the layout) or restart."""
        state = self.state
        growth = None
        if self.policy in ("auto", "reparallelize") and self.model.description is not None:
            current = self.plans[state.generation].plan.to_plan()
            self.model.refit()  # on steps run since the replacements' start-up
            job = self.model.job(current, statuses, state.generation)
            growth = self.model.growth(job, current, sorted(state.live))
        if growth is None:
            self.emit("rejoined", attempt=self.attempt, ranks=joined, taken_in=False)
            return
        self._emit_growth("rejoin", growth, ranks=joined)
        self._apply(rc.Grow(frozenset(joined)))

    def _emit_growth(
        self, name: str, growth: tuple[float, float, float, str], **fields: Any
    ) -> None:
        """A growth's or a rebalance's event: the step now and after, the transition."""
        current_s, better_s, transition_s, label = growth
        self.emit(
            name,
            attempt=self.attempt,
            generation=self.state.generation,
            **fields,
            step_s=current_s,
            estimated_step_s=better_s,
            transition_s=transition_s,
            label=label,
        )

    # -- a successor ---------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any] | None:
        """What a successor needs, taken when a generation has settled (None otherwise)."""
        state = self.state
        if (
            state is None
            or state.phase is not rc.Phase.RUNNING
            or state.confirmed != state.generation
        ):
            return None
        self._described()  # the workers wrote it before their first step; read it if not yet
        description = self.model.description
        return {
            "generation": state.generation,
            "plan": self.plans[state.generation].model_dump_json(),
            "plan0": self.plans[0].model_dump_json(),
            "live": sorted(state.live),
            "gone": sorted(self.gone),
            "resume_step": state.resume_step,
            "next_id": state.next_id,
            "recovery": state.recovery,
            "failures": len(self.failures),
            "description": description.model_dump_json() if description is not None else None,
            # the planner's costs as this run has learned them: a successor plans on them
            "calibration": self.model.snapshot(),
        }

    def resume(self, snap: dict[str, Any], known: list[Failure], next_gen: int) -> None:
        """Start this (a successor's) coordinator where the snapshot left off. ``known``: the
        round's failures the old leader had handled; ``next_gen``: the newest generation
        number it wrote before publishing."""

        current = PlanMessage.model_validate_json(snap["plan"])
        self.plans = {
            0: PlanMessage.model_validate_json(snap["plan0"]),
            current.generation: current,
        }
        plan = current.plan.to_plan()
        layout = {s.worker: (s.first_layer, s.end_layer) for s in plan.stages}
        generation = int(snap["generation"])
        state = rc.State.initial(
            world=frozenset(snap["live"]),
            layout=layout,
            resume_step=int(snap["resume_step"]),
            timeouts=self._timeouts,
            generation=generation,
        )
        self.state = replace(
            state,
            next_id=max(int(snap["next_id"]), next_gen + 1, state.next_id),
            recovery=int(snap["recovery"]),
        )
        self.gone |= set(snap["gone"])  # the planner holds this set: updated in place
        self.failures = list(known)
        self.recovered = len(known)
        self._settled_generation = generation
        self._gen_start = int(snap["resume_step"])
        if snap.get("description"):
            self.model.description = JobDescription.model_validate_json(snap["description"])
        if snap.get("calibration"):
            self.model.restore(snap["calibration"])
        self.model.expose(time.monotonic(), len(plan.workers))
        self.emit(
            "taken_over",
            attempt=self.attempt,
            generation=generation,
            live=sorted(snap["live"]),
            resume_step=int(snap["resume_step"]),
        )
