"""A worker slowed from outside its process (``--inject-fault slow:rank=R,factor=F``): the
agent stops and continues it on a duty cycle (SIGSTOP, SIGCONT), every thread alike, so
that it runs ``1/F`` of the time, or, on a contended host, gets ``1/F`` of the CPU its
peers on the node get (below). Nothing in the worker changes: the runtime can tell it
from a slow device (a throttled GPU, a noisy neighbour) by timing alone,
which is what a straggler test needs.

Why a short run phase: every pass must be slowed, however little work it is. A pass
shorter than one run phase that starts as the worker is continued (it was stopped while it
waited on a peer, as a slowed worker mostly is) finishes unslowed, and the median of its
passes then reads as recovered mid-slowdown. That is what CI saw with a core busy and 20 ms
periods: the worker dealt 1 micro-batch of 8, a pass of about 5 ms inside a 6.7 ms run
phase, read 1.05x slow while stopped two thirds of the time, and the job dealt evenly
again 18 steps before the slowdown ended. With 1 ms runs a pass of a few milliseconds is
stopped several times, in proportion. The stop phases are far shorter than any heartbeat
timeout, so a slowed worker is slow, never silent. The process-state check
(launcher/local.py) knows a throttled rank's stops are the throttle's own.

Why the stops grow on a busy host: the scheduler gives a process that was stopped the CPU
first once it is continued (its credit as a sleeper), so in 1 ms run phases the slowed
worker runs at a whole core's speed while its peers get only their share of a contended
one, and a plain 1:(F-1) cycle slows it by less than F against them. So a run phase of
``r`` is followed by a stop of ``r * (F * boost - 1)`` (``stop_s``), where the boost is
the share of the time it wanted a CPU that the worker's main thread got in its run phases
over the share its peers' main threads on this node got (/proc/<pid>/schedstat: time
run, time waiting to run), kept between 1 and ``MAX_BOOST``. Measured here, a CPU-bound
loop slowed 3x beside an unslowed one: with two other processes spinning on the two
cores, 1.6x with the plain cycle and 2.7x sized; with one spinning, 3.4x and 3.8x (past
the asked factor by an eighth). The main thread is where a CPU worker's passes run; a
GPU worker's host-side threads (autograd's device threads, a data loader) are not
counted. On a host with spare cores both shares are about 1 and the cycle is the plain
one.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from launcher.workers import Worker, signal_worker

RUN_S = 0.001  # one run phase, then a stop of (factor - 1) times it or more (below)
MAX_STOP_S = 0.2  # the longest one stop lasts, a late wake's debt included
SHARE_EVERY_S = 0.25  # how often the peers' share of a CPU is measured again
MIN_WANTED_NS = 2_000_000  # less time wanting a CPU than this tells nothing of a share
# The most the stops grow by: a worker can get at most a whole core, so past this its
# peers' share is so low (under a third of the time they want) that the reading is more
# likely a peer that hardly ran than a host that starved it.
MAX_BOOST = 3.0


def schedstat(pid: int) -> tuple[int, int] | None:
    """Nanoseconds the main thread of ``pid`` has run and waited to run (where a CPU
    worker's passes run), or None where the kernel does not say (or it is gone)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            ran, waited = f.read().split()[:2]
        return int(ran), int(waited)
    except (OSError, ValueError):
        return None


def share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Of the time a thread wanted a CPU between two schedstat readings, the part it got;
    None when it hardly wanted one (asleep, waiting on a peer) or a reading is missing."""
    if before is None or after is None:
        return None
    ran, waited = after[0] - before[0], after[1] - before[1]
    if ran < 0 or waited < 0 or ran + waited < MIN_WANTED_NS:
        return None
    return ran / (ran + waited)


def stop_s(factor: float, ran_s: float, own: float | None, peers: float | None) -> float:
    """How long to stop a worker that was just continued for ``ran_s``, so that it gets
    ``1/factor`` of the CPU its peers get: ``own`` its share in its recent run phases, ``peers``
    theirs lately (None: unknown, taken as equal). Plain ``(factor - 1) * ran_s`` when
    the two are equal; longer when the scheduler favoured the continued worker."""
    return max(0.0, ran_s * (factor * _boost(own, peers) - 1.0))


def _boost(own: float | None, peers: float | None) -> float:
    return 1.0 if own is None or not peers else min(MAX_BOOST, max(1.0, own / peers))


@dataclass(frozen=True)
class Duty:
    """What a slowdown did, for its end's event: the share of its time the worker was
    stopped (1 - 1/F for a plain F-times slowdown; more where the boost grew it), and the
    boost at its last and largest. A slowdown a look at the worker's speed found weaker
    than asked then says whether the throttle stopped it too little or the host slowed
    its peers as much."""

    stopped_share: float
    boost: float
    boost_max: float


class Throttle:
    """Slows ``worker`` by ``factor`` for ``duration_s`` (None: until it exits or the
    round ends), on a thread of its own; ``on_end(lasted_s, duty)`` when it stops."""

    def __init__(
        self,
        worker: Worker,
        factor: float,
        duration_s: float | None,
        on_end: Callable[[float, Duty], Any],
        peers: Callable[[], Collection[int]] = tuple,
    ) -> None:
        self.worker = worker
        self.factor = factor
        self.duration_s = duration_s
        # pids of the node's other live workers, asked again at each measure (a peer
        # may be replaced while the slowdown lasts)
        self.peers = peers
        self._on_end = on_end
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="throttle", daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        began = time.monotonic()
        end = began + self.duration_s if self.duration_s is not None else float("inf")
        # A run phase is timed, not assumed: on a busy host this thread wakes late, and a
        # run phase that overshot by 30 ms gave the worker more than 1/F of the time (the
        # likely cause of CI, with a core busy, reading a 3x slowdown as 0.98x). What it
        # overran is owed as a longer stop, at most MAX_STOP_S at a time (the rest
        # carried), so that it stays slow, never silent. A stop that overran is not
        # credited back: that would let the worker run unstopped for several periods,
        # which a look at its speed reads as recovered.
        owed, ran_s = 0.0, RUN_S
        stopped_total = ran_total = 0.0
        boost = boost_max = 1.0
        own: float | None = None  # the worker's share of a CPU in its run phases, lately
        peers: float | None = None  # its peers' share, lately
        mine_then: tuple[int, int] | None = None  # schedstat readings at the last measure
        peers_then: dict[int, tuple[int, int] | None] = {}
        measured_at = float("-inf")
        pid = self.worker.pid
        try:
            while not self._stop.is_set() and time.monotonic() < end:
                if self.worker.popen.returncode is not None:
                    break
                boost = _boost(own, peers)
                boost_max = max(boost_max, boost)
                due = stop_s(self.factor, ran_s, own, peers) + owed
                pause = min(due, MAX_STOP_S)
                owed = due - pause
                signal_worker(self.worker, signal.SIGSTOP)
                stopped_at = time.monotonic()
                self._stop.wait(pause)
                now = time.monotonic()
                stopped_total += now - stopped_at
                if now - measured_at >= SHARE_EVERY_S:
                    # Read while it is stopped: a running task's counters are brought up
                    # to date only when it is switched out, and a stopped one neither
                    # runs nor waits, so what they moved since the last reading is its
                    # run phases' alone. (A window in which it hardly wanted a CPU, or
                    # the first, keeps the last figure.)
                    mine_now = schedstat(pid)
                    peers_now = {p: schedstat(p) for p in self.peers()}
                    own = _kept(share(mine_then, mine_now), own)
                    peers = _kept(_summed(peers_then, peers_now), peers)
                    mine_then, peers_then, measured_at = mine_now, peers_now, now
                signal_worker(self.worker, signal.SIGCONT)
                t = time.monotonic()
                self._stop.wait(RUN_S)
                ran_s = time.monotonic() - t
                ran_total += ran_s
        finally:
            # Never left stopped: a stopped worker would hold its peers and ignore SIGTERM.
            signal_worker(self.worker, signal.SIGCONT)
            cycle = stopped_total + ran_total
            duty = Duty(stopped_total / cycle if cycle else 0.0, boost, boost_max)
            self._on_end(time.monotonic() - began, duty)

    def close(self) -> None:
        """Stop slowing it (the worker runs on, continued)."""
        self._stop.set()
        self._thread.join(timeout=5.0)


def _summed(
    before: dict[int, tuple[int, int] | None], after: dict[int, tuple[int, int] | None]
) -> float | None:
    """The share of a CPU several threads got together between two readings (a peer
    that exited in between, was never readable, or whose counters went backwards, a
    reused pid, left out)."""
    ran = waited = 0
    for pid, now in after.items():
        then = before.get(pid)
        if now is not None and then is not None and now[0] >= then[0] and now[1] >= then[1]:
            ran, waited = ran + now[0] - then[0], waited + now[1] - then[1]
    return share((0, 0), (ran, waited))


def _kept(new: float | None, old: float | None) -> float | None:
    return old if new is None else new
