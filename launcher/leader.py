"""The leader agent's job-wide duties for one round, on top of what every agent does:
watch the other agents' heartbeats and count a silent node's ranks as failed, hand
failures of a chameleon_runtime job to the in-place coordinator (launcher/coordinator.py),
route its kill requests to the node that runs the rank, and take the round's decision
(``launcher.supervisor.decide``) for everything the coordinator does not recover in place.
"""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from launcher.calibration import JobModel
from launcher.coordinator import Coordinator
from launcher.rendezvous import ControlPlane, NodeInfo, World
from launcher.supervisor import Action, Failure, FailureKind, RoundView, decide, root_cause
from launcher.watch import Timeouts as WatchTimeouts

if TYPE_CHECKING:
    import threading

    from torch.distributed import TCPStore

    from chameleon_runtime.protocol.seal import Seal
    from launcher.args import RunArgs
    from launcher.events import EventLog
    from launcher.local import LocalGroup
    from launcher.outage import ControlLink
    from planner.job.failures import FailureRate
    from planner.job.workload import Cluster


class AgentView(Protocol):
    """What the leader reads and updates of the agent it runs in (launcher/agent.py): the
    job's settings and the round's bookkeeping that outlive one leader."""

    args: RunArgs
    events: EventLog
    seal: Seal
    failures: list[Failure]
    restarts_used: int
    beat_seen: dict[str, float]  # node key -> when its heartbeat last moved
    worker_store: TCPStore | None
    failure_rate: FailureRate
    planner_cluster: Cluster | None
    started_at: float | None
    nudge: threading.Event
    link: ControlLink  # what the store refused, held and sent once it answers

    @property
    def stop_signal(self) -> int | None: ...

    def record(self, failures: list[Failure]) -> None: ...


