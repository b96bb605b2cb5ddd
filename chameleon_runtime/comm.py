"""Communication for one plan generation: one process group over the generation's
members, built straight on the store (no default group), point-to-point transfers matched
by their order (no tags: chameleon_runtime.transport), a group per set of workers that
all-reduce a bucket together (a ring program's collectives: planner.plans.program), and waits
that an abort ends at once.

Why every blocking call runs on a helper thread: gloo cannot interrupt a blocked wait or
a group being built (``abort()`` does not wake a waiter on torch 2.13). The main thread
hands the call to this generation's helper and blocks on an event that either the helper
(done) or the watcher thread (the generation was aborted: chameleon_runtime.liveness)
sets, so an abort ends the wait without polling.

Why groups are released by their helper, not leaked: an abandoned group's threads and
sockets would otherwise pile up with every recovery. Destroying a gloo group is quick
once nothing waits on it (tested on torch 2.13, peers alive or dead); what may still be
pending are the messages a drained step posted (chameleon_runtime.step), which complete
once the peer drains too, releases its own end, or dies. So ``abandon`` queues one last
job on the helper: wait for those, drop the group, end the thread. Nothing blocks the
main thread, and after a recovery the survivor holds one group, not one per failure.

Why collectives have groups of their own: a collective that a failure interrupts can
leave its group unusable (its members stopped at different points of the ring, and gloo
cannot cancel what is posted), so it must never be the point-to-point group. A gloo
collective whose peer is gone ends in an error as soon as that peer's connections close:
killed (measured on torch 2.13: every survivor's all-reduce failed within 25 ms of a
kill -9, mid-transfer or before it was posted) or, alive, once it lets go of its own end.
An aborted step posts the collectives it still owed (chameleon_runtime.reducer), as it
drains its messages, so on a group whose holders all live every posted all-reduce ends.
Such a group is ``settled`` and a later generation with the same holders carries it over
(chameleon_runtime.membership); one that is not is let go of once its own posted work has
ended, each on a thread of its own: released one after another, a member waiting for its
work on one group before letting go of another could wait on a peer that waits on it in
turn. A hung peer's collectives end once the launcher kills it. The trainer owns the
collective groups across generations (``Collective``); a generation uses them.

Timeouts: a group is built under a short timeout (every member has already arrived: the
``groups`` agreement, chameleon_runtime.membership) so a member lost during the build
cannot hold a helper for long; transfers wait up to ``op_timeout_s`` (torch's default of
30 minutes), a backstop only: hangs are the launcher's to judge (launcher/watch.py), and a
healthy step may be long.
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from chameleon_runtime.liveness import Interrupts, Status
from chameleon_runtime.transport import GlooTransport, Transport

BUILD_TIMEOUT_S = 30.0
OP_TIMEOUT_S = 1800.0
# How long a collective group let go of waits for its posted work before it is dropped
# anyway: a backstop, as OP_TIMEOUT_S (a peer gone ends the wait long before).
COLLECTIVE_RELEASE = timedelta(seconds=OP_TIMEOUT_S)


class Aborted(RuntimeError):
    """The launcher ended this generation."""


class CommError(RuntimeError):
    """A transfer or group failed: a peer died or its connection broke."""


_LIVE: set[_Helper] = set()
_LIVE_LOCK = threading.Lock()


class _Helper:
    """One thread that runs blocking calls in order; a ``None`` job ends it."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.busy_with: str | None = None  # what it is blocked on, for diagnostics
        # Draining an abandoned generation: its messages may never complete (two peers
        # each sending to the other when the step was aborted, neither receiving), and
        # that is harmless at exit (``settle``).
        self.releasing = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        with _LIVE_LOCK:
            _LIVE.add(self)
        self.thread.start()

    def _loop(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                fn, what, done, box = job
                self.busy_with = what
                try:
                    box.append((True, fn()))
                except Exception as exc:  # surfaced on the main thread
                    box.append((False, exc))
                self.busy_with = None
                done.set()
                # Not held while waiting for the next job: the job's closure holds its
                # work, and the work its tensors (a sharded model's last all-gather, a
                # whole block unsharded, stayed alive between steps: 3 MB of GPT-2's
                # 3.2M-parameter benchmark model, found by a census of live tensors).
                job = fn = done = box = None
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(self)

    def submit(self, fn: Callable[[], Any], what: str) -> tuple[threading.Event, list]:
        done, box = threading.Event(), []
        self._jobs.put((fn, what, done, box))
        return done, box

    def stop(self) -> None:
        self._jobs.put(None)


def settle(timeout_s: float, release_s: float = 1.0) -> list[str]:
    """Wait up to ``timeout_s`` in all for generations' helpers to finish (at most
    ``release_s`` of it for drains of abandoned generations); what is still blocked is
    kept alive past interpreter exit (a group destroyed while a thread of it still runs
    aborts the process). Returns what those still blocked wait on, less the drains: a
    message of an aborted step that its peer never received (the peer left that
    generation too) ends only with the process, which is expected and harmless."""
    with _LIVE_LOCK:
        helpers = list(_LIVE)
    start = time.monotonic()
    for helper in sorted(helpers, key=lambda h: h.releasing):  # drains last
        budget = release_s if helper.releasing else timeout_s
        helper.thread.join(timeout=max(0.0, start + min(budget, timeout_s) - time.monotonic()))
    stuck = [h for h in helpers if h.thread.is_alive()]
    for helper in stuck:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(helper))
    return [h.busy_with or "?" for h in stuck if not h.releasing]


