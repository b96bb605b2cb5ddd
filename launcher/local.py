"""This node's workers for one round: start them, watch them, stop them (faults are
injected by launcher/injection.py).

Detection, per worker, every monitor interval:
- crash: the process exited non-zero or by a signal (polled, so within one interval);
- hang: psutil shows it stopped, zombie or in uninterruptible sleep for longer than the
  heartbeat timeout, or (workers using chameleon_runtime) its own heartbeat stopped
  moving, or never started (launcher/watch.py). A hung worker is SIGKILLed at once so
  that its peers' collectives fail fast instead of waiting out the backend timeout.
  Whether a worker gets anywhere (progress) is the leader's to judge, job-wide.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from chameleon_runtime.protocol.messages import (
    BEAT_RECORD_BYTES,
    RecoveryPhase,
    ScriptBeat,
    WorkerStatus,
)
from launcher.environment import WorkerIdentity, worker_env
from launcher.faults import ANY, FaultLedger, FaultSpec, Injector
from launcher.health import HealthCheck
from launcher.injection import FaultInjection
from launcher.rootcause import ErrorReport, from_stderr, read_error_file
from launcher.settings import RoundSettings
from launcher.supervisor import Failure, FailureKind
from launcher.warm import ForkServer
from launcher.watch import Liveness, ScriptBeats
from launcher.worker_store import WorkerStoreView
from launcher.workers import (
    BEAT_FILE,
    ERROR_FILE,
    STACKS_GRACE_S,
    Console,
    Reaper,
    Worker,
    ask_for_stacks,
    signal_worker,
    start_worker,
    stop_workers,
)

HANG_CHECK_PERIOD_S = 0.25  # psutil and heartbeat reads; crashes are polled every interval
_BAD_STATUSES = {
    psutil.STATUS_STOPPED,
    psutil.STATUS_TRACING_STOP,
    psutil.STATUS_ZOMBIE,
    psutil.STATUS_DISK_SLEEP,
}


class LocalGroup:
    def __init__(
        self,
        settings: RoundSettings,
        command: list[str],
        *,
        console: Console,
        faults: Sequence[FaultSpec],
        emit: Callable[..., object],
        base_env: dict[str, str],
        view: WorkerStoreView | None = None,
        reaper: Reaper | None = None,
        forkserver: ForkServer | None = None,
        fault_ledger: FaultLedger | None = None,
        health: HealthCheck | None = None,
    ) -> None:
        """``fault_ledger``: what the agent's earlier rounds injected and reached
        (launcher.faults.FaultLedger); ``health``: --health-check (launcher/health.py)."""
        ledger = fault_ledger if fault_ledger is not None else FaultLedger()
        self.s = settings
        self.command = command
        self.console = console
        self.emit = emit
        self.base_env = base_env
        self.view = view
        self.respawned: dict[int, int] = {}  # rank -> replacements started
        self.reaper = reaper
        self.forkserver = forkserver  # warm interpreters, when ready (launcher/forkserver.py)
        self.workers: dict[int, Worker] = {}
        self.finished: set[int] = set()
        self.failed: dict[int, Failure] = {}
        self._bad_since: dict[int, float] = {}
        self._liveness = Liveness(settings.watch)
        self._blind = False  # the worker store was out of reach, or moved, since the last look
        self._beats = ScriptBeats(settings.watch)
        # The workers of this node that posted a chameleon_runtime status.
        self._runtime_ranks: set[int] = set()
        self.health = health  # --health-check, before a replacement starts
        self._health_checks: dict[int, tuple[int, Any]] = {}  # rank -> (count, its future)
        self._refused: list[Failure] = []  # replacements the check refused, to report
        ranks = list(range(settings.rank_offset, settings.rank_offset + settings.nproc))
        watched = [
            f
            for f in faults
            if f.in_attempt(settings.attempt)
            and id(f) not in ledger.fired
            and (f.rank == ANY or self._is_local(f.rank))
        ]
        ledger.watched.update(id(f) for f in watched if f.rank != ANY or not settings.rank_offset)
        injector = Injector(watched, ranks, ledger, settings.attempt)
        self.injection = FaultInjection(injector, settings, emit)
        self._fault_times: dict[int, float] = {}
        # ranks found stalled (here or by the leader) -> why, when (time.time()), and when
        # to kill them (monotonic): each writes its stacks to its log first
        # (launcher.workers.ask_for_stacks)
        self._hung: dict[int, tuple[str, float, float]] = {}
        self._next_hang_check = 0.0
        self.started: dict = {}  # what the "workers_started" event reports

    def _is_local(self, rank: int) -> bool:
        return self.s.rank_offset <= rank < self.s.rank_offset + self.s.nproc

    def start(self) -> None:
        self.injection.started_at = time.time()
        for local_rank in range(self.s.nproc):
            rank = self.s.rank_offset + local_rank
            self.workers[rank] = self._spawn(rank, str(rank), {})
        self.started = {
            "attempt": self.s.attempt,
            "node": self.s.node_rank,
            "ranks": sorted(self.workers),
            "pids": [self.workers[r].pid for r in sorted(self.workers)],
            # forked from the warm server (launcher/forkserver.py), not fresh interpreters
            "warm": all(w.warm for w in self.workers.values()),
        }

    def _spawn(self, rank: int, log_name: str, env_extra: dict[str, str]) -> Worker:
        local_rank = rank - self.s.rank_offset
        log_dir = self.s.log_dir / f"attempt_{self.s.attempt}" / log_name
        who = WorkerIdentity(
            rank=rank,
            local_rank=local_rank,
            world_size=self.s.world_size,
            local_world_size=self.s.nproc,
            group_rank=self.s.node_rank,
            group_world_size=self.s.num_nodes,
            role=self.s.role,
            role_rank=rank,
            role_world_size=self.s.world_size,
        )
        env = worker_env(
            self.base_env,
            who,
            master_addr=self.s.master_addr,
            master_port=self.s.master_port,
            restart_count=self.s.attempt,
            max_restarts=self.s.max_restarts,
            run_id=self.s.run_id,
            error_file=str(log_dir / ERROR_FILE),
            chameleon={
                **self.s.extra_env,
                **self.injection.env(),
                # a plain script's heartbeats (chameleon_runtime.heartbeat), read here
                "CHAMELEON_BEAT_FILE": str(log_dir / BEAT_FILE),
                **env_extra,
            },
        )
        show = self.s.local_ranks_filter is None or local_rank in self.s.local_ranks_filter
        return start_worker(
            self.command,
            env,
            rank=rank,
            local_rank=local_rank,
            log_dir=log_dir,
            redirect=self.s.redirects.get(local_rank, 0),
            tee=self.s.tee.get(local_rank, 0),
            console=self.console,
            show_on_console=show,
            reaper=self.reaper,
            forkserver=self.forkserver,
        )

    def adopt(self) -> None:
        """This node takes a lost node's ranks in place (a hot spare, launcher/leader.py):
        none runs yet; each starts when the leader asks for its replacement, as a dead
        worker's would (``_respawn_requested``)."""
        self.injection.started_at = now = time.time()
        ranks = range(self.s.rank_offset, self.s.rank_offset + self.s.nproc)
        for rank in ranks:
            self.failed[rank] = self._failure_now(
                rank, FailureKind.NODE_LOST, "adopted from a lost node", now
            )
        self.started = {
            "attempt": self.s.attempt,
            "node": self.s.node_rank,
            "ranks": list(ranks),
            "pids": [],
            "adopted": True,
        }

    def _respawn_requested(self) -> None:
        """Start replacements the leader asked for (launcher/rejoin.py): the same rank and
        environment, plus CHAMELEON_JOIN, in this attempt. A chameleon_runtime worker
        started so joins the running job as a spare instead of starting it."""
        if self.view is None:
            return
        for rank in sorted(self.failed):
            wanted = self.view.respawn_request(rank)
            if not wanted or wanted <= self.respawned.get(rank, 0):
                continue
            if not self._healthy_for(rank, wanted):
                continue
            self.respawned[rank] = wanted
            worker = self._spawn(rank, f"{rank}.rejoin{wanted}", {"CHAMELEON_JOIN": str(wanted)})
            self.workers[rank] = worker
            del self.failed[rank]
            self._bad_since.pop(rank, None)
            self._fault_times.pop(rank, None)  # its predecessor's, not its own
            self.emit(
                "worker_respawned",
                rank=rank,
                attempt=self.s.attempt,
                count=wanted,
                pid=worker.pid,
                warm=worker.warm,
            )

    def _healthy_for(self, rank: int, wanted: int) -> bool:
        """--health-check before a replacement starts, off the launcher's loop: False
        while it runs, and when it failed (the rank is then reported as not replaced,
        and not asked for again at this count)."""
        if self.health is None:
            return True
        pending = self._health_checks.get(rank)
        if pending is None or pending[0] != wanted:
            self._health_checks[rank] = (wanted, self.health.submit("replace", rank))
            return False
        if not pending[1].done():
            return False
        del self._health_checks[rank]
        result = pending[1].result()
        self.emit(
            "health_check", when="replace", rank=rank, node=self.s.node_rank, **result.to_json()
        )
        if result.ok:
            return True
        self.respawned[rank] = wanted
        self._refused.append(
            self._failure_now(rank, FailureKind.UNHEALTHY, result.why, time.time())
        )
        return False

    def _failure_now(self, rank: int, kind: FailureKind, message: str, now: float) -> Failure:
        """A failure of this node's ``rank`` with no process behind it, seen at ``now``."""
        return Failure(
            rank=rank,
            node=self.s.node_rank,
            kind=kind,
            attempt=self.s.attempt,
            failed_at=now,
            detected_at=now,
            message=message,
        )

    @property
    def all_finished(self) -> bool:
        """Every worker exited 0 or failed (a failure handled in place leaves the rest to
        finish the job; in a plain job a failure leads to a restart first)."""
        if not self.workers:  # an adopted node whose replacements never started
            return bool(self.started.get("adopted"))
        return len(self.finished) + len(self.failed) == len(self.workers) and bool(self.finished)

    def poll(self) -> list[Failure]:
        """New failures since the last poll (crashes, hangs), after injecting due faults."""
        now = time.time()
        statuses = self._statuses(now)
        self._inject(now, statuses)
        if self.failed:
            self._respawn_requested()
        new: list[Failure] = self._refused
        self._refused = []
        for rank, worker in self.workers.items():
            if rank in self.finished or rank in self.failed:
                continue
            code = worker.poll()
            if code is None:
                if rank not in self._hung and now >= self._next_hang_check:
                    reason = self._hang_reason(rank, worker, statuses.get(rank), now)
                    if reason is not None:
                        self._dump_then_kill(rank, worker, reason)
                hung = self._hung.get(rank)
                if hung is not None and time.monotonic() >= hung[2]:
                    del self._hung[rank]
                    signal_worker(worker, signal.SIGKILL)
                    report = ErrorReport(hung[0], None, None, "")
                    found = hung[1]  # (detected when judged, not when killed)
                    new.append(self._failure(rank, worker, FailureKind.HANG, found, None, report))
                continue
            if code == 0:
                self.finished.add(rank)
                continue
            kind = FailureKind.SIGNAL if code < 0 else FailureKind.EXIT
            report = _error_report(worker, exited=kind is FailureKind.EXIT)
            if rank in self._hung:  # killed as hung (on its stacks' signal, or by another)
                reason = self._hung.pop(rank)[0]
                kind, report = FailureKind.HANG, ErrorReport(reason, None, None, "")
            new.append(self._failure(rank, worker, kind, now, code, report))
        if now >= self._next_hang_check:
            self._next_hang_check = now + HANG_CHECK_PERIOD_S
        for failure in new:
            self.failed[failure.rank] = failure
        return new

    def kill_hung(self, rank: int, reason: str, silent_s: float) -> None:
        """The leader found ``rank`` stalled for ``silent_s`` (launcher/watch.py): kill it
        once it wrote its stacks; a poll reports it as hung, with the reason, dated when it
        stalled."""
        worker = self.workers.get(rank)
        if worker is None or rank in self.failed or rank in self.finished or rank in self._hung:
            return
        self._fault_times.setdefault(rank, time.time() - silent_s)
        self._dump_then_kill(rank, worker, reason)

    def _dump_then_kill(self, rank: int, worker: Worker, reason: str) -> None:
        """Where a hung worker was stuck goes to its log (its stacks) before a poll
        ``STACKS_GRACE_S`` later kills it."""
        ask_for_stacks(worker)
        self._hung[rank] = (reason, time.time(), time.monotonic() + STACKS_GRACE_S)

    def on_recovery_phase(self, phase: RecoveryPhase) -> None:
        """The leader's recovery phase, from the coordinator in this process: faults due
        at its start fire now, before the phase's work begins."""
        self.injection.phase = phase
        now = time.time()
        self._inject(now, self._statuses(now) if self.injection.watches_status() else {})

    def _inject(self, now: float, statuses: dict) -> None:
        """Faults due now, on the workers still running; each hit rank's failure is dated
        from now."""
        alive = {r for r in self.workers if r not in self.failed and r not in self.finished}
        beats = self._beat_steps(statuses) if self.injection.watches_status() else None
        hit = self.injection.fire(
            now, statuses, workers=self.workers, alive=alive, view=self.view, beats=beats
        )
        for rank in hit:
            self._fault_times[rank] = now

    def _beat_steps(self, statuses: dict) -> dict[int, WorkerStatus]:
        """A plain script's steps, for a ``step=N`` fault: its heartbeats
        (chameleon_runtime.heartbeat, once a step), so that after N + 1 beats it has run
        step N. Only the injector sees these: the rank is no runtime worker."""
        out = {}
        for rank, worker in self.workers.items():
            if rank in statuses or rank in self._runtime_ranks:
                continue
            beat = _read_beat(worker.beat_file)
            if beat is not None and beat.pid == worker.pid:
                out[rank] = WorkerStatus(
                    pid=beat.pid, beat=beat.beats, phase="train", generation=0,
                    step=beat.beats, progress=beat.beats,
                )  # fmt: skip
        return out

    def _statuses(self, now: float) -> dict:
        """This node's workers' statuses: for the hang check every quarter second, and at
        every poll while a fault waits for a step or a worker's phase."""
        if self.view is None or not (
            now >= self._next_hang_check or self.injection.watches_status()
        ):
            return {}
        statuses = self.view.statuses(sorted(self.workers))
        self._runtime_ranks |= set(statuses)
        return statuses

    def _failure(
        self,
        rank: int,
        worker: Worker,
        kind: FailureKind,
        now: float,
        code: int | None,
        report: ErrorReport | None,
    ) -> Failure:
        failed_at = self._fault_times.get(rank)
        if failed_at is None and kind is FailureKind.HANG:
            failed_at = self._bad_since.get(rank, now)
        if failed_at is None and report is not None and report.written_at is not None:
            failed_at = min(report.written_at, now)  # when it raised, not when we polled
        logs = worker.log_files()
        return Failure(
            rank=rank,
            node=self.s.node_rank,
            kind=kind,
            attempt=self.s.attempt,
            failed_at=failed_at if failed_at is not None else now,
            detected_at=now,
            exit_code=code,
            message=report.message if report else "",
            log_file=str(logs[-1]) if logs else None,
            where=report.where if report else None,
            peer_error=report is not None and report.from_a_peer,
        )

    def _hang_reason(self, rank: int, worker: Worker, status, now: float) -> str | None:  # noqa: ANN001
        timeout = self.s.watch.heartbeat_s
        try:
            state = psutil.Process(worker.pid).status()
        except psutil.NoSuchProcess:
            return None
        if state in _BAD_STATUSES and not (
            state == psutil.STATUS_STOPPED and self.injection.throttled(rank)
        ):
            since = self._bad_since.setdefault(rank, now)
            if now - since >= timeout:
                return f"process {state} for {now - since:.1f} s"
        else:
            self._bad_since.pop(rank, None)
        if not self._runtime_ranks:
            # a plain script: its heartbeats if it calls chameleon_runtime.heartbeat(),
            # else its process state is all there is to watch
            hung = self._beats.judge(rank, worker.pid, _read_beat(worker.beat_file), now)
            if hung is None:
                return None
            why, since = hung
            self._bad_since[rank] = since
            return why
        if self.view is not None and not self.view.reachable:
            self._blind = True
            return None  # the store is moving (a new leader): no news is not silence
        if self._blind:  # (the silence we could not see is not the workers')
            self._blind = False
            self._liveness.forgive(time.monotonic())
        # durations on the monotonic clock (workers.Worker.started_at); ``now`` is the wall
        # clock of the failure's timestamps
        return self._liveness.judge(rank, worker.pid, worker.started_at, status, time.monotonic())

    def stopped_lines(self, signum: int) -> list[str]:
        """One line per rank of this node after ``stop(signum=...)``: how it ended."""
        lines = []
        for rank, worker in sorted(self.workers.items()):
            code = worker.poll()
            if rank in self.finished or rank in self.failed:
                continue
            how = f"exit code {code}" if code is None or code >= 0 else f"signal {-code}"
            said = from_stderr(list(worker.stderr_tail), any_line=False)
            where = f" ({said.message}{' at ' + said.where if said.where else ''})" if said else ""
            lines.append(f"[rank {rank}]: stopped by signal {signum}: {how}{where}")
        return lines

    def move_store(self, addr: str, port: int) -> None:
        """The round's worker store moved to a new leader: read it, and send replacements
        there."""
        self.s = self.s.moved_to(addr, port)
        if self.view is not None:
            self.view.move(addr, port)
        self._blind = True  # (the next judgement counts silence from then)

    def preempt(self, signum: int) -> dict[str, list[int]]:
        """A preemption notice to this node's live workers: chameleon_runtime workers
        hear it through their mailbox (they agree on the step to stop at), the others
        get the signal itself, as torchrun forwards it. Returns who got which."""
        told: dict[str, list[int]] = {"mailbox": [], "signal": []}
        if self.view is not None:
            self._runtime_ranks |= set(self.view.statuses(sorted(self.workers)))
        for rank, worker in sorted(self.workers.items()):
            if worker.poll() is not None:
                continue
            runtime = rank in self._runtime_ranks and self.view is not None
            if runtime and self.view.ask_save(rank, signum):  # type: ignore[union-attr]
                told["mailbox"].append(rank)
                continue
            signal_worker(worker, signum)
            told["signal"].append(rank)
        return told

    def kill_now(self) -> None:
        """SIGKILL every worker's session at once, from any thread (no waiting, no
        reaping: ``stop`` does those on the main thread)."""
        for worker in list(self.workers.values()):
            signal_worker(worker, signal.SIGKILL)

    def stop(self, *, signum: int = signal.SIGTERM, grace_s: float) -> None:
        self.injection.close()  # (a stopped worker would not hear the signal)
        stop_workers(
            list(self.workers.values()), signum=signum, grace_s=grace_s, reaper=self.reaper
        )


def _read_beat(path: Path) -> ScriptBeat | None:
    try:
        with open(path, "rb") as f:
            return ScriptBeat.decode(f.read(BEAT_RECORD_BYTES))
    except OSError:
        return None


def _error_report(worker: Worker, *, exited: bool) -> ErrorReport | None:
    """What the worker said about its failure: its error file (torchrun's ``@record``),
    else its stderr's last traceback or telling line (launcher/rootcause.py)."""
    report = read_error_file(worker.error_file) if exited else None
    if report is None:
        time.sleep(0.05)  # let the pump drain what the process wrote before dying
        report = from_stderr(list(worker.stderr_tail), any_line=exited)
    return report
