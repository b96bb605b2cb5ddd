"""A worker's two background threads: the heartbeat, which says it is alive and what it is
doing, and the watcher, which hears the launcher's messages at once.

Why a heartbeat thread and not a heartbeat after each step: liveness and progress are
different questions. A step, a checkpoint or an evaluation may take minutes; the thread
keeps beating through it (every ``CHAMELEON_HEARTBEAT_S``, at most a second, and at once
when the main thread changes phase), so the launcher's liveness timeout only catches a process that is gone or
frozen (SIGSTOP, a dead interpreter), and its progress timeouts (launcher/watch.py) judge
the steps. The status also says what the worker waits on, so that when one worker stalls,
the launcher blames it and not the peers that wait for it.

Why a watcher blocked on a mailbox queue (``TCPStore.queue_pop``) and not polling: an abort
reaches the worker the moment the launcher sends it, at no cost to the store in between.
On an abort it wakes every wait of that generation (``Interrupts``) and poisons the
agreement the main thread is blocked in (chameleon_runtime.control), so no wait outlives
its generation. An exit request (fault injection) ends the process from this thread.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from chameleon_runtime import storeaddr
from chameleon_runtime.protocol.messages import (
    MAILBOX,
    Abort,
    Exit,
    Finish,
    Keys,
    Save,
    Settled,
    Stop,
    WaitingOn,
    WorkerStatus,
)
from chameleon_runtime.protocol.seal import Seal


# The launcher sets the period from its --heartbeat-timeout (launcher/watch.py).
def heartbeat_period_s() -> float:
    """Read when a heartbeat starts, not when this module loads: the warm fork server
    imports it before any worker's environment exists (launcher/preload.py)."""
    return float(os.environ.get("CHAMELEON_HEARTBEAT_S", "1.0"))


# The watcher's connection waits for the next message as long as the job runs.
FOREVER = timedelta(days=365)


def _count(path: str) -> int | None:
    try:
        return len(os.listdir(path))
    except OSError:
        return None


class Status:
    """What this worker is doing, written by the main thread and published by the
    heartbeat thread (the only writer of the status key)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._fields: dict[str, Any] = {
            "pid": os.getpid(),
            "beat": 0,
            "phase": "startup",
            "generation": 0,
            "step": 0,
            "progress": 0,
        }
        self._changed = threading.Condition()
        self._dirty = False

    def update(self, *, publish: bool = True, **fields: Any) -> None:
        """Change fields; ``publish`` wakes the heartbeat thread to write them now (phase
        changes must reach the launcher at once: fault injection and the blame chain
        read them). A new generation's status has no pace of its own until its steps
        give one: ``pace_steps`` counts this generation's steps, and the means beside it
        are the last one's until then (the leader judged them as the new generation's,
        and dealt around a worker at a factor read before a failure)."""
        with self._changed:
            if fields.get("generation", self._fields["generation"]) != self._fields["generation"]:
                fields.setdefault("pace_steps", 0)
            self._fields.update(fields)
            if publish:
                self._dirty = True
                self._changed.notify()

    @contextlib.contextmanager
    def waiting(self, what: str, peers: tuple[int, ...] = (), name: str = "") -> Iterator[None]:
        """Mark a blocking wait (not published by itself: a wait is worth reporting only
        when it lasts, and the next beat does that)."""
        with self._changed:
            before = self._fields.get("waiting_on")
            self._fields["waiting_on"] = WaitingOn(what=what, peers=list(peers), name=name)
        try:
            yield
        finally:
            with self._changed:
                self._fields["waiting_on"] = before

    def get(self, name: str) -> Any:
        with self._changed:
            return self._fields.get(name)

    def _next(self, timeout_s: float) -> WorkerStatus:
        with self._changed:
            if not self._dirty:
                self._changed.wait(timeout_s)
            self._dirty = False
            self._fields["beat"] += 1
            fields = dict(self._fields)
        fields["fds"] = _count("/proc/self/fd")
        fields["threads"] = _count("/proc/self/task")
        return WorkerStatus(**fields)

    def wake(self) -> None:
        with self._changed:
            self._dirty = True
            self._changed.notify()


def moved(epoch: int, timeout: timedelta) -> tuple[dist.TCPStore, int] | None:
    """A connection to the store that replaced epoch ``epoch``'s (chameleon_runtime.
    storeaddr), with its epoch; None when none is coming."""
    found = storeaddr.newer_than(epoch)
    if found is None:
        return None
    try:
        store = storeaddr.connect(found.addr, found.port, timeout)
    except Exception:
        return None
    return store, found.epoch


class Heartbeat:
    """Publishes ``Status`` to ``status/<rank>`` every period and on every change."""

    def __init__(
        self, addr: str, port: int, keys: Keys, status: Status, epoch: int, seal: Seal
    ) -> None:
        self._store = storeaddr.connect(addr, port, timedelta(seconds=60))
        self._epoch = epoch
        self._seal = seal
        self._key = keys.status(status.rank)
        self._status = status
        self._stop = threading.Event()
        self._period_s = heartbeat_period_s()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # The last snapshot is written even when the thread is told to stop: it is the one
        # that says "done". Dropped, the launcher saw a finished spare as still "spare" and,
        # while its interpreter took more than --heartbeat-timeout to exit, judged it hung.
        while True:
            snapshot = self._status._next(self._period_s)
            try:
                self._store.set(
                    self._key, self._seal.seal(snapshot.model_dump_json(exclude_none=True))
                )
            except Exception:
                # The store is gone: a new one is coming (a new leader), or the launcher
                # is ending this worker.
                found = moved(self._epoch, timedelta(seconds=60))
                if found is None:
                    return
                (self._store, self._epoch), self._status._dirty = found, True
                continue
            if self._stop.is_set():
                return

    def close(self) -> None:
        self._stop.set()
        self._status.wake()
        self._thread.join(timeout=5.0)


class Interrupts:
    """Events to set when the generation they belong to is aborted: a wait registers one
    and blocks on it instead of polling."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: set[tuple[int, threading.Event]] = set()
        self._settle_waits: set[threading.Event] = set()
        self.aborted_upto = -1  # every generation up to this one is aborted
        self.settled_upto = -1  # the newest generation every member applied (``Settled``)
        self.finished: int | None = None
        # A preemption notice came (the launcher's Save): this member asks the others to
        # stop at the step they commit next (chameleon_runtime.preemption).
        self.preempt_signal: int | None = None

    @contextlib.contextmanager
    def watch(
        self, generation: int, event: threading.Event, *, settled: bool = False
    ) -> Iterator[None]:
        """``event`` set when ``generation`` is aborted or training ends; with ``settled``,
        also when a ``Settled`` comes (a spare's wait only: it ends no other)."""
        with self._lock:
            self._events.add((generation, event))
            if settled:
                self._settle_waits.add(event)
            if self.aborted_upto >= generation or self.finished is not None:
                event.set()
        try:
            yield
        finally:
            with self._lock:
                self._events.discard((generation, event))
                self._settle_waits.discard(event)

    def aborted(self, generation: int) -> bool:
        return self.aborted_upto >= generation

    def _abort(self, generation: int) -> None:
        with self._lock:
            self.aborted_upto = max(self.aborted_upto, generation)
            for gen, event in self._events:
                if gen <= generation:
                    event.set()

    def _settle(self, generation: int) -> None:
        """Wake a spare's wait (it drops its reserve: chameleon_runtime.membership)."""
        with self._lock:
            self.settled_upto = max(self.settled_upto, generation)
            for event in self._settle_waits:
                event.set()

    def _finish(self, step: int) -> None:
        with self._lock:
            self.finished = step
            for _gen, event in self._events:
                event.set()


