"""The agent: one per node. Joins the job, runs this node's workers round after round, and
carries out the leader's decisions (``launcher.supervisor.decide``).

Every agent runs the same loop; the one hosting the control store is the leader and also
takes the job-wide view (launcher/leader.py): failures from every node, finished, lost and
waiting nodes, in-place recovery; it decides and publishes the decision. On the TCPStore
(static, c10d), if the leader's node is lost the store goes with it: the other agents stop
their workers and exit (as with torchrun's c10d store). On etcd the leader is elected and
another agent takes over (``_take_over``). The warm fork server every worker is forked
from is launcher/warm.py.

Joining (``# -- joining the job``): where the control store is, the rendezvous of several
nodes (``_join_job``, ``_world``) and the shortcut of one node, which needs none
(``_start_single_node``).

Succession (``# -- a successor within a round``):Leaders that follow one another within a round (``--rdzv-backend etcd``): the election of a successor when the leader's lease runs out,
the new worker store it serves, and every agent pointing its workers there.

The round's workers meet on a store the leader hosts; when its node is lost, so is the
store. The successor serves a new one and publishes its address under ``r<a>/
worker_store`` with the next epoch; each agent (the successor too) writes it to its
workers' store file (chameleon_runtime.storeaddr), where their connections look when the
old store stops answering, and reads its workers' statuses there. With the old leader's
snapshot (launcher/coordinator.py, Coordinator.snapshot) the successor recovers in place; without one it decides
as the old leader would have, which for a lost node is a restart.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

from chameleon_runtime.protocol.messages import StoreAddress
from chameleon_runtime.protocol.seal import TOKEN_ENV, Seal
from launcher import early
from launcher.args import RunArgs
from launcher.etcd import Fenced, JobEnded
from launcher.events import EventLog
from launcher.exitcodes import FAULTS_NOT_FIRED, JOB_FAILED, REQUEUE
from launcher.faults import FaultLedger, unreported
from launcher.health import HealthCheck
from launcher.leader import Leader, lost_with
from launcher.local import LocalGroup
from launcher.outage import ControlLink
from launcher.preload import modules_for, script_imports
from launcher.rendezvous import (
    RUN_ID_KEY,
    ControlPlane,
    NodeInfo,
    RendezvousError,
    World,
    beat_until,
    control_endpoint,
    node_key,
)
from launcher.settings import STORE_FILE, RoundSettings, worker_command
from launcher.store import (
    StoreError,
    bind_listener,
    host_store,
    is_loopback,
    put_json,
    serve_store,
)
from launcher.supervisor import Action, Failure, FailureKind
from launcher.warm import ForkServer, runs_folder, server_env
from launcher.watch import Timeouts as WatchTimeouts
from launcher.worker_store import WorkerStoreView
from launcher.workers import Console, Reaper
from planner.estimator.transition import RECOVERY_POLL_S
from planner.job.failures import DEFAULT_DEVICE_MTBF_H, FailureRate

# Workers of a failed round are useless (their collectives are broken): give them a short
# grace to flush, not the full shutdown timeout.
RESTART_GRACE_S = 2.0
# A fenced agent whose main loop has not ended the run by then is blocked in a store call
# that will not return: it ends itself (Agent._end_fenced).
FENCE_GRACE_S = 3.0


class JobError(RuntimeError):
    """The job could not be set up or lost its control plane; ``str()`` is one line."""


FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
SYNC_PERIOD_S = 0.25
# The first round waits this long for the fork server's imports, then starts fresh workers.
WARM_START_WAIT_S = 120.0


@dataclass
class Outcome:
    exit_code: int
    reason: str
    failures: list[Failure]
    run_dir: Path


class Agent:
    def __init__(self, args: RunArgs, *, console: Console, events_listener=None) -> None:
        self.args = args
        self.console = console
        self.run_id = (
            args.rdzv_id if args.rdzv_id != "none" or not args.standalone else uuid.uuid4().hex[:12]
        )
        # The job token signs every control message (chameleon_runtime.protocol.seal.Seal): given to every
        # agent of a multi-node job, made here for one node.
        token = args.rdzv_conf.get("token") or os.environ.get(TOKEN_ENV) or None
        if token is None and args.max_nodes == 1:
            token = secrets.token_hex(16)
        self.token = token
        self.seal = Seal(token, self.run_id, on_refused=self._refused)
        self.run_dir = runs_folder(args.log_dir) / f"{self.run_id}_{uuid.uuid4().hex[:6]}"
        events_path = Path(args.events) if args.events else self.run_dir / "events.jsonl"
        self.events = EventLog(events_path)
        if events_listener is not None:
            self.events.listen(events_listener)
        self.command = worker_command(
            args.script,
            args.script_args,
            module=args.module,
            no_python=args.no_python,
            run_path=args.run_path,
        )
        self._signal: int | None = None
        self.health = HealthCheck(args.health_check) if args.health_check else None
        # A preemption notice (--signals-to-handle): its signal and when its grace ends
        # (wall clock: other nodes' leader compares it), and whether the workers heard.
        self._preempt: int | None = None
        self._preempt_deadline = 0.0
        self._preempt_told = False
        self._stop_heartbeat = threading.Event()
        self._group: LocalGroup | None = None  # this round's workers, for the fence
        self._ended = False  # the run's outcome is decided (_finish)
        # (exit code, reason), once _ended; until then what the end mark says of a run
        # that ended by an exception (launcher/etcd_control.py close)
        self._outcome: tuple[int, str] = (JOB_FAILED, "the leader's agent ended without a decision")
        self._joined: set[int] = set()  # the rounds this agent has joined
        # Through etcd's outages, and fenced once its lease is known lost (launcher/outage.py).
        self.link = ControlLink(args.control_outage_timeout_s, self.events.emit, console.say)
        # Set by the planner's thread when a decision is ready: the loop publishes it at
        # once instead of on its next poll (launcher/planning.py).
        self.nudge = threading.Event()
        self.failures: list[Failure] = []
        self.restarts_used = 0
        # The root causes of the attempts restarted so far (Failure.signature; the
        # supervisor's loop guard reads them).
        self.earlier_causes: list[str | None] = []
        self.control: ControlPlane | None = None
        self.reaper: Reaper | None = None
        self.forkserver: ForkServer | None = None
        self._server_awaited = False  # the first round waited for the fork server
        self._server_early = False  # started by python -m chameleon_cli (launcher/early.py)
        # Leader: the last round's world, and when each node's heartbeat last moved.
        self._last_world: World | None = None
        self.beat_seen: dict[str, float] = {}
        self.worker_store = None  # the leader hosts this round's worker store
        self.started_at: float | None = None  # when this round's workers were spawned
        # --config: the cluster's figures that workers cannot measure (device memory,
        # links, restart cost), read now so that a bad file fails before any worker starts.
        self.planner_cluster = None
        self.fault_ledger = FaultLedger()  # what --inject-fault did in earlier rounds
        # D's prior (planner.job.failures): --mtbf, else the config's, else Llama 3's rate.
        self.failure_rate = FailureRate(DEFAULT_DEVICE_MTBF_H * 3600)
        if args.config:
            from planner.config import load_job  # raises ConfigError, one line

            configured = load_job(args.config)
            self.planner_cluster = configured.cluster
            self.failure_rate = configured.failure_rate()
        if args.mtbf_s is not None:
            self.failure_rate = replace(
                self.failure_rate, fixed_s=args.mtbf_s, fixed_source="--mtbf"
            )

    # -- signals ---------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: object) -> None:
        first_notice = self._preempt is None and self._signal is None
        if signum in self.args.preempt_signals and first_notice:
            # (no nudge.set() here: a handler runs between any two bytecodes of the main
            # thread, which may hold that Event's lock in its wait: a deadlock)
            self._preempt = signum
            self._preempt_deadline = time.time() + self.args.preemption_grace_s
        elif self._signal is None:  # a stop, or a second notice: stop now
            self._signal = signum

    def _on_fenced(self, why: str) -> None:
        """From the heartbeat thread: the job counts this node lost. Its workers are
        killed here and now, not when the main loop next looks (which may be blocked in
        a call to the store that will not answer); the loop then ends the run."""
        if self.link.fenced is not None:
            return  # (the heartbeat and the lease watch may both find it)
        self.link.fence(why)
        # Told at once, from this thread: the main loop's "fenced" may come late or never
        # (blocked in a store call), and a cut-off node that was not stopped must show
        # whether it ever found its lease gone.
        self.events.emit("lease_lost", detail=why, workers=self._group is not None)
        group = self._group
        if group is not None:
            group.kill_now()
        self.nudge.set()  # (the heartbeat thread, not a signal handler: no deadlock)
        ender = threading.Timer(FENCE_GRACE_S, self._end_fenced, args=(why,))
        ender.daemon = True
        ender.start()

    def _end_fenced(self, why: str) -> None:
        """The main loop has not ended the run within FENCE_GRACE_S of the fence: it is
        blocked in a call to a store across the partition, which may never return (the
        TCPStore has no timeout on some). The workers are dead; end the agent here."""
        if self._ended:
            return
        group = self._group
        if group is not None:
            group.kill_now()  # (a worker respawned since the fence, too)
        self.events.emit("fenced", detail=why)
        self.events.emit("exit", exit_code=JOB_FAILED, reason=f"fenced: {why}")
        self.events.close()
        self.console.say(f"chameleon: fenced: {why}; this node's workers were stopped")
        os._exit(JOB_FAILED)

    @property
    def stop_signal(self) -> int | None:
        return self._signal

    def _refused(self, where: str) -> None:
        self.events.emit("unsigned_message", where=where)
        self.console.say(
            f"chameleon: ignored a control message not signed with this job's token ({where});"
            " later ones are ignored silently"
        )

    def record(self, failures: list[Failure]) -> None:
        """Keep every failure once: the run summary and the root cause read them."""
        self.failures = self.failures + [f for f in failures if f not in self.failures]

    def _install_signals(self) -> None:
        for signum in {*FORWARDED_SIGNALS, *self.args.preempt_signals}:
            signal.signal(signum, self._on_signal)

    def _tell_preemption(self, control: ControlPlane, world: World, group: LocalGroup) -> None:
        """The notice reaches this node's workers and the leader (which stops the job
        once they finished or the grace is over: launcher/supervisor.py)."""
        signum = self._preempt
        assert signum is not None
        self._preempt_told = True
        told = group.preempt(signum)
        control.report_preempted(world.attempt, signum, self._preempt_deadline)
        name = signal.Signals(signum).name
        grace = self.args.preemption_grace_s
        self.events.emit(
            "preemption_notice", signal=name, grace_s=grace, told=told["mailbox"],
            signalled=told["signal"],
        )  # fmt: skip
        self.console.say(
            f"chameleon: {name}: a preemption notice; the workers save and stop within "
            f"{grace:g} s, then the run exits {REQUEUE} (requeue me)"
        )

    # -- setup -----------------------------------------------------------------------

    # -- the loop --------------------------------------------------------------------

    def run(self) -> Outcome:
        a = self.args
        self._install_signals()
        self.reaper = Reaper()
        beating: threading.Thread | None = None
        self._say_unreported_faults()
        try:
            if a.warm_start:
                self._start_forkserver()  # its imports overlap ours and the rendezvous
            # Before any store is hosted here: a node that fails it must not be the one
            # the others' control store lives on (c10d's first to bind the endpoint).
            unhealthy = self._unhealthy()
            if unhealthy is not None:
                return unhealthy
            if a.max_nodes == 1:
                control, first = self._start_single_node()
            else:
                if self.token is None:
                    self.console.say(
                        "chameleon: the control plane is not authenticated: give every agent "
                        "the same CHAMELEON_JOB_TOKEN (or --rdzv-conf token=...)"
                    )
                control, first = self._join_job(), None
            self.control = control
            sent = time.monotonic()
            control.beat()
            self.link.beat(sent)
            beating = threading.Thread(
                target=beat_until,
                args=(
                    control,
                    self._stop_heartbeat,
                    WatchTimeouts(a.heartbeat_timeout_s).beat_period_s,
                    self.link.beat,
                    self._on_fenced,
                ),
                name="heartbeat",
                daemon=True,
            )
            beating.start()
            if not control.elected and not control.is_leader:
                self.link.watch_lease(
                    a.heartbeat_timeout_s, control.endpoint, self._on_fenced, self._stop_heartbeat
                )
            attempt = 0
            while True:
                if first is not None:
                    result = self._monitor(control, *first)
                    first = None
                else:
                    result = self._round(control, attempt)
                if isinstance(result, Outcome):
                    return result
                attempt = result
        except JobEnded as exc:  # found while joining a round or following its leader
            return self._job_ended(exc)
        finally:
            self._stop_heartbeat.set()
            # Joined, not left to die: a daemon thread inside a store call at interpreter
            # exit aborts the process (SIGABRT) and the job's exit code would be lost.
            if beating is not None:
                beating.join(timeout=5.0)
            if self.control is not None:
                # (a fenced leader's job goes on under another leader: its keys stay)
                code, reason = self._outcome
                self.control.close(
                    last=self.control.is_leader and self.link.fenced is None,
                    exit_code=code,
                    reason=reason,
                )
            if self.forkserver is not None:
                self.forkserver.close()
            if self.health is not None:
                self.health.close()
            self.reaper.close()

    def _round(self, control: ControlPlane, attempt: int) -> int | Outcome:
        """Run one round; the next attempt's number, or the job's outcome."""
        a = self.args
        host = a.local_addr or socket.gethostname()
        my_rank = 0 if control.is_leader and a.rdzv_backend != "static" else a.node_rank
        unhealthy = self._unhealthy(attempt) if attempt > 0 else None  # (0: checked in run)
        if unhealthy is not None:
            return unhealthy
        if attempt not in self._joined:  # (an adopted spare joined the next one already)
            try:
                control.join(attempt, node_rank=my_rank, nproc=a.nproc_per_node, host=host)
            except (StoreError, RuntimeError) as exc:
                if isinstance(exc, JobEnded):
                    return self._job_ended(exc)
                if self.link.fenced is not None:
                    return self._finish(JOB_FAILED, f"fenced: {self.link.fenced}")
                detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                return self._finish(
                    JOB_FAILED, f"lost the control store while joining round {attempt}: {detail}"
                )
            self._joined.add(attempt)
        world = self._world(control, attempt)
        if world is None and self._signal is None:
            adopted = self._adopted(control, attempt)
            if adopted is not None:  # a hot spare, taken in for a lost node
                group = self._start_group(*adopted, adopt=True)
                self.events.emit("workers_started", **group.started)
                return self._monitor(control, adopted[0], group)
        if world is None:
            return self._finish(
                130 if self._signal == signal.SIGINT else 128 + (self._signal or 0),
                "interrupted while joining",
            )
        me = world.node(control.key)
        if me is None:  # formed without us: wait for the next round
            self.events.emit("waiting", attempt=attempt)
            return attempt + 1
        if control.is_leader:
            self.events.emit(
                "round_started",
                attempt=attempt,
                world_size=world.world_size,
                nodes=len(world.nodes),
                worker_store=f"{world.worker_addr}:{world.worker_port}",
            )
        group = self._start_group(world, me)
        self.events.emit("workers_started", **group.started)
        if attempt > 0 and control.is_leader:
            self.events.emit(
                "recovered", attempt=attempt, policy="restart", world_size=world.world_size
            )
        return self._monitor(control, world, group)

    def _unhealthy(self, attempt: int = 0) -> Outcome | None:
        """--health-check before this node joins (launcher/health.py): an Outcome that
        keeps it out when it fails, else None."""
        if self.health is None:
            return None
        result = self.health.run("join")
        self.events.emit("health_check", when="join", attempt=attempt, **result.to_json())
        if result.ok:
            return None
        return self._finish(
            JOB_FAILED, f"this node failed --health-check ({result.why}): not joining"
        )

    def _adopted(self, control: ControlPlane, attempt: int) -> tuple[World, NodeInfo] | None:
        """Waiting for round ``attempt``, this agent may be asked to take a lost node's
        ranks in the running round instead (launcher/leader.py, ``_adopt``)."""
        if attempt == 0:
            return None
        node = control.get(f"r{attempt - 1}/adopt/{control.key}")
        world = control.world(attempt - 1) if node is not None else None
        if world is None or world.node(control.key) is None:
            return None
        moved = control.get(f"r{attempt - 1}/worker_store")  # a successor's (etcd)
        if moved is not None:
            world = replace(world, worker_addr=moved["addr"], worker_port=moved["port"])
        return world, world.node(control.key)

    def _start_group(self, world: World, me: NodeInfo, *, adopt: bool = False) -> LocalGroup:
        a = self.args
        self._new_round_store()
        settings = RoundSettings.of(
            a, world, me, run_id=self.run_id, run_dir=self.run_dir, token=self.token
        )
        group = LocalGroup(
            settings,
            self.command,
            console=self.console,
            faults=a.faults,
            fault_ledger=self.fault_ledger,
            emit=self.events.emit,
            base_env=dict(os.environ),
            view=WorkerStoreView(
                world.attempt,
                world.worker_addr,
                world.worker_port,
                hosted=lambda: (
                    self.worker_store if self.control and self.control.is_leader else None
                ),
                seal=self.seal,
                # Where the store can move (etcd), a connection its old host leaves
                # unanswered fails instead of blocking this agent's loop for good.
                link_s=a.heartbeat_timeout_s if a.rdzv_backend == "etcd" else None,
            ),
            reaper=self.reaper,
            forkserver=self.forkserver,
            health=self.health,
        )
        self._group = group
        self._await_forkserver()
        if adopt:
            group.adopt()
        else:
            group.start()
        self.started_at = time.monotonic()
        return group

    def _await_forkserver(self) -> None:
        """Workers are forks of the warm server (launcher/forkserver.py) once it is ready:
        the first round waits for it (one import of torch instead of one per worker),
        later rounds find it ready. Not ready in time, or gone: fresh processes."""
        server = self.forkserver
        if server is None or self._server_awaited:
            return
        self._server_awaited = True  # once: a server not ready by then is not waited for again
        waited = time.monotonic()
        if server.wait_ready(WARM_START_WAIT_S):
            self.events.emit(
                "warm_start_ready",
                pid=server.pid,
                waited_s=round(time.monotonic() - waited, 3),
                early=self._server_early,
                forked=server.forked,
            )

    def _start_forkserver(self) -> None:
        env = server_env(os.environ, self.args.nproc_per_node)
        log = self.run_dir / "forkserver.log"
        try:
            preload = modules_for(self.args.script, self.args.preload, self.args.module)
            taken = early.take(env, preload, log)
            self._server_early = taken is not None
            self.forkserver = taken or ForkServer(env, log, preload)
        except OSError as exc:  # restarts start fresh interpreters, as without the server
            self.args = replace(self.args, warm_start=False)
            self.events.emit("warm_start_unavailable", detail=str(exc))
            return
        if self.reaper is not None:
            self.reaper.hold(self.forkserver.pid)

    def _monitor(self, control: ControlPlane, world: World, group: LocalGroup) -> int | Outcome:
        keys = [n.key for n in world.nodes]
        self._preempt_told = False  # a notice is told to each round's workers and leader
        for k in keys:
            self.beat_seen.setdefault(k, time.time())
        leader = Leader(self, control, world, group) if control.is_leader else None
        reported_done = False
        next_sync = 0.0
        while True:
            recovering = leader is not None and leader.recovering
            # While a recovery is under way every millisecond counts: poll fast.
            self.nudge.wait(RECOVERY_POLL_S if recovering else self.args.monitor_interval_s)
            self.nudge.clear()
            if self.link.fenced is not None:
                return self._fence(group, self.link.fenced)
            try:
                # Local processes every interval; the store (remote reports, decisions)
                # at once when something happened here, else every SYNC_PERIOD_S: on a
                # machine whose cores the workers saturate, the launcher's own polling
                # comes out of their step time.
                news = False
                if self._preempt is not None and not self._preempt_told:
                    self._tell_preemption(control, world, group)
                    news = True
                polled = group.poll()
                for failure in polled:
                    self.events.emit("failure", **failure.to_json())
                if polled or self.link.unreported:
                    self.link.report(control, polled)
                    news = True
                if group.all_finished and not reported_done:
                    control.report_done(world.attempt)
                    reported_done = news = True
                if (
                    not (news or recovering)
                    and time.monotonic() < next_sync
                    and self._signal is None
                    and not self.link.out
                ):
                    continue
                next_sync = time.monotonic() + SYNC_PERIOD_S
                if control.elected:
                    if leader is None and control.leader() is None:
                        leader = self._take_over(control, world, group)
                    self._follow_store(control, world, group)
                if leader is not None:
                    leader.lead()
                else:
                    for rank, reason, silent_s in control.kill_requests(world.attempt):
                        group.kill_hung(rank, reason, silent_s)
                decision = control.decision(world.attempt)
                self.link.answered()
            except JobEnded as exc:  # its decision was read by the others, not by us
                group.stop(grace_s=self.args.shutdown_timeout_s)
                return self._job_ended(exc)
            except Fenced as exc:
                return self._fence(group, str(exc))
            except (StoreError, RuntimeError) as exc:
                if control.is_leader and not control.elected:
                    raise
                detail = str(exc).splitlines()[0]
                if control.elected and isinstance(exc, StoreError):  # etcd is out of reach
                    if not self.link.unreachable(detail):
                        if leader is not None:
                            leader.observe()  # the workers' steps, read on our own store
                        if self._signal is not None:
                            return self._interrupted(group)
                        continue
                    group.stop(grace_s=RESTART_GRACE_S)
                    self.events.emit("control_lost", detail=detail)
                    return self._finish(
                        3,
                        f"lost the control plane: no etcd member answered for "
                        f"{self.args.control_outage_timeout_s:g} s ({detail})",
                    )
                if self.link.fenced is not None:
                    return self._fence(group, self.link.fenced)
                group.stop(grace_s=RESTART_GRACE_S)
                if control.elected:
                    self.events.emit("control_lost", detail=detail)
                    return self._finish(3, f"lost the control plane: {exc}")
                self.events.emit("leader_lost", detail=detail)
                return self._finish(
                    3,
                    f"lost the control store at {control.endpoint} (the leader's node is "
                    f"gone, or cut off from this one)",
                )
            if self._signal is not None and not control.is_leader:
                return self._interrupted(group)
            if decision is None:
                continue
            if not control.is_leader:
                with contextlib.suppress(JobEnded):  # (read, and the leader left already)
                    control.acknowledge(world.attempt)
                # Kept by the followers too: one of them may lead the next round.
                self.restarts_used = decision.get("restarts_used", self.restarts_used)
                self.earlier_causes = decision.get("earlier_causes", self.earlier_causes)
            if decision["action"] == Action.RESTART:
                group.stop(grace_s=RESTART_GRACE_S)
                self.events.emit("restart", attempt=world.attempt + 1, reason=decision["reason"])
                return world.attempt + 1
            if self._signal is not None:
                outcome = self._interrupted(group)
            else:
                group.stop(
                    grace_s=RESTART_GRACE_S
                    if decision["exit_code"]
                    else self.args.shutdown_timeout_s
                )
                outcome = self._finish(decision["exit_code"], decision["reason"])
            if leader is not None:
                self._last_world = leader.world  # (with any node adopted into it)
                with contextlib.suppress(StoreError, RuntimeError):  # (a courtesy: best effort)
                    control.wait_acknowledged(
                        world.attempt,
                        [k for k in leader.keys if k not in leader.lost],
                        timeout_s=5.0,
                    )
            return outcome

    def _job_ended(self, exc: JobEnded) -> Outcome:
        """The job this agent joined ended without it reading the end (launcher/etcd.py,
        JobEnded). A node the job never took in leaves with 0, as torchrun's agent leaves
        a closed rendezvous: it had no work and lost none. A member leaves with the
        job's exit code, as it would had it read the leader's decision in time."""
        if self._group is None:
            self.console.say("chameleon: the job ended before this node was taken in")
            return self._finish(0, "the job ended before this node was taken in")
        return self._finish(exc.exit_code, f"the job ended: {exc.reason}")

    def _fence(self, group: LocalGroup, why: str) -> Outcome:
        """The job counted this node lost (its lease ran out): kill its workers now,
        before they act on a generation the others have left, and write nothing more."""
        group.stop(signum=signal.SIGKILL, grace_s=0.0)
        self.events.emit("fenced", detail=why)
        return self._finish(3, f"fenced: {why}; this node's workers were stopped")

    def _interrupted(self, group: LocalGroup) -> Outcome:
        """Forward the signal; one line per rank on the console instead of every worker's
        KeyboardInterrupt traceback (those stay in the workers' logs)."""
        signum = self._signal or signal.SIGTERM
        self.events.emit("interrupted", signal=signum)
        self.console.quiet_errors = True
        group.stop(signum=signum, grace_s=self.args.shutdown_timeout_s)
        for line in group.stopped_lines(signum):
            self.console.say(line)
        return self._finish(128 + signum, f"stopped by signal {signum}")

    def _say_unreported_faults(self) -> None:
        """A step or recovery fault on a script that may report neither never fires: said
        at the start, one line each, with what fires instead."""
        a = self.args
        if a.module or a.no_python or not a.faults:
            return
        for fault in unreported(a.faults, script_imports(Path(a.script))):
            self.console.say(
                f"chameleon: --inject-fault {fault.describe()}: steps and recoveries are those "
                "that workers report, through chameleon_runtime's API or, from a plain "
                "script, chameleon_runtime.heartbeat() once a step; this script imports no "
                "chameleon_runtime, so it may never fire: at=SECONDS of a named rank fires "
                "by the clock"
            )

    def _finish(self, code: int, reason: str) -> Outcome:
        a, ledger = self.args, self.fault_ledger
        # This node's faults: those its rounds watched for; on one node, every fault
        # asked for (one of an attempt that never came included)
        mine = a.faults if a.max_nodes == 1 else [f for f in a.faults if id(f) in ledger.watched]
        never = [f for f in mine if id(f) not in ledger.fired]
        # (the job's own end, for the control plane: another node's exit is its own)
        self._outcome = (code, reason)
        if never:
            self.events.emit("faults_not_fired", faults=[f.describe() for f in never])
        if code == 0 and a.require_faults and mine and not ledger.fired:
            code, reason = FAULTS_NOT_FIRED, f"{reason}, but no fault fired (--require-faults)"
        self._ended = True
        self.events.emit("exit", exit_code=code, reason=reason)
        self.events.close()
        return Outcome(exit_code=code, reason=reason, failures=self.failures, run_dir=self.run_dir)

    # -- joining the job ---------------------------------------------------------------

    def _control_endpoint(self) -> tuple[str, int, bool | None]:
        try:
            return control_endpoint(self.args)
        except RendezvousError as exc:
            raise JobError(str(exc)) from None

    def _emit_start(self, control: ControlPlane) -> None:
        a = self.args
        self.events.emit(
            "start",
            run_id=self.run_id,
            key=control.key,
            leader=control.is_leader,
            control=control.endpoint,
            nnodes=f"{a.min_nodes}:{a.max_nodes}",
            nproc_per_node=a.nproc_per_node,
            command=self.command,
            run_dir=str(self.run_dir),
            from_env=list(a.from_env),
            requeue=a.requeue,
        )

    def _join_job(self) -> ControlPlane:
        if self.args.rdzv_backend == "etcd":
            return self._join_etcd()
        addr, port, want_leader = self._control_endpoint()
        try:
            control = ControlPlane.open(
                run_id=self.run_id,
                addr=addr,
                port=port,
                want_leader=want_leader,
                timeout_s=float(self.args.rdzv_conf.get("join_timeout", 600)),
                seal=self.seal,
            )
        except (StoreError, RendezvousError) as exc:
            raise JobError(str(exc)) from None
        if not control.is_leader:
            # Every later call is a short one: one that gets no answer within the lease
            # means the leader's node is gone or cut off from this one (not 600 s later).
            control.store.set_timeout(timedelta(seconds=max(5.0, self.args.heartbeat_timeout_s)))
        self._emit_start(control)
        return control

    def _join_etcd(self) -> ControlPlane:
        from launcher.etcd import parse_endpoints
        from launcher.etcd_control import EtcdControlPlane

        a = self.args
        # torch before the lease: this agent needs it for every round's worker store, and
        # importing it holds the interpreter for seconds at a time on a loaded host (six
        # agents and fork servers importing it at once on 2 cores): the heartbeat thread
        # could not refresh a fresh lease through that, and etcd fenced the node before
        # its first round (seen in CI at --heartbeat-timeout 3). Nothing is leased yet.
        import torch.distributed  # noqa: F401

        try:
            control = EtcdControlPlane.open(
                run_id=self.run_id,
                endpoints=a.rdzv_endpoint,
                ttl_s=a.heartbeat_timeout_s,
                timeout_s=float(a.rdzv_conf.get("join_timeout", 600)),
                # Each round's worker store: on loopback unless told this node's address.
                worker_host=a.local_addr or "127.0.0.1",
                seal=self.seal,
            )
        except (StoreError, RendezvousError) as exc:
            raise JobError(str(exc)) from None
        if a.local_addr is None and any(
            not is_loopback(h) for h, _ in parse_endpoints(a.rdzv_endpoint)
        ):
            self.console.say(
                "chameleon: this node serves worker stores on 127.0.0.1 when it leads; "
                "pass --local-addr for a job across hosts"
            )
        self._emit_start(control)
        return control

    def _start_single_node(self) -> tuple[ControlPlane, tuple[World, LocalGroup]]:
        """One node needs no rendezvous: bind both stores' sockets in plain Python, then
        import torch and serve the stores while the workers' imports (fresh workers) or
        the fork server's (warm ones) take seconds; store clients wait in the backlog."""
        addr, port, _ = self._control_endpoint()
        try:
            control_socket = bind_listener(addr, port)
            worker_socket = bind_listener(addr, 0)
        except StoreError as exc:
            raise JobError(str(exc)) from None
        bound, control_port = control_socket.getsockname()[:2]
        worker_port = worker_socket.getsockname()[1]
        key = node_key()
        host = self.args.local_addr or socket.gethostname()
        world = World(0, (NodeInfo(key, 0, self.args.nproc_per_node, host, 0),), bound, worker_port)
        # Fresh workers start now and import torch while we do; forks of the warm server
        # start once it is ready, and the server's imports overlap ours instead.
        group = None if self.forkserver is not None else self._start_group(world, world.nodes[0])
        timeout = float(self.args.rdzv_conf.get("join_timeout", 600))
        try:
            store = serve_store(control_socket, timeout_s=timeout)
            self.worker_store = serve_store(worker_socket, timeout_s=timeout)
        except StoreError as exc:
            if group is not None:
                group.stop(grace_s=RESTART_GRACE_S)
            raise JobError(str(exc)) from None
        if group is None:
            group = self._start_group(world, world.nodes[0])
        put_json(store, RUN_ID_KEY, self.run_id)
        control = ControlPlane(
            store,
            self.run_id,
            key,
            is_leader=True,
            addr=bound,
            port=control_port,
            seal=self.seal,
        )
        control.join(0, node_rank=0, nproc=self.args.nproc_per_node, host=host)
        control.put("r0/world", world.to_json())
        self._last_world = world
        self._emit_start(control)
        self.events.emit(
            "round_started",
            attempt=0,
            world_size=world.world_size,
            nodes=1,
            worker_store=f"{bound}:{worker_port}",
        )
        self.events.emit("workers_started", **group.started)
        return control, (world, group)

    def _world(self, control: ControlPlane, attempt: int) -> World | None:
        a = self.args
        timeout = float(a.rdzv_conf.get("join_timeout", 600))
        if not control.is_leader and control.elected:
            world = self._follow(control, attempt, timeout)
            if world is not None or not control.is_leader:
                self._last_world = world or self._last_world
                return world
        if control.is_leader:
            # A fresh store for this attempt's workers (see launcher/store.py for why). A
            # worker's connection its node leaves unanswered (killed while cut off) is
            # dropped, so that it keeps no mailbox from its replacement.
            self.worker_store = host_store(
                control.worker_host, 0, timeout_s=timeout, link_s=self.args.heartbeat_timeout_s
            )
            try:
                world = control.form_world(
                    attempt,
                    min_nodes=a.min_nodes,
                    max_nodes=a.max_nodes,
                    static_ranks=a.rdzv_backend == "static" and not a.standalone,
                    worker_addr=control.worker_host,
                    worker_port=self.worker_store.port,
                    last_call_s=float(a.rdzv_conf.get("last_call_timeout", 1.0)),
                    timeout_s=timeout,
                )
            except RendezvousError as exc:
                raise JobError(str(exc)) from None
            self._record_missing_nodes(self._last_world, world)
            self._last_world = world
            return world
        try:
            return control.wait_world(
                attempt,
                timeout,
                stop=lambda: (
                    self._signal is not None or self._adopted(control, attempt) is not None
                ),
            )
        except RendezvousError as exc:
            raise JobError(str(exc)) from None

    def _follow(self, control: ControlPlane, attempt: int, timeout: float) -> World | None:
        """An elected control plane's follower: wait for the round's world; when the
        leader goes first (its lease expired), campaign, and form the world if we won."""
        deadline = time.monotonic() + timeout

        def stop() -> bool:
            return (
                self._signal is not None
                or control.leader() is None
                or self._adopted(control, attempt) is not None
            )

        while True:
            try:
                world = control.wait_world(
                    attempt,
                    max(0.0, deadline - time.monotonic()),
                    stop=stop,
                )
            except (RendezvousError, StoreError) as exc:
                raise JobError(str(exc)) from None
            if world is not None or self._signal is not None:
                return world
            if self._adopted(control, attempt) is not None:
                return None
            if control.campaign():
                self.events.emit("leader_elected", attempt=attempt, key=control.key)
                return None

    def _record_missing_nodes(self, last: World | None, world: World) -> None:
        """Nodes of the last round that did not come back were lost; record them, dated by
        their last heartbeat, so that a node loss noticed only now (its workers' peers
        crashed first) still shows as the root cause."""
        if last is None:
            return
        for node in last.nodes:
            if world.node(node.key) is not None or any(
                f.kind is FailureKind.NODE_LOST
                and f.node == node.node_rank
                and f.attempt == last.attempt
                for f in self.failures
            ):
                continue
            since = self.beat_seen.get(node.key, time.time())
            self.events.emit(
                "node_lost", node=node.node_rank, host=node.host, silent_s=time.time() - since
            )
            for failure in lost_with(node, last.attempt, since, "did not rejoin"):
                self.events.emit("failure", **failure.to_json())
                self.failures.append(failure)

    # -- a successor within a round ----------------------------------------------------

    _store_epoch = 0  # the epoch of the worker store this node's workers were told of

    @property
    def store_file(self) -> Path:
        return self.run_dir / STORE_FILE

    def _new_round_store(self) -> None:
        """A round starts on the leader's store (epoch 0): forget the last round's move."""
        self._store_epoch = 0
        self.store_file.unlink(missing_ok=True)

    def _follow_store(self, control: ControlPlane, world: World, group: LocalGroup) -> None:
        """Point this node's workers at the round's newest worker store."""
        found = control.get(f"r{world.attempt}/worker_store")
        if found is None or found["epoch"] <= self._store_epoch:
            return
        self._store_epoch = found["epoch"]
        address = StoreAddress(addr=found["addr"], port=found["port"], epoch=found["epoch"])
        tmp = self.store_file.with_suffix(".tmp")
        tmp.write_text(address.model_dump_json())
        os.replace(tmp, self.store_file)  # a worker never reads half of it
        group.move_store(found["addr"], found["port"])
        self.events.emit(
            "worker_store_moved",
            attempt=world.attempt,
            addr=found["addr"],
            port=found["port"],
            epoch=found["epoch"],
        )

    def _take_over(self, control: ControlPlane, world: World, group: LocalGroup) -> Leader | None:
        """The leader's lease ran out (its node is lost): campaign. The winner serves a new
        worker store and leads the rest of the round from the old leader's snapshot."""
        if not control.campaign():
            return None
        self.events.emit("leader_elected", attempt=world.attempt, key=control.key)
        attempt = world.attempt
        world = control.world(attempt) or world  # (with any node adopted into it)
        snapshot = control.get(f"r{attempt}/inplace")
        if snapshot is None:  # nothing to go on from: decide as the old leader would
            return Leader(self, control, world, group)
        timeout = float(self.args.rdzv_conf.get("join_timeout", 600))
        self.worker_store = host_store(
            control.worker_host, 0, timeout_s=timeout, link_s=self.args.heartbeat_timeout_s
        )
        last = control.get(f"r{attempt}/worker_store") or {"epoch": 0}
        control.put(
            f"r{attempt}/worker_store",
            {
                "addr": control.worker_host,
                "port": self.worker_store.port,
                "epoch": max(last["epoch"], self._store_epoch) + 1,
            },
        )
        self._follow_store(control, world, group)
        next_gen = control.get(f"r{attempt}/next_gen") or 0
        return Leader(
            self, control, world, group, takeover={"snapshot": snapshot, "next_gen": next_gen}
        )
