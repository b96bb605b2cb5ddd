"""Fault injection on this node's workers (``--inject-fault``): each due fault is carried
out (SIGKILL, SIGSTOP, an exit asked through the worker's mailbox, or a slowdown on a
charge of stops for the CPU it runs: launcher/throttle.py), and workers
waiting at a failpoint are let go once the fault for it has fired. ``LocalGroup`` owns
one ``FaultInjection`` and hands it its workers and their statuses at each poll."""

from __future__ import annotations

import signal
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

from launcher.faults import FaultKind, FaultSpec, Injector
from launcher.throttle import Duty, Throttle
from launcher.workers import Worker, signal_worker

if TYPE_CHECKING:
    from chameleon_runtime.protocol.messages import RecoveryPhase
    from launcher.settings import RoundSettings
    from launcher.worker_store import WorkerStoreView


class FaultInjection:
    """The faults of one round on one node: which are due (``Injector``), which
    failpoints the workers were started with and still wait at, and the leader's
    recovery phase when the leader is this process."""

    def __init__(self, injector: Injector, settings: RoundSettings, emit: Callable[..., Any]):
        self.injector = injector
        self.s = settings
        self.emit = emit
        self.failpoints = set(injector.failpoints())  # armed in the workers
        self.phase: RecoveryPhase | None = None  # the leader's, when it is this process
        self.started_at = 0.0  # when this round's workers started (``at=`` faults)
        self.throttles: dict[int, Throttle] = {}  # slowed ranks (slow faults)

    def env(self) -> dict[str, str]:
        """A worker's environment for the failpoints it must wait at."""
        return (
            {"CHAMELEON_FAILPOINTS": ",".join(sorted(self.failpoints))} if self.failpoints else {}
        )

    def watches_status(self) -> bool:
        return self.injector.watches_status()

    def fire(
        self,
        now: float,
        statuses: Mapping[int, Any],
        *,
        workers: Mapping[int, Worker],
        alive: Collection[int],
        view: WorkerStoreView | None,
        beats: Mapping[int, Any] | None = None,
    ) -> list[int]:
        """Carry out the faults due now; the ranks they hit. ``beats``: plain scripts'
        steps from their heartbeats, for when a step fault is due only (such a rank is
        no runtime worker: an exit fault is its SIGTERM)."""
        phase = self.phase
        if phase is None and view is not None and self.injector.pending:
            phase = (
                view.recovery_phase()
                if any(f.phase or f.recovery for f in self.injector.pending)
                else None
            )
        hit = []
        seen = {**beats, **statuses} if beats else statuses
        for fault in self.injector.due(
            now, since_start_s=now - self.started_at, status=seen, phase=phase, alive=alive
        ):
            worker = workers.get(fault.rank)
            if worker is None or worker.poll() is not None:
                continue
            if fault.kind is FaultKind.KILL:
                signal_worker(worker, signal.SIGKILL)
            elif fault.kind is FaultKind.HANG:
                signal_worker(worker, signal.SIGSTOP)
            elif fault.kind is FaultKind.SLOW:
                self._slow(fault, worker, workers)
            else:
                self._request_exit(fault, worker, statuses.get(fault.rank), view)
            hit.append(fault.rank)
            status = statuses.get(fault.rank)
            self.emit(
                "fault_injected",
                rank=fault.rank,
                kind=fault.kind.value,
                attempt=self.s.attempt,
                detail=fault.describe(),
                worker_phase=status.phase if status is not None else None,
                recovery_phase=phase.phase if phase is not None else None,
            )
        self._release_failpoints(view)
        return hit

    def _slow(self, fault: FaultSpec, worker: Worker, workers: Mapping[int, Worker]) -> None:
        """``workers``: the node's, kept up to date by its group (a peer replaced while
        the slowdown lasts is the new one when the throttle next asks)."""
        rank, factor = fault.rank, fault.factor

        def peers() -> list[int]:
            # (returncode, not poll(): this runs on the throttle's thread, and reaping
            # is the group's)
            return [
                w.pid for r, w in list(workers.items()) if r != rank and w.popen.returncode is None
            ]

        old = self.throttles.pop(rank, None)
        if old is not None:
            old.close()

        def ended(lasted_s: float, duty: Duty) -> None:
            self.emit(
                "slowdown_ended", rank=rank, factor=factor, lasted_s=round(lasted_s, 3),
                reached=round(duty.reached, 2), boost=round(duty.boost, 3),
                boost_max=round(duty.boost_max, 3), priority=duty.priority,
            )  # fmt: skip

        self.throttles[rank] = Throttle(worker, factor, fault.for_s, ended, peers)

    def throttled(self, rank: int) -> bool:
        """Whether ``rank`` is being slowed now: its stops are the throttle's own."""
        throttle = self.throttles.get(rank)
        return throttle is not None and throttle.active

    def close(self) -> None:
        """End every slowdown (the round ends): no worker is left stopped."""
        for throttle in self.throttles.values():
            throttle.close()
        self.throttles.clear()

    def _release_failpoints(self, view: WorkerStoreView | None) -> None:
        """Workers waiting where a fault of this node was to fire go on once it has."""
        fired = self.failpoints - set(self.injector.failpoints())
        if fired and view is not None:
            for phase in sorted(fired):
                view.release_failpoint(self.s.node_rank, phase)
            self.failpoints -= fired

    def _request_exit(
        self, fault: FaultSpec, worker: Worker, status: Any, view: WorkerStoreView | None
    ) -> None:
        """A chameleon worker exits with the asked code (its watcher hears it at once); a
        plain script cannot be asked, so it gets SIGTERM."""
        if view is not None and status is None:
            status = view.statuses([fault.rank]).get(fault.rank)
        if view is not None and status is not None and status.pid == worker.pid:
            self.emit("exit_requested", rank=fault.rank, code=fault.code)
            view.ask_exit(fault.rank, fault.code, worker.pid)
        else:
            signal_worker(worker, signal.SIGTERM)
