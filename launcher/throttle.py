"""A worker slowed from outside its process (``--inject-fault slow:rank=R,factor=F``): the
agent stops and continues it (SIGSTOP, SIGCONT), every thread alike, so that each unit of
work it does takes ``F`` times as long as it would, the way a slow device's does. Nothing
in the worker changes: the runtime can tell it from a slow device (a throttled GPU, a
noisy neighbour) by timing alone, which is what a straggler test needs.

Why charged by the CPU the worker used, not a wall-clock duty cycle: a slow device is slow
in its work, not in its waits. A worker planned around is dealt fewer micro-batches and
then spends most of its step waiting on its peers; a cycle of 1 ms runs and 2 ms stops
lands most of its stops in those waits, and on a busy host, where the stopper wakes late
and the phases stretch to tens of milliseconds, a pass of a few milliseconds fits in one
run phase and finishes unslowed. CI saw that, with a core busy: the 3x-slowed worker,
dealt 2 of 8, measured 1.0x mid-slowdown and the job dealt evenly again while it was still
slowed. So the worker is continued for a run phase of ``RUN_S`` at a time, and stopped
after it for what it owes: for every second its main thread ran (/proc/<pid>/schedstat),
``F - 1`` seconds more (``owed_s``). A worker blocked on a peer runs nothing, owes
nothing, and is stopped only for the instant each reading takes. A run phase that
overran (the cycle woke late) is charged in full, paid in stops of at most
``MAX_STOP_S`` so that it stays slow, never silent. A stop that overran is not credited
back: that would let the worker run unstopped for several periods, which a look at its
speed reads as recovered.

Why the charge grows on a busy host: a worker gets only part of a CPU when the host's
cores are contended, so its peers take ``1/s`` seconds for each second of work (``s``,
their share: time run over time wanting a CPU, /proc/<pid>/schedstat of their main
threads on this node), and a slow worker should take ``F/s``. Its own time wanting a CPU
(run, or waiting to run) already counts toward that; the stop is the rest. On a host with
spare cores ``s`` is about 1 and the charge is the plain ``F - 1``. The scheduler also
runs a process just continued first (its credit as a sleeper), which the charge absorbs:
it counts what the worker's time cost, not what it should have. The growth, ``1/s``, is
kept between 1 and ``MAX_BOOST``.

The main thread is where a CPU worker's passes run; a GPU worker is charged for its host
thread's time, which a device sync that spins (CUDA's default) counts and one that
blocks does not: there the fault slows its host code, not its kernels.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from launcher.workers import Worker

RUN_S = 0.001  # one run phase, then a stop for what the worker owes (below)
MAX_STOP_S = 0.2  # the longest one stop lasts (what is owed past it, carried)
STOPPED_POLL_S = 0.0001  # how often a stop is checked to have taken effect
SHARE_EVERY_S = 0.25  # how often the peers' share of a CPU is measured again
MIN_WANTED_NS = 2_000_000  # less time wanting a CPU than this tells nothing of a share
# The most the charge grows by: past this the peers' share is so low (under a third of
# the time they want) that the reading is more likely a peer that hardly ran than a host
# that starved it.
MAX_BOOST = 3.0


def schedstat(pid: int) -> tuple[int, int] | None:
    """Nanoseconds the main thread of ``pid`` has run and waited to run (where a CPU
    worker's passes run), or None where the kernel does not say (or it is gone)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            ran, waited = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    # (a kernel built without the counters writes zeros: a live process has run)
    return (int(ran), int(waited)) if int(ran) > 0 else None


def share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Of the time a thread wanted a CPU between two schedstat readings, the part it got;
    None when it hardly wanted one (asleep, waiting on a peer) or a reading is missing."""
    if before is None or after is None:
        return None
    ran, waited = after[0] - before[0], after[1] - before[1]
    if ran < 0 or waited < 0 or ran + waited < MIN_WANTED_NS:
        return None
    return ran / (ran + waited)


def owed_s(factor: float, ran_s: float, waited_s: float, peers: float | None) -> float:
    """The stop a worker owes for a run phase in which its main thread ran ``ran_s`` and
    waited ``waited_s`` to run, so that its work takes ``factor`` times what its peers'
    takes: ``peers`` their share of a CPU lately (None: unknown, taken as a whole one).
    Plain ``(factor - 1) * ran_s`` on a host with spare cores; none for a phase in which
    it ran nothing (it was waiting on a peer)."""
    return max(0.0, ran_s * factor * boost(peers) - ran_s - waited_s)


def peers_pace(peers: float | None) -> float:
    """Seconds the peers take per second of work, against a worker with a core of its
    own: ``1 / peers`` (their share of a CPU), at least 1 (None: unknown, 1), at most 100
    (a share of nothing is a window in which they hardly ran)."""
    return 1.0 if peers is None else 1.0 / min(1.0, max(0.01, peers))


def boost(peers: float | None) -> float:
    """How much the charge grows: the peers' pace, kept under ``MAX_BOOST``."""
    return min(MAX_BOOST, peers_pace(peers))


@dataclass(frozen=True)
class Duty:
    """What a slowdown did, for its end's event: the factor it reached, the wall time the
    worker took per second of its work over what its peers took (their share of a CPU,
    measured as the charge used it), which is the asked factor unless the boost hit its
    cap or a stop came late; and the boost at its last and largest. A slowdown a look at
    the worker's speed found weaker than asked then says whether the throttle slowed it
    too little or the host slowed its peers as much."""

    reached: float
    boost: float
    boost_max: float
    # how promptly the cycle was woken: "realtime", "nice", "normal" (throttle._prompt);
    # "failed: ..." where the cycle could not start or said nothing (the slowdown then
    # slowed nothing, or an unknown part of it)
    priority: str = "normal"


class Throttle:
    """Slows ``worker`` by ``factor`` for ``duration_s`` (None: until it exits or the
    round ends); ``on_end(lasted_s, duty)`` when it stops.

    The cycle runs in a process of its own (this file, run as a script: the standard
    library only, so it starts in milliseconds), not on a thread of the agent: a thread
    waits for the agent's GIL, and on a busy host the agent's other threads hold it for
    tens of milliseconds at a time, run phases and all. Measured here, a worker doing
    4 ms passes between waits, slowed 3x by a thread beside a busy one in its process:
    its passes took 4.0 ms (median), its stops all landed in its waits. Here a thread of
    the agent only tells the cycle its peers' pids, each time it measures their share
    (a peer may be replaced while the slowdown lasts), and waits for the cycle's end.
    The cycle dies with the agent (PR_SET_PDEATHSIG), as the worker does."""

    def __init__(
        self,
        worker: Worker,
        factor: float,
        duration_s: float | None,
        on_end: Callable[[float, Duty], Any],
        peers: Callable[[], Collection[int]] = tuple,
    ) -> None:
        self.worker = worker
        self.peers = peers
        self._on_end = on_end
        self._stop = threading.Event()
        self._began = time.monotonic()
        # (an absolute deadline on the monotonic clock, which is the host's: the cycle's
        # start-up does not eat into the slowdown)
        until = self._began + duration_s if duration_s is not None else float("inf")
        argv = [
            # (-s -P: no user site, no script folder on sys.path; the standard library only)
            sys.executable, "-s", "-P", __file__,
            str(os.getpid()), str(worker.pid), repr(float(factor)), repr(until),
        ]  # fmt: skip
        self._cycle: subprocess.Popen | None = None
        self._failed = ""
        try:
            self._cycle = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
        except OSError as e:  # (no process to be had: out of pids or memory)
            self._failed = f"failed: {e.strerror or e}"
        self._thread = threading.Thread(target=self._watch, name="throttle", daemon=True)
        try:
            self._thread.start()
        except RuntimeError:
            self._end_cycle()
            raise

    @property
    def active(self) -> bool:
        return self._thread.is_alive()

    def _end_cycle(self) -> tuple[str, str]:
        """Ask the cycle to end, wait for it (killed past 5 s), and continue the worker
        whatever became of it: a stopped worker would hold its peers and ignore SIGTERM."""
        from launcher.workers import signal_worker

        out = err = ""
        cycle = self._cycle
        try:
            if cycle is not None:
                if cycle.poll() is None:
                    cycle.terminate()
                try:
                    out, err = cycle.communicate(timeout=5.0)
                except subprocess.TimeoutExpired:
                    cycle.kill()
                    out, err = cycle.communicate()
        finally:
            signal_worker(self.worker, signal.SIGCONT)
        return out or "", err or ""

    def _watch(self) -> None:
        cycle, out, err = self._cycle, "", ""
        try:
            while cycle is not None and cycle.poll() is None:
                if self._stop.is_set() or self.worker.popen.returncode is not None:
                    break
                try:
                    assert cycle.stdin is not None
                    cycle.stdin.write(json.dumps(sorted(self.peers())) + "\n")
                    cycle.stdin.flush()
                except OSError:
                    pass  # (it is ending)
                # (woken by the cycle's end, or by close(), which ends the cycle: the
                # slowdown's end is told when it comes, not up to a period later)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    cycle.wait(SHARE_EVERY_S)
        finally:
            out, err = self._end_cycle()  # (this thread's error, if any, ends it too)
        lasted_s = time.monotonic() - self._began
        try:
            ended = json.loads(out.strip().splitlines()[-1])
            duty = Duty(ended["reached"], ended["boost"], ended["boost_max"], ended["priority"])
            # (when the cycle stopped slowing it, on the host's monotonic clock)
            lasted_s = min(lasted_s, max(0.0, float(ended["ended_at"]) - self._began))
        except (ValueError, IndexError, KeyError, TypeError):
            why = self._failed or "failed: " + (
                err.strip().splitlines()[-1][:200] if err.strip() else "no report"
            )
            duty = Duty(0.0, 1.0, 1.0, why)
        self._on_end(lasted_s, duty)

    def close(self) -> None:
        """Stop slowing it (the worker runs on, continued)."""
        self._stop.set()
        if self._cycle is not None and self._cycle.returncode is None:
            with contextlib.suppress(OSError):
                self._cycle.terminate()
        self._thread.join(timeout=10.0)


def _signal(pid: int, signum: int) -> bool:
    """Signal the worker's session (it and whatever it forked), as the agent does
    (launcher.workers.signal_worker); False once it is gone."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        return False
    except PermissionError:  # (the session leader is gone and its id reused: only it)
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            return False
    return True


def _stopped(pid: int, within_s: float = 0.002) -> None:
    """Wait (``within_s`` at most) until ``pid`` has stopped: a stop signal takes effect
    when the worker next runs, and a worker waiting for a CPU would otherwise spend that
    wait inside the stop and have it counted as its own wait to run, credited twice.
    Between looks this process sleeps, never spins: at real-time priority, spinning on the
    worker's CPU kept it from running to obey (seen: the slowed worker waiting half its
    time for a CPU, and a 2x slowdown reaching 3.2x)."""
    until = time.monotonic() + within_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            return
        if state in ("T", "t") or time.monotonic() >= until:
            return
        time.sleep(STOPPED_POLL_S)


class _Ended(Exception):
    """SIGTERM from the agent: the slowdown ends now."""


def cycle(pid: int, factor: float, until: float, peers: Callable[[], Collection[int]]) -> Duty:
    """Slow ``pid`` by ``factor`` until ``until`` (on the monotonic clock), it is gone, or
    SIGTERM; what it did. The worker is continued however it ends."""
    owed = 0.0  # seconds of stop the worker owes
    taken_s = peers_s = 0.0  # its wall time, and its work at its peers' pace
    boost_now = boost_max = 1.0
    share_of_peers: float | None = None  # the peers' share of a CPU, lately
    peers_then: dict[int, tuple[int, int] | None] = {}
    measured_at = float("-inf")
    mine_then = schedstat(pid)
    try:
        while time.monotonic() < until:
            t = time.monotonic()
            if not _signal(pid, signal.SIGCONT):
                break
            time.sleep(RUN_S)
            _signal(pid, signal.SIGSTOP)
            _stopped(pid)
            now = time.monotonic()
            # Read once it has stopped: a running task's counters are brought up to date
            # only when it is switched out, and a stopped one neither runs nor waits, so
            # what they moved is this run phase's alone. Where the kernel does not say,
            # the whole phase is charged as run (the plain cycle).
            mine_now = schedstat(pid)
            ran_s, waited_s = _moved(mine_then, mine_now, now - t)
            waited_s = min(waited_s, max(0.0, now - t - ran_s))  # (this phase's, no more)
            mine_then = mine_now
            if now - measured_at >= SHARE_EVERY_S:
                # (a window in which the peers hardly wanted a CPU, or the first, keeps
                # the last figure)
                peers_now = {p: schedstat(p) for p in peers()}
                share_of_peers = _kept(_summed(peers_then, peers_now), share_of_peers)
                peers_then, measured_at = peers_now, now
            boost_now = boost(share_of_peers)
            boost_max = max(boost_max, boost_now)
            owed += owed_s(factor, ran_s, waited_s, share_of_peers)
            taken_s += ran_s + waited_s
            peers_s += ran_s * peers_pace(share_of_peers)
            pause = min(owed, MAX_STOP_S, max(0.0, until - now))
            if pause > 0.0:
                owed -= pause
                time.sleep(pause)
                taken_s += time.monotonic() - now
    except _Ended:
        pass
    finally:
        _signal(pid, signal.SIGCONT)
    return Duty(taken_s / peers_s if peers_s else 0.0, boost_now, boost_max)


def main(argv: list[str]) -> None:
    """The cycle's process: ``AGENT PID FACTOR UNTIL``; the peers' pids come on stdin, a
    JSON list per line, each replacing the last; what it did, the Duty's fields, on
    stdout as one JSON object."""
    agent, pid, factor, until = int(argv[0]), int(argv[1]), float(argv[2]), float(argv[3])
    # Dies with the agent, as the worker does (set here, not between fork and exec in the
    # agent, where another thread may hold a lock the child would wait on forever).
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != agent:
        return
    for ignored in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(ignored, signal.SIG_IGN)  # (a terminal's signals are the agent's)
    ending = [False]

    def ended(signum: int, frame: Any) -> None:
        if not ending[0]:  # (once: a second one must not break the worker's continue)
            ending[0] = True
            raise _Ended

    signal.signal(signal.SIGTERM, ended)
    # The peers, read without a thread of its own (one at an ordinary priority could hold
    # the GIL this real-time one waits on): what is on stdin at each measure.
    os.set_blocking(0, False)
    known: list[list[int]] = [[]]
    pending = [b""]

    def peers() -> list[int]:
        try:
            while chunk := os.read(0, 65536):
                pending[0] += chunk
        except (BlockingIOError, InterruptedError):
            pass
        *lines, pending[0] = pending[0].split(b"\n")
        for line in lines:
            try:
                known[0] = [int(p) for p in json.loads(line)]
            except (ValueError, TypeError):
                continue
        return known[0]

    try:
        priority = _prompt()
        duty = replace(cycle(pid, factor, until, peers), priority=priority)
    except _Ended:  # (asked to end before it began)
        _signal(pid, signal.SIGCONT)
        duty = Duty(0.0, 1.0, 1.0)
    ending[0] = True
    print(json.dumps({**asdict(duty), "ended_at": time.monotonic()}), flush=True)


def _prompt() -> str:
    """Ask to be woken on time: a stop that comes late lets a whole pass run unslowed
    (seen with a core busy: a 3x-slowed worker's passes at full speed, its stops landing
    in its waits, as this process waited for a CPU behind three busy ones). Real-time
    (SCHED_FIFO, the lowest priority) where allowed: it preempts any ordinary process
    when its sleep ends, and it sleeps nearly all the time (a 1 ms sleep per loop bounds
    what it takes). Else a lowered nice value (a higher priority), else as it is; which
    one it got is reported with the slowdown's end."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        return "realtime"
    except (OSError, AttributeError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
        return "nice"
    except OSError:
        return "normal"


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


def _moved(
    before: tuple[int, int] | None, after: tuple[int, int] | None, phase_s: float
) -> tuple[float, float]:
    """Seconds a worker's main thread ran and waited to run between two readings; the
    whole phase as run where either reading is missing or went backwards (a reused pid)."""
    if before is None or after is None or after[0] < before[0] or after[1] < before[1]:
        return phase_s, 0.0
    return (after[0] - before[0]) / 1e9, (after[1] - before[1]) / 1e9


def _kept(new: float | None, old: float | None) -> float | None:
    return old if new is None else new


if __name__ == "__main__":
    main(sys.argv[1:])
