"""A stop signal that reaches a worker blocked in one of the runtime's store waits ends it.

Python runs a signal's handler (SIGINT's KeyboardInterrupt, a script's own SIGTERM
handler) only between bytecodes of the main thread, and a ``TCPStore.wait`` does not
return for a signal: a worker waiting for the next plan when the launcher forwarded a
Ctrl-C sat there until the launcher's shutdown timeout killed it (a README demo run
interrupted during a rebalance took 31 s to stop, measured). Waiting in slices instead
costs a C++ warning on stderr at every slice's timeout.

So a thread hears the signals through Python's wakeup fd (``signal.set_wakeup_fd``: the
C-level handler writes each signal's number there, whatever the main thread is doing),
and when one arrives while the main thread is inside such a wait, it ends the process with
128 + the signal's number, as a shell reports a process the signal ended (a thread
cannot restore a signal's default action): there is nothing to save in the middle of a
recovery's wait. Elsewhere Python's own handling is left alone. A script that
set a wakeup fd of its own keeps it (and this watch is off).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

from chameleon_runtime import preemption


class StopSignals:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._blocked = 0  # the main thread's depth of runtime waits
        self._what = ""
        self._read_fd = -1
        if threading.current_thread() is not threading.main_thread():
            return  # (set_wakeup_fd is the main thread's)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:
            previous = None
        if previous is None or previous != -1:  # refused, or the script's own: keep it
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return
        self._read_fd = read_fd
        threading.Thread(target=self._run, name="stop-signals", daemon=True).start()

    @contextlib.contextmanager
    def blocked(self, what: str) -> Iterator[None]:
        """Around a wait Python's signal handling cannot interrupt (the main thread's
        only: a signal's handler waits for that thread alone)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._what = what
        self._blocked += 1
        try:
            yield
        finally:
            self._blocked -= 1

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return
            if not data:
                return
            notices = preemption.signals()  # (a notice is noted, never an end)
            for signum in data:
                stop = signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
                if self._blocked and stop and signum not in notices:
                    self._end(signum)

    def _end(self, signum: int) -> None:
        name = signal.Signals(signum).name
        print(
            f"[rank {self.rank}] chameleon: {name} while waiting for {self._what or 'peers'}: "
            f"exiting ({128 + signum})",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(128 + signum)
