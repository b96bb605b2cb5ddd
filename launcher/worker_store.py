"""One attempt's worker store, seen from an agent: the chameleon_runtime workers' statuses,
fault-injection exit requests, replacement requests and the leader's recovery phase, all
through ``chameleon_runtime.protocol.messages``. The leader reads the store it hosts; other agents connect to
it the first time they need it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from chameleon_runtime.protocol.messages import (
    Exit,
    Keys,
    RecoveryPhase,
    Save,
    WorkerStatus,
    encode,
)
from chameleon_runtime.protocol.seal import Seal
from launcher.store import connect_store


class WorkerStoreView:
    def __init__(
        self,
        attempt: int,
        addr: str,
        port: int,
        hosted: Callable[[], Any | None],
        seal: Seal | None = None,
        link_s: float | None = None,
    ) -> None:
        """``hosted``: the store itself where this process hosts it (the leader);
        ``seal``: the job token's (statuses unsigned by it are not the workers');
        ``link_s``: the deadline on the connection (chameleon_runtime.protocol.link)."""
        self.keys = Keys(attempt)
        self.seal = seal or Seal(None, "")
        self._addr, self._port = addr, port
        self._link_s = link_s
        self._hosted = hosted  # the leader's own store, None on other agents
        self._client: Any = None
        self._known: set[int] = set()  # ranks that have posted a status
        # False while the store does not answer (its host's node lost, a new one not yet
        # served): silence then says nothing about the workers' heartbeats.
        self.reachable = True
        self._lost_at = 0.0  # when it stopped answering (monotonic)

    def move(self, addr: str, port: int) -> None:
        """The store moved (a new leader serves it): connect there from now on."""
        self._addr, self._port, self._client = addr, port, None
        self.reachable = True
        # Who has posted a status is known again from the new store: a multi_get of a key
        # never written there (a rank that died before moving) would block the agent.
        self._known = set()

    def _store(self) -> Any:
        hosted = self._hosted()
        if hosted is not None:
            return hosted
        if not self.reachable:
            # Gone (its host's node lost): connecting again would block this agent's loop
            # for the connect timeout; wait for ``move`` instead. Where the store can
            # move, try again now and then: a store that stays put (this node cut off
            # from the leader alone) is not waited for forever.
            if self._link_s is None or time.monotonic() - self._lost_at < 2 * self._link_s:
                raise ConnectionError("the worker store is gone")
            self._lost_at = time.monotonic()
        if self._client is None:
            timeout_s = 10.0 if self._link_s is None else self._link_s
            self._client = connect_store(
                self._addr, self._port, timeout_s=timeout_s, link_s=self._link_s
            )
        return self._client

    def statuses(self, ranks: Sequence[int]) -> dict[int, WorkerStatus]:
        """The statuses of ``ranks`` that have one, in one round trip once all posted."""
        try:
            store = self._store()
            for rank in ranks:
                if rank not in self._known and store.check([self.keys.status(rank)]):
                    self._known.add(rank)
            known = [r for r in ranks if r in self._known]
            values = store.multi_get([self.keys.status(r) for r in known]) if known else []
        except Exception:
            if self.reachable:
                self._lost_at = time.monotonic()
            self.reachable, self._client = False, None
            return {}
        self.reachable = True
        opened = {
            r: self.seal.open(v, self.keys.status(r)) for r, v in zip(known, values, strict=True)
        }
        return {r: WorkerStatus.model_validate_json(v) for r, v in opened.items() if v is not None}

    def ask_exit(self, rank: int, code: int, pid: int) -> None:
        message = self.seal.seal(encode(Exit(code=code, pid=pid)))
        self._store().queue_push(self.keys.mailbox(rank), message)

    def ask_save(self, rank: int, signum: int) -> bool:
        """A preemption notice to a chameleon_runtime worker (chameleon_runtime.preemption);
        False when the store is out of reach."""
        try:
            self._store().queue_push(
                self.keys.mailbox(rank), self.seal.seal(encode(Save(signal=signum)))
            )
        except Exception:
            return False
        return True

    def release_failpoint(self, node: int, phase: str) -> None:
        with contextlib.suppress(Exception):  # the store gone: nobody waits any more
            self._store().set(self.keys.failpoint(node, phase), "fired")

    def respawn_request(self, rank: int) -> int | None:
        """How many replacements the leader has asked for this rank (launcher/rejoin.py)."""
        try:
            store = self._store()
            key = self.keys.respawn(rank)
            if not store.check([key]):
                return None
            count = self.seal.open(store.get(key), key)
            return None if count is None else int(count)
        except Exception:
            return None

    def recovery_phase(self) -> RecoveryPhase | None:
        try:
            store = self._store()
            if not store.check([self.keys.phase]):
                return None
            body = self.seal.open(store.get(self.keys.phase), self.keys.phase)
            return None if body is None else RecoveryPhase.model_validate_json(body)
        except Exception:
            return None
