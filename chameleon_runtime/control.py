"""The worker's side of the control channel: the store the launcher hosts for this attempt
(MASTER_ADDR:MASTER_PORT), spoken through ``chameleon_runtime.protocol.messages``.

Waits block in the store (``TCPStore.wait``) instead of polling it. The one wait that the
launcher's abort must be able to end, an all-or-none agreement, is ended by the watcher
thread: it poisons the agreement's counter, which writes the agreement's result key.

An agreement (the commit of a step, a checkpoint, a migration) is decided by one counter:
it holds when the arrivals reach the number of members; a member that hears an abort
first poisons the counter with one atomic add, so no later arrival can reach it, unless
it already had. Whoever decides writes the result ("yes" or "no") under one key that
every member waits for. A member that saw an abort still applies a step the others
applied: the counter, not the abort, is the commit point (a plain flag or read let
survivors disagree on the step to resume, and the job restarted).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch.distributed as dist
from pydantic import BaseModel

from chameleon_runtime import preemption, storeaddr
from chameleon_runtime.comm import Collective, Generation, settle
from chameleon_runtime.liveness import FOREVER, Heartbeat, Interrupts, Status, Watcher, moved
from chameleon_runtime.protocol.messages import Aware, Keys, encode
from chameleon_runtime.protocol.seal import TOKEN_ENV, Seal
from chameleon_runtime.protocol.wire import PlanMessage
from chameleon_runtime.stopsignals import StopSignals


# The phases where an injected fault waits for the worker (Control.failpoint), and for
# how long at most: a bound, so a fault that never fires costs a test seconds, not a hang.
def failpoints() -> frozenset[str]:
    """Read per worker, not when this module loads (the warm fork server imports it
    before any worker's environment exists: launcher/preload.py)."""
    return frozenset(p for p in os.environ.get("CHAMELEON_FAILPOINTS", "").split(",") if p)


FAILPOINT_WAIT = timedelta(seconds=2)
# What a store that stopped answering raises (a reset connection, a timed-out wait).
STORE_LOST = (dist.DistNetworkError, dist.DistStoreError)


def poison(store: dist.Store, done_key: str) -> None:
    """End an agreement that has not held yet: its done key is written once (compare_set),
    by whichever comes first, the last arrival's "yes" or a poison's "no", and every
    member reads that one value, so an agreement holds for all of its members or for none.
    Any poisoner may write it, so no single member's death leaves it undecided. Before,
    the counter was poisoned first and the first poison alone wrote the result: killed
    between the two, or the last arrival killed between its add and its "yes", it left
    the others waiting on the done key forever (CI: a kill in a recovery's confirm
    phase, and the launcher's collect waited for them)."""
    store.compare_set(done_key, "", "no")


class Finished(Exception):  # noqa: N818 - an outcome, not an error
    """Training ended (some worker did its last step) while this one waited for a plan."""

    def __init__(self, step: int) -> None:
        super().__init__(f"training finished at step {step}")
        self.step = step


# What the key naming the plan after a generation holds when none follows: training ended.
END_MARK = "end:"
# How often a worker waiting for the next plan also looks at the newest (Control.
# _wait_for_plan): the key it waits on can be deleted under it.
PLAN_LOOK_S = 1.0


class Agreed(NamedTuple):
    held: bool  # every member arrived before an abort
    last: bool  # this worker arrived last (it may clean up what the others no longer read)


@dataclass(frozen=True)
class _Pending:
    generation: int
    done_key: str


class Control:
    """One worker's connection to the store, with its heartbeat and watcher threads."""

    def __init__(
        self, addr: str, port: int, rank: int, *, attempt: int = 0, timeout_s: float = 300.0
    ) -> None:
        self.rank = rank
        self.keys = Keys(attempt)
        self.failpoints = failpoints()  # --inject-fault's, armed in this worker
        self._timeout = timedelta(seconds=timeout_s)
        self.store = storeaddr.connect(addr, port, self._timeout)
        # A replacement started after the store moved begins at the file's epoch.
        now = storeaddr.read()
        self.epoch = now.epoch if now is not None and (now.addr, now.port) == (addr, port) else 0
        # Control messages are signed with the job token (chameleon_runtime.protocol.seal.Seal); what is
        # unsigned or signed with another is ignored, and said once on stderr.
        self.seal = Seal(
            os.environ.get(TOKEN_ENV),
            os.environ.get("TORCHELASTIC_RUN_ID", ""),
            on_refused=lambda where: print(
                f"[rank {rank}] chameleon: ignored a control message not signed with this "
                f"job's token ({where}); later ones are ignored silently",
                file=sys.stderr,
                flush=True,
            ),
        )
        self.status = Status(rank)
        self.stop_signals = StopSignals(rank)
        self.interrupts = Interrupts()
        preemption.hear(lambda signum: setattr(self.interrupts, "preempt_signal", signum))
        self._lock = threading.Lock()
        self._pending: _Pending | None = None
        self.heartbeat = Heartbeat(addr, port, self.keys, self.status, self.epoch, self.seal)
        self.watcher = Watcher(
            addr, port, self.keys, rank, self.interrupts, self._on_abort, self.epoch, self.seal
        )

    def reconnect(self) -> bool:
        """The store stopped answering: move to the one that replaced it (a new leader's,
        chameleon_runtime.storeaddr). False when none is coming; the caller re-raises.
        What the old store held for this worker is gone with it: the caller reports Ready
        again, and the new leader plans from the reports."""
        found = moved(self.epoch, self._timeout)
        if found is None:
            return False
        self.store, self.epoch = found
        return True

    # -- plain values --------------------------------------------------------------------

    def put(self, key: str, value: Any) -> None:
        self.store.set(key, value.model_dump_json() if isinstance(value, BaseModel) else value)

    def get(self, key: str) -> bytes | None:
        return self.store.get(key) if self.store.check([key]) else None

    def wait(self, key: str) -> bytes:
        """Block until ``key`` is set; no timeout: the launcher's timeouts judge hangs."""
        with self.stop_signals.blocked("the launcher"):
            self.store.wait([key], FOREVER)
        return self.store.get(key)

    def put_signed(self, key: str, value: Any) -> None:
        """A control message (a plan, the job's description, the end): signed."""
        body = value.model_dump_json() if isinstance(value, BaseModel) else value
        self.store.set(key, self.seal.seal(body))

    def get_signed(self, key: str) -> str | None:
        """A control message, or None if it is not set or not signed with our token."""
        raw = self.get(key)
        return None if raw is None else self.seal.open(raw, key)

    def wait_signed(self, key: str) -> str:
        """Block until ``key`` holds a message signed with our token: a forged one is
        overwritten by the real one, which is waited for."""
        while True:
            body = self.seal.open(self.wait(key), key)
            if body is not None:
                return body
            time.sleep(0.05)

    def catch_up(self, generation: int) -> None:
        """A process that starts mid-job (a replacement) hears its mailbox from now on: an
        abort of ``generation`` or the end of training that came before, it reads from the
        store and acts on as the mailbox would have. (The launcher asks for a replacement
        just after it aborts the generation its predecessor died in; one that reads that
        generation as the newest and waits on it as a spare would wait to the end.)"""
        if self.get_signed(self.keys.abort(generation)) is not None:
            self.interrupts._abort(generation)
        finished = self.get_signed(self.keys.finished)
        if finished is not None:
            self.interrupts._finish(int(finished))

    def push_signed(self, queue: str, message: BaseModel) -> None:
        self.store.queue_push(queue, self.seal.seal(encode(message)))

    def tell_leader(self, message: BaseModel) -> None:
        self.push_signed(self.keys.inbox, message)

    def failpoint(self, phase: str) -> None:
        """Fault injection only: where the launcher will kill a rank in ``phase`` (a
        migration, a group build), the worker, having just published that phase, waits
        here until its agent says the fault has fired (or FAILPOINT_WAIT passes). Without
        it the kill raced the phase: a migration of a few milliseconds ended before the
        agent's next look. Armed only by --inject-fault (CHAMELEON_FAILPOINTS)."""
        if phase not in self.failpoints:
            return
        node = int(os.environ.get("GROUP_RANK", "0"))
        with contextlib.suppress(Exception):  # the wait timing out: go on
            self.store.wait([self.keys.failpoint(node, phase)], FAILPOINT_WAIT)

    def step_failpoint(self, step: int) -> None:
        """Fault injection only: a fault at step N of this rank (``kill:rank=R,step=N``)
        fires once the rank has done N + 1 steps; the rank waits at that boundary until
        it has. Without it the kill landed wherever the agent's next look found the rank,
        which on a fast model was several steps (or the end of the run) later."""
        if self.failpoints:  # (none armed: no name built on every step)
            self.failpoint(Keys.step_failpoint(self.rank, step - 1))

    def register(self, device: str) -> None:
        self.put(self.keys.aware(self.rank), Aware(pid=os.getpid(), device=device))

    # -- agreements ----------------------------------------------------------------------

    def agree(self, generation: int, name: str, members: int) -> Agreed:
        """Held when every member arrived before an abort of the generation poisoned it (then
        it holds for all of them), not held when the poison came first (for none of them):
        one write decides (``poison``)."""
        count_key = self.keys.agreement(generation, name)
        done_key = self.keys.agreement_done(generation, name)
        arrived = self.store.add(count_key, 1)
        if arrived == members:  # held, unless a poison wrote first (``poison``)
            decided = self.store.compare_set(done_key, "", "yes")
            return Agreed(held=decided == b"yes", last=True)
        pending = _Pending(generation, done_key)
        with self._lock:
            self._pending = pending
            aborted = self.interrupts.aborted(generation)
        try:
            if aborted:  # the abort came before we were registered: poison it ourselves
                poison(self.store, done_key)
            with (
                self.status.waiting("agree", name=name),
                self.stop_signals.blocked(f"its peers ({name})"),
            ):
                self.store.wait([done_key], FOREVER)
        finally:
            with self._lock:
                self._pending = None
        return Agreed(held=self.store.get(done_key) == b"yes", last=False)

    def _on_abort(self, store: dist.Store, generation: int) -> None:
        """Watcher thread: end the agreement the main thread is blocked in."""
        with self._lock:
            pending = self._pending
        if pending is not None and pending.generation <= generation:
            poison(store, pending.done_key)

    # -- plans ---------------------------------------------------------------------------

    def next_plan(self, after: int) -> PlanMessage:
        """The newest plan published after generation ``after``, once there is one. (A
        newer one may be out already, and ``after``'s keys retired with it: look first.)"""
        latest_now = self.get_signed(self.keys.latest)
        if latest_now is None or int(latest_now) <= after:
            with self.status.waiting("plan"):
                self._wait_for_plan(after)
        latest = int(self.wait_signed(self.keys.latest))
        return self._plan(latest)

    def _wait_for_plan(self, after: int) -> None:
        """Until the successor key of generation ``after`` says which plan follows, or that
        training ended (``Finished``): a worker that did the last step while the others
        waited for a recovery's plan (an abort it heard too late) marks its generation's
        successor key so (``end``); no plan follows, and waiting forever kept the job from
        ending. The newest plan is looked at every ``PLAN_LOOK_S`` too: once a later
        generation is confirmed, the keys of ``after`` are deleted (launcher/coordinator.py
        ``_forget``), and a worker the plan left out (a spare: the plan's members alone
        confirm it) may not have read its key by then; waiting on it alone waited forever
        (seen in CI: two spares of a 1x1 plan, and the job never ended)."""
        key = self.keys.next(after)
        while True:
            try:
                with self.stop_signals.blocked("the launcher"):
                    self.store.wait([key], timedelta(seconds=PLAN_LOOK_S))
            except dist.DistStoreError:  # not there yet, or deleted: has the plan moved on?
                latest = self.get_signed(self.keys.latest)  # (a store really lost raises here)
                if latest is not None and int(latest) > after:
                    return
                continue
            raw = self._get_within(key, PLAN_LOOK_S)
            if raw is None:  # deleted after the wait saw it: look at the newest plan again
                continue
            body = self.seal.open(raw, key)
            if body is None:  # forged: the real one overwrites it
                time.sleep(0.05)
                continue
            if body.startswith(END_MARK):
                raise Finished(int(body[len(END_MARK) :]))
            return

    def _get_within(self, key: str, seconds: float) -> bytes | None:
        """``key``'s value, or None when it is not there within ``seconds``: a get of a
        key waits for it (for the store's whole timeout), and a key a wait saw can be
        deleted before the get (seen on a busy host: a spare descheduled between the two
        while the next generation was confirmed, then blocked for 300 s)."""
        self.store.set_timeout(timedelta(seconds=seconds))
        try:
            return self.store.get(key)
        except dist.DistStoreError:
            return None
        finally:
            self.store.set_timeout(self._timeout)

    def end(self, generation: int, step: int) -> None:
        """Training is over at ``step``: workers waiting for the plan after ``generation``
        learn it (unless a plan came first: then they were not waiting for this one)."""
        self.store.compare_set(self.keys.next(generation), "", self.seal.seal(f"{END_MARK}{step}"))

    def latest_plan(self) -> PlanMessage:
        return self._plan(int(self.wait_signed(self.keys.latest)))

    def _plan(self, generation: int) -> PlanMessage:
        message = PlanMessage.model_validate_json(self.wait_signed(self.keys.plan(generation)))
        if message.generation != generation:  # a signed plan moved to another key
            raise ValueError(f"plan under generation {generation} is {message.generation}'s")
        return message

    def forget(self, keys: list[str]) -> None:
        for key in keys:
            self.store.delete_key(key)

    def generation(
        self,
        generation: int,
        members: list[int],
        collectives: dict[tuple[int, ...], Collective],
        wanted: list[tuple[int, ...]],
        **kwargs: Any,
    ) -> Generation:
        """Generation ``generation``'s group over ``members`` (chameleon_runtime.comm), on
        this worker's store, abortable by its interrupts; ``kwargs``: ``transport``,
        ``adopt`` (a group carried over)."""
        # Its groups are built on a connection of their own: a build blocks in the store
        # until every member has written its address, and a member lost meanwhile leaves
        # it blocked until its timeout, with the connection it uses; the abort, the Ready
        # and the next plan go over this worker's own, never behind it.
        return Generation(
            store=self.store.clone(),
            prefix=self.keys.groups(generation),
            generation=generation,
            members=members,
            me=self.rank,
            interrupts=self.interrupts,
            status=self.status,
            collectives=collectives,
            wanted=wanted,
            **kwargs,
        )

    def close_settled(self) -> None:
        """The end of a worker: its groups' threads end first (one still running when the
        interpreter ends aborts the process), then the store's threads; a transfer of
        a live generation that would not end is reported (a peer stopped answering)."""
        stuck = settle(timeout_s=5.0)
        self.close()
        if stuck:
            print(
                f"chameleon_runtime: rank {self.rank} exits with {len(stuck)} transfer(s) "
                f"unfinished, a peer not answering: {'; '.join(stuck)}",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        """Stop both threads and wait for them (a thread inside a store call when the
        interpreter finalizes aborts the process)."""
        self.watcher.close(self.store)
        self.heartbeat.close()