@dataclass(eq=False)
class Kept:
    """A group that a later generation may carry over: built for generation ``built``
    over ``members`` (global ranks, in group-rank order).

    ``unsettled`` counts abandoned generations on it whose posted messages have not all
    completed. A message left unmatched on a group (a peer drained a step it never
    started; a migration interrupted half way) would match the next generation's next
    message between the same pair, so only a settled group may be carried over: then every
    message this worker posted on it was matched, and when every member says so, nothing
    is left posted in the group."""

    built: int
    members: list[int]
    group: Any
    unsettled: int = 0
    # Generations and the trainer holding it. The last to let go drops the group, so it
    # is destroyed where that happens (a generation's helper once its messages are
    # done, or the trainer after its helpers), never at interpreter exit.
    owners: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def acquire(self) -> Kept:
        with self.lock:
            self.owners += 1
        return self

    def let_go(self) -> None:
        with self.lock:
            self.owners -= 1
            last = self.owners <= 0
        if last:
            self.group = None

    @property
    def settled(self) -> bool:
        with self.lock:
            return self.unsettled == 0

    def _count(self, delta: int) -> None:
        with self.lock:
            self.unsettled += delta


def _failed(work: Any) -> bool:
    """Whether a completed collective ended in an error: waiting on it raises that error
    at once. (Work.exception() and is_success() print a deprecation warning in every
    worker on torch 2.13, and on torch 2.11 a failed work's exception() raises TypeError,
    "Unregistered type: std::exception_ptr", which ended every in-place recovery that kept
    a group: seen on an H100.)"""
    try:
        work.wait()
    except Exception:
        return True
    return False


@dataclass(eq=False)
class Collective:
    """A group over the holders of some of a ring's buckets, built for generation
    ``built``, with the collectives posted on it not yet known to have ended."""

    built: int
    holders: tuple[int, ...]
    group: Any
    posted: list[Any] = field(default_factory=list)

    @property
    def settled(self) -> bool:
        """Every collective posted on it ended well. Then every holder posted the same
        ones (an all-reduce ends only once all its holders posted it), and when every
        holder says so, nothing is left posted in the group (module doc)."""
        if all(w.is_completed() and not _failed(w) for w in self.posted):
            self.posted.clear()
            return True
        return False

    def let_go(self, transport: Transport, timeout: timedelta) -> None:
        """Drop the group once its posted work has ended, on a thread of its own (module
        doc): never on the caller's, as destroying a gloo group joins its threads (15 ms
        for two members here, more for more)."""
        if not transport.drains:
            transport.abort(self.group)
        box, works = [self.group], self.posted
        self.group, self.posted = None, []
        helper = _Helper(f"comm-gen{self.built}-c{self.holders[0]}")
        what = f"all-reduce of gen {self.built} with {list(self.holders)}"

        def release() -> None:
            helper.busy_with = what
            for work in works:
                with contextlib.suppress(Exception):
                    work.wait(timeout)
            works.clear()
            box.clear()  # the last reference: the group is destroyed here

        helper.submit(release, "release")
        helper.stop()