class Watcher:
    """Pops this worker's mailbox and acts: ``Abort`` wakes the generation's waits and
    calls ``on_abort`` (which poisons a pending agreement), ``Exit`` ends the process,
    ``Finish`` wakes a spare, ``Save`` notes a preemption notice, ``Settled`` wakes a
    spare to drop its reserve, ``Stop`` ends the thread."""

    def __init__(
        self,
        addr: str,
        port: int,
        keys: Keys,
        rank: int,
        interrupts: Interrupts,
        on_abort: Callable[[dist.Store, int], None],
        epoch: int,
        seal: Seal,
    ) -> None:
        self._store = storeaddr.connect(addr, port, FOREVER)
        self._epoch = epoch
        self._seal = seal
        self._key = keys.mailbox(rank)
        self._interrupts = interrupts
        self._on_abort = on_abort
        self._thread = threading.Thread(target=self._run, name="mailbox", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me = os.getpid()
        while True:
            try:
                raw = self._store.queue_pop(self._key, block=True)
            except Exception as exc:
                found = moved(self._epoch, FOREVER)  # as the heartbeat's
                if found is None:
                    # Said, not silent: from here no abort reaches this worker, and a
                    # wait of its generation would end only when it is killed as hung.
                    print(
                        f"chameleon_runtime: pid {me} lost its mailbox ({exc}"[:300] + "); "
                        "the launcher's aborts no longer reach it",
                        file=sys.stderr,
                        flush=True,
                    )
                    return
                self._store, self._epoch = found
                continue
            body = self._seal.open(raw, self._key)
            if body is None:  # unsigned, or another token's: not the launcher's
                continue
            try:
                message = MAILBOX.validate_json(body)
            except ValueError:  # a launcher of a newer protocol: skip what it added
                continue
            if isinstance(message, Abort):
                self._interrupts._abort(message.generation)
                self._on_abort(self._store, message.generation)
            elif isinstance(message, Exit) and message.pid == me:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(message.code)
            elif isinstance(message, Finish):
                self._interrupts._finish(message.step)
            elif isinstance(message, Save):
                self._interrupts.preempt_signal = message.signal
            elif isinstance(message, Settled):
                self._interrupts._settle(message.generation)
            elif isinstance(message, Stop) and message.pid == me:
                return

    def close(self, store: dist.Store) -> None:
        """Stop the thread through the mailbox and join it: a thread still inside a store
        call when the interpreter finalizes aborts the process."""
        with contextlib.suppress(Exception):
            store.queue_push(self._key, self._seal.seal(Stop(pid=os.getpid()).model_dump_json()))
        self._thread.join(timeout=5.0)
