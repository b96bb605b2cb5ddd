"""Fault injection on this node's workers (``--inject-fault``), mixed into
``launcher.local.LocalGroup``: each due fault is carried out (SIGKILL, SIGSTOP, or an
exit asked through the worker's mailbox), and workers waiting at a failpoint are let go
once the fault for it has fired."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from launcher.faults import FaultKind, FaultSpec
from launcher.workers import Worker, signal_worker

if TYPE_CHECKING:
    from chameleon_runtime.protocol.messages import RecoveryPhase
    from launcher.faults import Injector
    from launcher.settings import RoundSettings
    from launcher.worker_store import WorkerStoreView


class InjectionMixin:
    """Mixed into ``LocalGroup``, whose state it reads."""

    s: RoundSettings
    view: WorkerStoreView | None
    workers: dict[int, Worker]
    failed: dict[int, Any]
    finished: set[int]
    emit: Callable[..., Any]
    _injector: Injector
    _failpoints: set[str]
    _fault_times: dict[int, float]
    _phase: RecoveryPhase | None
    _started_at: float

    def _failpoint_env(self) -> dict[str, str]:
        return (
            {"CHAMELEON_FAILPOINTS": ",".join(sorted(self._failpoints))} if self._failpoints else {}
        )

    def _release_failpoints(self) -> None:
        """Workers waiting where a fault of this node was to fire go on once it has."""
        fired = self._failpoints - set(self._injector.failpoints())
        if fired and self.view is not None:
            for phase in sorted(fired):
                self.view.release_failpoint(self.s.node_rank, phase)
            self._failpoints -= fired

    def _inject(self, now: float, statuses: dict) -> None:
        phase = self._phase
        if phase is None and self.view is not None and self._injector.pending:
            phase = (
                self.view.recovery_phase()
                if any(f.phase or f.recovery for f in self._injector.pending)
                else None
            )
        alive = {
            r for r, w in self.workers.items() if r not in self.failed and r not in self.finished
        }
        for fault in self._injector.due(
            now, since_start_s=now - self._started_at, status=statuses, phase=phase, alive=alive
        ):
            worker = self.workers.get(fault.rank)
            if worker is None or worker.poll() is not None:
                continue
            if fault.kind is FaultKind.KILL:
                signal_worker(worker, signal.SIGKILL)
            elif fault.kind is FaultKind.HANG:
                signal_worker(worker, signal.SIGSTOP)
            else:
                self._request_exit(fault, worker, statuses.get(fault.rank))
            self._fault_times[fault.rank] = now
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
        self._release_failpoints()

    def _request_exit(self, fault: FaultSpec, worker: Worker, status) -> None:  # noqa: ANN001
        """A chameleon worker exits with the asked code (its watcher hears it at once); a
        plain script cannot be asked, so it gets SIGTERM."""
        if self.view is not None and status is None:
            status = self.view.statuses([fault.rank]).get(fault.rank)
        if self.view is not None and status is not None and status.pid == worker.pid:
            self.emit("exit_requested", rank=fault.rank, code=fault.code)
            self.view.ask_exit(fault.rank, fault.code, worker.pid)
        else:
            signal_worker(worker, signal.SIGTERM)
