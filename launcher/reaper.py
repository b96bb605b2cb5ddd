"""A guard process that kills every worker session when the launcher dies, however it dies.

The launcher starts it with a pipe on its stdin and writes ``+PGID`` / ``-PGID`` lines as
worker sessions start and stop. When the launcher exits, even by SIGKILL, the kernel
closes the pipe; on end-of-file the guard SIGKILLs every session it still holds. The
workers themselves also get SIGKILL from the kernel through PR_SET_PDEATHSIG; the guard
catches what they started (data loader workers, shells).

Run as ``python -m launcher.reaper``: it imports nothing but the standard library, so it
starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys


def main() -> None:
    # Terminal signals (Ctrl-C to the foreground group) must not kill the guard first.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_IGN)
    held: set[int] = set()
    for line in sys.stdin:
        line = line.strip()
        if line.startswith("+") and line[1:].isdigit():
            held.add(int(line[1:]))
        elif line.startswith("-") and line[1:].isdigit():
            held.discard(int(line[1:]))
    for pgid in held:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


if __name__ == "__main__":
    main()
