"""File locks shared by the processes of one test run (pytest-xdist's workers): flock,
so that a lock goes with its holder when that process dies."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def locked(path: str | Path, *, shared: bool = False) -> Iterator[None]:
    """Hold ``path``'s lock, exclusive or ``shared``, while inside (closing releases it)."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
