"""An agent's link to an etcd control plane through outages and fencing.

etcd unreachable is not a failure of the job: the workers train on their own worker store
(the leader's), and etcd extends every lease when it comes back (its new leader renews
them all), so nobody is counted lost for the outage itself. Meanwhile an agent keeps
watching its workers and holds what it could not say (failures, in order) until etcd
answers again; a failure then recovers in place as usual. Nothing is decided while etcd
is out of reach: the leader publishes no plan (each one writes its generation to etcd
first, launcher/coordinator.py), so a leader cut off from the others cannot regroup its
side alone. Past ``--control-outage-timeout`` the agent gives up (exit 3).

A node whose lease ran out while it was cut off or stopped is fenced: the others have
counted its ranks lost and gone on. etcd itself refuses its writes (each is a transaction
on its lease's key, launcher/etcd.py), its heartbeat finds the lease expired, and the
agent kills its workers at once, before they act on their stale generation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from launcher.rendezvous import ControlPlane
from launcher.supervisor import Failure


class ControlLink:
    def __init__(
        self, timeout_s: float, emit: Callable[..., None], say: Callable[[str], None]
    ) -> None:
        self.timeout_s = timeout_s
        self.emit = emit
        self.say = say
        self.since: float | None = None  # monotonic: when etcd stopped answering
        self.fenced: str | None = None  # why, once the lease is known to be gone
        self.unreported: list[Failure] = []
        self._last_answer = time.monotonic()
        self._last_beat = time.monotonic()  # when the last beat that went through was sent
        self._held = 0  # failures held back during this outage
        self._lease_s: float | None = None  # set while a lease watch runs

    def beat(self, sent: float) -> None:
        """A heartbeat sent at ``sent`` (monotonic) went through. One sent a lease or more
        after the last that went through renews nothing: the leader may have counted
        this node lost in between (a node frozen whole, resumed, beats at once and gets
        through), so the watch must still fence it."""
        lease_s = self._lease_s
        if lease_s is not None and sent - self._last_beat >= lease_s:
            return
        self._last_beat = max(self._last_beat, sent)

    def watch_lease(
        self,
        lease_s: float,
        endpoint: str,
        on_fenced: Callable[[str], None],
        stop: threading.Event,
    ) -> threading.Thread:
        """A TCPStore follower's lease, on its own clock. The leader counts this node lost
        once its heartbeat count has not moved for ``lease_s`` on the leader's clock, never
        before ``lease_s`` after the last beat that went through was sent; past that, with
        no beat through since, this node tells itself fenced, so that its workers stop by
        the time the others go on without them. A thread of its own: a call to a store
        across a partition may block the others for good."""
        self._lease_s = lease_s

        def watch() -> None:
            while self.fenced is None and not stop.is_set():
                silent = time.monotonic() - self._last_beat
                if silent >= lease_s:
                    on_fenced(
                        f"cut off from the control store at {endpoint}: no heartbeat went "
                        f"through for {silent:.1f} s (--heartbeat-timeout {lease_s:g}), so "
                        f"the job counts this node lost"
                    )
                    return
                stop.wait(min(0.1, lease_s / 10))

        thread = threading.Thread(target=watch, name="lease-watch", daemon=True)
        thread.start()
        return thread

    def fence(self, why: str) -> None:
        """The heartbeat thread found the lease expired (a plain assignment: no lock)."""
        if self.fenced is None:
            self.fenced = why

    def report(self, control: ControlPlane, failures: list[Failure]) -> None:
        """Report new failures after any held back by an outage, in order; what the
        store refuses stays held (the caller's StoreError starts or continues the outage)."""
        self.unreported += failures
        while self.unreported:
            control.report_failure(self.unreported[0])
            self.unreported.pop(0)

    def unreachable(self, detail: str) -> bool:
        """No etcd member answered; whether the outage has outlasted its timeout."""
        now = time.monotonic()
        self._held = max(self._held, len(self.unreported))
        if self.since is None:
            # (from the last look that went through: the failed call itself waited)
            self.since = self._last_answer
            self.emit("control_unreachable", detail=detail)
            self.say(
                f"chameleon: etcd is out of reach ({detail}); training goes on, and "
                f"failures wait for it (up to --control-outage-timeout "
                f"{self.timeout_s:g} s)"
            )
        return now - self.since > self.timeout_s

    def answered(self) -> None:
        """A look at the store went through: an outage, if any, is over."""
        self._last_answer = time.monotonic()
        if self.since is None:
            return
        lasted = self._last_answer - self.since
        self.since, held, self._held = None, self._held, 0
        self.emit("control_restored", outage_s=round(lasted, 3), held=held)
        self.say(f"chameleon: etcd answers again after {lasted:.1f} s")

    @property
    def out(self) -> bool:
        return self.since is not None