class Leader:
    def __init__(
        self,
        agent: AgentView,
        control: ControlPlane,
        world: World,
        group: LocalGroup,
        takeover: dict | None = None,
    ) -> None:
        """``takeover``: this agent was elected mid-round, with the old leader's snapshot
        and newest generation number (launcher/coordinator.py, a successor)."""
        self.agent = agent
        self.control = control
        self.world = world
        self.group = group
        now = time.monotonic()
        self.keys = [n.key for n in world.nodes]
        self.beats = {k: (control.beats(k), now) for k in self.keys}
        # Nodes an earlier leader of this round lost are not lost again.
        self.lost: set[str] = (
            control.lost_nodes(world.attempt, self.keys) if control.elected else set()
        )
        self.coordinator: Coordinator | None = None
        # Every worker runs chameleon_runtime: recover in place (a successor knows so).
        self.aware = takeover is not None
        self.takeover = takeover

    @property
    def recovering(self) -> bool:
        return self.coordinator is not None and self.coordinator.recovering

    def lead(self) -> None:
        """One look at the job: lost nodes, in-place recovery, the round's decision."""
        a, control = self.agent.args, self.control
        self._watch_nodes()
        if control.decision(self.world.attempt) is not None:
            return
        world = self.world
        notices = control.preemptions(world.attempt, [k for k in self.keys if k not in self.lost])
        if notices and self.coordinator is not None:
            self.coordinator.preempt()
        failures, restart_reason = self._recover_in_place(control.failures(world.attempt))
        # (after the coordinator has seen this look's failures: a lost node's ranks must be
        # gone there before a spare takes them)
        waiting = [e for e in control.joined(world.attempt + 1) if e["key"] not in self.keys]
        waiting = self._adopt(waiting)
        world = self.world
        view = RoundView(
            attempt=world.attempt,
            restarts_used=self.agent.restarts_used,
            max_restarts=a.max_restarts,
            min_nodes=a.min_nodes,
            max_nodes=a.max_nodes,
            nodes=len(world.nodes),
            nodes_lost=len(self.lost),
            nodes_done=control.done(world.attempt, [k for k in self.keys if k not in self.lost]),
            nodes_waiting=len(waiting),
            failures=tuple(failures),
            stop_signal=self.agent.stop_signal,
            earlier_causes=tuple(self.agent.earlier_causes),
            preempted=signal.Signals(notices[0]["signal"]).name if notices else None,
            preempt_overdue=any(time.time() > n["deadline"] for n in notices),
        )
        decision = decide(view)
        if restart_reason is not None and decision.action is Action.RESTART:
            decision = replace(decision, reason=f"{restart_reason}; {decision.reason}")
        if decision.action is Action.CONTINUE:
            return
        if decision.action is Action.FINISH and self.coordinator is not None:
            # the job's last step event: an event only, never in the way of the job's end
            # (a store or etcd gone with the workers)
            with contextlib.suppress(Exception):
                self.coordinator.finish()
        self.agent.record(failures)
        cause = root_cause(failures)
        if decision.counts_as_restart:
            self.agent.restarts_used += 1
            self.agent.earlier_causes.append(cause.signature if cause else None)
        self.agent.events.emit(
            "decision",
            attempt=world.attempt,
            action=decision.action.value,
            reason=decision.reason,
            exit_code=decision.exit_code,
            policy="restart" if decision.action is Action.RESTART else None,
            root_rank=cause.rank if cause else None,
        )
        control.decide(
            world.attempt,
            {
                "action": decision.action.value,
                "reason": decision.reason,
                "exit_code": decision.exit_code,
                "restarts_used": self.agent.restarts_used,
                "earlier_causes": self.agent.earlier_causes,
            },
        )
        if self.coordinator is not None:
            self.coordinator.close()

    def _adopt(self, waiting: list[dict]) -> list[dict]:
        """Hot spares: agents waiting for the next round while a node of this one is lost
        take its ranks in place, one node each (the same worker count), instead of a
        restart. The lost ranks become replaceable again: the coordinator asks for their
        replacements, the adopted agent starts them as it would a dead worker's, and
        they join as spares that the planner takes in when that pays (launcher/
        rejoin.py). Returns the agents still waiting."""
        vacant = [n for n in self.world.nodes if n.key in self.lost]
        coordinator = self.coordinator
        if not vacant or not waiting or coordinator is None or not self.aware:
            return waiting
        attempt, left = self.world.attempt, list(waiting)
        for node in vacant:
            ranks = list(range(node.rank_offset, node.rank_offset + node.nproc))
            # Only ranks the coordinator has counted gone, each with a replacement left
            # (--max-rejoins): a node adopted with nothing to start would never finish.
            if not coordinator.can_adopt(ranks):
                continue
            spare = next((e for e in left if e["nproc"] == node.nproc), None)
            if spare is None:
                continue
            new = replace(
                node, key=spare["key"], host=spare["host"], machine=spare.get("machine", "")
            )
            world = replace(
                self.world,
                nodes=tuple(new if n.key == node.key else n for n in self.world.nodes),
            )
            # The store first, then our own view of it: a write that fails (etcd out of
            # reach) leaves nothing half done here, and is tried again at the next look.
            # The round's world as it is now: the adopted agent reads it, as would a
            # successor leader (etcd).
            self.control.put(f"r{attempt}/world", world.to_json())
            self.control.put(f"r{attempt}/adopt/{new.key}", new.__dict__)
            left.remove(spare)
            self.world = world
            self.keys = [n.key for n in world.nodes]
            self.lost.discard(node.key)
            self.beats[new.key] = (self.control.beats(new.key), time.monotonic())
            self.agent.beat_seen[new.key] = time.time()
            self.agent.events.emit(
                "node_adopted",
                attempt=attempt,
                node=node.node_rank,
                host=new.host,
                lost_host=node.host,
                ranks=ranks,
            )
            coordinator.adopt(ranks)
        return left

    def observe(self) -> None:
        """etcd is out of reach: nothing is decided, but the workers' steps are told."""
        if self.coordinator is not None:
            self.coordinator.observe()

    def _watch_nodes(self) -> None:
        """An agent whose heartbeat count stops moving for --heartbeat-timeout is lost
        (read on the leader's clock: no clock skew); its ranks failed with it."""
        now = time.monotonic()
        for node in self.world.nodes:
            if node.key == self.control.key or node.key in self.lost:
                continue
            alive = self.control.node_alive(node.key)
            if alive is not None:  # a lease: gone after --heartbeat-timeout of silence
                if alive:
                    self.agent.beat_seen[node.key] = time.time()
                    continue
                # Its key went when the lease ran out: one TTL after its last refresh.
                self._lose(node, self.agent.args.heartbeat_timeout_s)
                continue
            count = self.control.beats(node.key)
            if count != self.beats[node.key][0]:
                self.beats[node.key] = (count, now)
                self.agent.beat_seen[node.key] = time.time()
                continue
            silent = now - self.beats[node.key][1]
            if silent < self.agent.args.heartbeat_timeout_s:
                continue
            self._lose(node, silent)

    def _mirror(self, snapshot: dict) -> None:
        self.control.put(f"r{self.world.attempt}/inplace", snapshot)

    def _note_generation(self, generation: int) -> None:
        self.control.put(f"r{self.world.attempt}/next_gen", generation)

    def _lose(self, node: NodeInfo, silent: float) -> None:
        """Count ``node`` lost. The store's mark first: refused (etcd out of reach), nothing
        has changed here and the next look tries again. Its ranks' failures then go out
        through the agent's link, which holds what the store refuses and sends it, in
        order, once it answers (launcher/outage.py)."""
        if self.control.elected:
            self.control.mark_lost(self.world.attempt, node.key)
        self.lost.add(node.key)
        self.agent.events.emit("node_lost", node=node.node_rank, host=node.host, silent_s=silent)
        failures = lost_with(node, self.world.attempt, time.time() - silent, "stopped heartbeating")
        for failure in failures:
            self.agent.events.emit("failure", **failure.to_json())
        self.agent.link.report(self.control, failures)

    def _coordinator(self) -> Coordinator | None:
        if self.coordinator is None:
            agent, world = self.agent, self.world
            store = agent.worker_store
            if store is None:
                return None
            a = agent.args
            watch = WatchTimeouts(a.heartbeat_timeout_s, a.step_timeout_s, a.startup_timeout_s)
            model = JobModel(
                emit=agent.events.emit,
                rate=agent.failure_rate,
                num_nodes=len(world.nodes),
                workers_per_node=world.nodes[0].nproc,
                nodes_per_host=max(
                    sum(1 for m in world.nodes if m.host == n.host) for n in world.nodes
                ),
                # (the planner's hosts stay the addresses, failure domains in join order;
                # only whether CPU workers outnumber their cores is judged by machine)
                workers_per_machine=max(
                    sum(m.nproc for m in world.nodes if _machine(m) == _machine(n))
                    for n in world.nodes
                ),
                cluster=agent.planner_cluster,
            )
            self.coordinator = Coordinator(
                store=store,
                attempt=world.attempt,
                world_size=world.world_size,
                emit=agent.events.emit,
                kill=self._kill,
                model=model,
                policy=a.policy,
                migration_schedule=a.migration_schedule,
                stragglers=a.stragglers,
                watch=watch,
                max_rejoins=a.max_rejoins,
                started_at=agent.started_at,
                on_phase=self.group.on_recovery_phase,
                on_planned=agent.nudge.set,
                on_settled=self._mirror if self.control.elected else None,
                on_publish=self._note_generation if self.control.elected else None,
                seal=agent.seal,
                # a restart the launcher may no longer make is not a plan
                restarts_left=lambda: a.max_restarts - agent.restarts_used,
            )
            if self.takeover is not None:
                snap = self.takeover["snapshot"]
                known = self.control.failures(world.attempt)[: snap["failures"]]
                self.coordinator.resume(snap, known, self.takeover["next_gen"])
        return self.coordinator

    def _recover_in_place(self, failures: list[Failure]) -> tuple[list[Failure], str | None]:
        """For chameleon_runtime workers: hand failures to the in-place coordinator. Returns
        the failures the ordinary decision should still see (none while recovering in
        place; all of them when the coordinator falls back to a restart) and why."""
        coordinator = self._coordinator()
        if coordinator is None:
            return failures, None
        new = [f for f in failures if f not in coordinator.failures]
        errors = [f for f in new if f.script_error]
        if errors:
            # An exception in the script ends the job (or restarts it, as --max-restarts
            # allows), with that member's error and code; never recovered in place.
            return new, f"rank {errors[0].rank} raised {errors[0].message}"
        if not self.aware:
            try:
                self.aware = coordinator.all_aware()
            except Exception:
                return failures, None
            if not self.aware:
                return failures, None
            self.agent.events.emit(
                "in_place_enabled", attempt=self.world.attempt, world_size=self.world.world_size
            )
        self.agent.record(failures)
        coordinator.on_failures(failures)
        outcome = coordinator.tick()
        if outcome.restart:
            # The cause is what this recovery could not handle, not a failure recovered
            # from in place before it.
            return coordinator.failures[coordinator.recovered :] or failures, outcome.reason
        return [], None

    def _kill(self, ranks: list[int], reason: str, silent_s: float) -> None:
        """Kill ranks as hung wherever they run (the coordinator's verdict)."""
        for rank in ranks:
            node = next(
                (n for n in self.world.nodes if n.rank_offset <= rank < n.rank_offset + n.nproc),
                None,
            )
            if node is None:
                continue
            if node.key == self.control.key:
                self.group.kill_hung(rank, reason, silent_s)
            elif node.key not in self.lost:
                self.control.request_kill(self.world.attempt, node.key, rank, reason, silent_s)


def lost_with(node: NodeInfo, attempt: int, since: float, why: str) -> list[Failure]:
    """The failures of every rank of a lost node, dated by its last heartbeat."""
    return [
        Failure(
            rank=node.rank_offset + local,
            node=node.node_rank,
            kind=FailureKind.NODE_LOST,
            attempt=attempt,
            failed_at=since,
            detected_at=time.time(),
            message=f"agent on {node.host} {why}",
        )
        for local in range(node.nproc)
    ]


def _machine(node: NodeInfo) -> str:
    return node.machine or node.host