class Generation:
    """The group of one plan generation, over ``members`` (global ranks): the plan's
    workers plus survivors that only send layers away."""

    def __init__(
        self,
        *,
        store: dist.Store,
        prefix: str,
        generation: int,
        members: Sequence[int],
        me: int,
        interrupts: Interrupts,
        status: Status,
        transport: Transport | None = None,
        build_timeout_s: float = BUILD_TIMEOUT_S,
        op_timeout_s: float = OP_TIMEOUT_S,
        adopt: Kept | None = None,
        collectives: dict[tuple[int, ...], Collective] | None = None,
        wanted: Sequence[tuple[int, ...]] = (),
    ) -> None:
        """``collectives``: the trainer's collective groups by holders, those carried
        over included; the ones ``wanted`` that it lacks are built into it."""
        self.generation = generation
        self.me = me
        self.store = store  # what its groups (and the script's: usergroup) are built on
        self.members = list(adopt.members if adopt is not None else members)
        self._index = {rank: i for i, rank in enumerate(self.members)}
        self.interrupts = interrupts
        self.status = status
        self._op_timeout = timedelta(seconds=op_timeout_s)
        self.transport = transport if transport is not None else GlooTransport()
        # (work, the tensor it reads or writes, peer): posted, not yet known complete
        self._pending: list[tuple[Any, torch.Tensor, int]] = []
        self._held: list[Any] = []  # the group, owned here and dropped by the helper
        self._abandoned = False
        self._helper = _Helper(f"comm-gen{generation}")
        self.collectives = collectives if collectives is not None else {}
        self.sent_bytes = 0  # counted as posted: messages, and a ring's share of collectives
        timeout = timedelta(seconds=build_timeout_s)
        if adopt is not None:  # carried over: module doc of chameleon_runtime.membership
            self._held.append(adopt.group)
            self.group = adopt.group
            self.kept = adopt.acquire()
        else:
            group_store = dist.PrefixStore(prefix, store)

            def build() -> None:
                self._held.append(
                    self.transport.make_group(
                        group_store, self._index[me], len(self.members), timeout
                    )
                )

            try:
                self._run(build, "groups", ())
            except BaseException:
                self.abandon()  # the helper drops the group if the build still completes
                raise
            self.group = self._held[0]
            self.kept = Kept(generation, self.members, self.group).acquire()
        missing = sorted({h for h in wanted if me in h} - set(self.collectives))
        if missing:
            self._build_collectives(store, prefix, missing, timeout)

    def _build_collectives(
        self,
        store: dist.Store,
        prefix: str,
        missing: Sequence[tuple[int, ...]],
        timeout: timedelta,
    ) -> None:
        """A group per set of holders, built in one order on every member (sorted): a
        member blocked building one waits only for members still building smaller ones,
        so the smallest unfinished group always completes."""
        me = self.me

        def build() -> None:
            for holders in missing:
                key = "-".join(map(str, holders))
                group_store = dist.PrefixStore(f"{prefix}/c{key}", store)
                group = self.transport.make_group(
                    group_store, holders.index(me), len(holders), timeout
                )
                self.collectives[holders] = Collective(self.generation, holders, group)

        try:
            self._run(build, "groups", ())
        except BaseException:
            self.abandon()
            raise

    # -- blocking calls, abortable ---------------------------------------------------------

    def _check(self) -> None:
        if self.interrupts.aborted(self.generation):
            raise Aborted(f"generation {self.generation} aborted")

    def call(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` (a blocking call among this generation's members, such as building
        a group of theirs) on the helper: an abort ends the wait (module doc)."""
        return self._run(fn, what, ())

    def _run(self, fn: Callable[[], Any], what: str, peers: Sequence[int]) -> Any:
        self._check()
        done, box = self._helper.submit(fn, f"{what} {list(peers)}")
        with self.interrupts.watch(self.generation, done), self.status.waiting(what, tuple(peers)):
            done.wait()
        if not box:
            self._check()
            raise Aborted(f"generation {self.generation} ended")  # finished meanwhile
        ok, value = box[0]
        if not ok:
            raise CommError(str(value).splitlines()[0][:300])
        return value

    def _wait(self, work: Any, what: str, peers: Sequence[int]) -> None:
        if work.is_completed():  # already there (often, in a pipeline): no thread hop
            self._check()
            try:
                work.wait()
            except Exception as exc:  # completed with an error: a peer died
                raise CommError(str(exc).splitlines()[0][:300]) from None
            return
        self._run(lambda: work.wait(self._op_timeout), what, peers)

    def _post(self, fn: Callable[..., Any], *args: Any, group: Any = None) -> Any:
        self._check()
        try:
            return fn(self.group if group is None else group, *args)
        except Exception as exc:  # a broken pair raises at post time
            raise CommError(str(exc).splitlines()[0][:300]) from None

    # -- point to point --------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int, *, force: bool = False) -> None:
        """Asynchronous: completes at ``flush_sends`` (the tensor is kept alive till then).
        ``force``: posted even in an aborted generation, and a failure to post ignored
        (a message that must reach a live peer whatever happens here: a commit's
        decision, chameleon_runtime.step)."""
        if force:
            if self.group is None:
                return
            try:
                work, keep = self.transport.post_send(self.group, tensor, self._index[dst])
            except Exception:  # a dead peer: nobody to tell
                return
        else:
            work, keep = self._post(self.transport.post_send, tensor, self._index[dst])
        self._pending.append((work, keep, dst))
        self.sent_bytes += tensor.numel() * tensor.element_size()

    def recv(
        self, buffer: torch.Tensor, src: int, posted: Callable[[], None] | None = None
    ) -> torch.Tensor:
        """Receive the next message from ``src`` into ``buffer``. ``posted`` is called
        once the receive is posted: from then on it is matched by the peer's next message
        whatever happens to this wait, so a drain must not post it again."""
        work, into, finish = self._post(self.transport.post_recv, buffer, self._index[src])
        if posted is not None:
            posted()
        try:
            self._wait(work, "recv", (src,))
        except BaseException:
            self._pending.append((work, into, src))  # still posted: released with the group
            raise
        if finish is not None:
            finish()
        return buffer

    def flush_sends(self) -> None:
        pending, self._pending = self._pending, []
        for i, (work, _tensor, dst) in enumerate(pending):
            try:
                self._wait(work, "send", (dst,))
            except BaseException:
                self._pending = pending[i:]  # still to complete: released with the group
                raise

    def drain(
        self,
        sends: Sequence[tuple[int, torch.Size, torch.dtype]],
        recvs: Sequence[tuple[int, torch.Size, torch.dtype]],
    ) -> None:
        """End an aborted step's traffic (chameleon_runtime.step): on gloo, post the
        messages still owed, each way and in order per peer, zeros for sends and
        receives nobody waits for, ignoring errors (a dead peer); they complete when the
        group is released. A native communicator is not drained: ``abandon``, the first
        thing a recovery does, aborts it."""
        if not self.transport.drains:
            return
        for peer, shape, dtype in sends:
            with contextlib.suppress(Exception):
                work, keep = self.transport.post_send(
                    self.group, torch.zeros(shape, dtype=dtype), self._index[peer]
                )
                self._pending.append((work, keep, peer))
        for peer, shape, dtype in recvs:
            with contextlib.suppress(Exception):
                work, into, _ = self.transport.post_recv(
                    self.group, torch.empty(shape, dtype=dtype), self._index[peer]
                )
                self._pending.append((work, into, peer))

    # -- collectives -----------------------------------------------------------------------

    def allreduce(
        self, holders: tuple[int, ...], tensor: torch.Tensor, *, draining: bool = False
    ) -> Any:
        """Sum ``tensor`` in place over ``holders`` (their collective group), posted now
        and waited for by ``wait``. A ring all-reduce sends 2 (n - 1) / n of it.
        ``draining``: an aborted step's (chameleon_runtime.reducer), posted anyway."""
        collective = self.collectives[holders]
        if draining:
            work = self.transport.post_allreduce(collective.group, tensor)
        else:
            work = self._post(self.transport.post_allreduce, tensor, group=collective.group)
        collective.posted.append(work)
        n = len(holders)
        self.sent_bytes += 2 * (n - 1) * tensor.numel() * tensor.element_size() // n
        return work

    def allgather(
        self, holders: tuple[int, ...], output: torch.Tensor, tensor: torch.Tensor
    ) -> Any:
        """Gather ``tensor`` of every holder, in their order, into ``output`` (waited for
        by ``wait``): a ring sends (n - 1) / n of ``output``."""
        return self._post_ring(self.transport.post_allgather, holders, output, tensor, output)

    def reducescatter(
        self, holders: tuple[int, ...], output: torch.Tensor, tensor: torch.Tensor
    ) -> Any:
        """Sum ``tensor`` over the holders, each keeping its slice in ``output`` (waited
        for by ``wait``): a ring sends (n - 1) / n of ``tensor``."""
        return self._post_ring(self.transport.post_reducescatter, holders, output, tensor, tensor)

    def _post_ring(
        self,
        post: Callable[..., Any],
        holders: tuple[int, ...],
        output: torch.Tensor,
        tensor: torch.Tensor,
        whole: torch.Tensor,
    ) -> Any:
        collective = self.collectives[holders]
        work = self._post(post, output, tensor, group=collective.group)
        collective.posted.append(work)
        n = len(holders)
        self.sent_bytes += (n - 1) * whole.numel() * whole.element_size() // n
        return work

    def wait(self, work: Any, holders: tuple[int, ...]) -> None:
        """Wait for a collective posted by ``allreduce``, ``allgather`` or
        ``reducescatter`` (an abort ends the wait)."""
        self._wait(work, "allreduce", [h for h in holders if h != self.me])  # (any collective)
        posted = self.collectives[holders].posted
        if work in posted:
            posted.remove(work)

    # -- the end ---------------------------------------------------------------------------

    def abandon(self) -> None:
        """Leave this generation. Its helper finishes what it is blocked on, waits for
        the messages still posted, drops the group and ends; the caller goes on now."""
        if self._abandoned:
            return
        self._abandoned = True
        pending, self._pending = self._pending, []
        held, timeout = self._held, self._op_timeout
        if not self.transport.drains and self.group is not None:
            self.transport.abort(self.group)  # what is posted ends now (transport module doc)
        self.group = None
        kept = getattr(self, "kept", None)
        if kept is not None:
            kept._count(+1)

        helper = self._helper

        def release() -> None:
            helper.releasing = True
            for work, tensor, peer in pending:
                # Completed, or failed because the peer is gone or released its end first:
                # over either way. (What it waits on, for settle's report.)
                helper.busy_with = f"release of gen {self.generation}: {tensor.numel()} with {peer}"
                with contextlib.suppress(Exception):
                    work.wait(timeout)
            pending.clear()
            held.clear()
            if kept is not None:
                kept._count(-1)
                kept.let_go()  # the group is destroyed here unless still kept

        self._helper.submit(release, "release")
        self._helper.stop()
