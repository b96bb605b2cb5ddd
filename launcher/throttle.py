"""A worker slowed from outside its process (``--inject-fault slow:rank=R,factor=F``): the
agent stops and continues it on a duty cycle (SIGSTOP, SIGCONT), so that it runs
``1/F`` of the time, every thread of it alike. Nothing in the worker changes: the runtime
can tell it from a slow device (a throttled GPU, a noisy neighbour) by timing alone,
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
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from launcher.workers import Worker, signal_worker

RUN_S = 0.001  # one run phase, then a stop of (factor - 1) times it: shorter than a pass
MAX_STOP_S = 0.2  # the longest one stop lasts, a late wake's debt included


class Throttle:
    """Slows ``worker`` by ``factor`` for ``duration_s`` (None: until it exits or the
    round ends), on a thread of its own; ``on_end(lasted_s)`` when it stops."""

    def __init__(
        self,
        worker: Worker,
        factor: float,
        duration_s: float | None,
        on_end: Callable[[float], Any],
    ) -> None:
        self.worker = worker
        self.factor = factor
        self.duration_s = duration_s
        self._on_end = on_end
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="throttle", daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        run_s = RUN_S
        stopped_s = RUN_S * (self.factor - 1.0)
        began = time.monotonic()
        end = began + self.duration_s if self.duration_s is not None else float("inf")
        # A run phase is timed, not assumed: on a busy host this thread wakes late, and a
        # run phase that overshot by 30 ms gave the worker more than 1/F of the time (the
        # likely cause of CI, with a core busy, reading a 3x slowdown as 0.98x). What it
        # overran is owed as a longer stop, at most MAX_STOP_S at a time (the rest
        # carried), so that it stays slow, never silent. A stop that overran is not
        # credited back: that would let the worker run unstopped for several periods,
        # which a look at its speed reads as recovered.
        owed = 0.0
        try:
            while not self._stop.is_set() and time.monotonic() < end:
                if self.worker.popen.returncode is not None:
                    break
                due = stopped_s + owed
                pause = min(due, MAX_STOP_S)
                owed = due - pause
                signal_worker(self.worker, signal.SIGSTOP)
                self._stop.wait(pause)
                signal_worker(self.worker, signal.SIGCONT)
                t = time.monotonic()
                self._stop.wait(run_s)
                owed += (self.factor - 1.0) * max(0.0, time.monotonic() - t - run_s)
        finally:
            # Never left stopped: a stopped worker would hold its peers and ignore SIGTERM.
            signal_worker(self.worker, signal.SIGCONT)
            self._on_end(time.monotonic() - began)

    def close(self) -> None:
        """Stop slowing it (the worker runs on, continued)."""
        self._stop.set()
        self._thread.join(timeout=5.0)
