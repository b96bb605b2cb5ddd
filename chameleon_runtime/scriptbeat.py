"""Hang detection for plain scripts: ``heartbeat()`` once a step, ``section()`` around
long phases.

    import chameleon_runtime as cr
    for step in range(start, steps):
        train_step()
        cr.heartbeat()
        if step % 100 == 0:
            with cr.section("checkpoint", timeout=600):
                save_checkpoint()

Under ``chameleon run`` each worker gets ``CHAMELEON_BEAT_FILE``, a small file of its own
that these calls rewrite (a ``chameleon_runtime.protocol.messages.ScriptBeat``: JSON padded to a fixed
size, written in place with one ``pwrite``); its agent reads it every quarter second (launcher/watch.py,
``ScriptBeats``). Once a worker has beaten, heartbeats that stop for ``--heartbeat-timeout``
(or 10 times the slowest gap between its beats, when that is longer) mark it hung: it is
killed and the job restarted, so a rank stuck in a collective is caught in seconds
instead of after the backend's timeout (NCCL's 10 minutes, gloo's 30). Inside a section
the section's own timeout applies instead. Before the first beat, or in a script that
never calls these, the worker is watched as before (its process state).

Without the variable (torchrun, plain python) both are no-ops that cost a dictionary
lookup. chameleon_runtime's Trainer beats by itself and needs neither.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

from chameleon_runtime.protocol.messages import ScriptBeat

ENV = "CHAMELEON_BEAT_FILE"
_MIN_GAP_S = 0.05  # beats closer than this are not written (a fast loop pays nothing)


class _Writer:
    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        self._pid = os.getpid()
        self.beats = 0
        self.sections: list[tuple[str, float | None]] = []
        self._written_at = 0.0
        self.last_beat_at: float | None = None  # the last heartbeat() or section end
        self.slowest_gap_s: float | None = None

    def beat(self) -> None:
        now = time.monotonic()
        if self.last_beat_at is not None and not self.sections:
            gap = now - self.last_beat_at
            self.slowest_gap_s = max(self.slowest_gap_s or 0.0, gap)
        self.last_beat_at = now
        self.beats += 1
        self.write(force=self.beats == 1)

    def write(self, *, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._written_at < _MIN_GAP_S:
            return
        name, timeout = self.sections[-1] if self.sections else (None, None)
        record = ScriptBeat(
            pid=self._pid,
            beats=self.beats,
            section=name,
            timeout_s=timeout,
            slowest_gap_s=self.slowest_gap_s,
        )
        os.pwrite(self._fd, record.encode(), 0)
        self._written_at = now


_writer: _Writer | None = None


def _get() -> _Writer | None:
    global _writer
    if _writer is None or _writer._pid != os.getpid():  # not inherited across a fork
        path = os.environ.get(ENV)
        if not path:
            return None
        _writer = _Writer(path)
    return _writer


def heartbeat() -> None:
    """This worker got somewhere (call once a step). A no-op outside ``chameleon run``."""
    writer = _get()
    if writer is not None:
        writer.beat()


@contextlib.contextmanager
def section(name: str, timeout: float | None = None) -> Iterator[None]:
    """A long phase (a checkpoint, an evaluation) that may go ``timeout`` seconds without
    a heartbeat (None: ``--startup-timeout``). Sections nest; the innermost one counts."""
    writer = _get()
    if writer is None:
        yield
        return
    if timeout is not None and timeout <= 0:
        raise ValueError(f"section {name!r}: timeout must be positive, got {timeout}")
    writer.sections.append((name, timeout))
    writer.beats += 1  # entering counts as progress: the silence is timed from here
    writer.write(force=True)
    try:
        yield
    finally:
        writer.sections.pop()
        writer.beats += 1
        if writer.last_beat_at is not None:
            writer.last_beat_at = time.monotonic()  # the section's length is not a gap
        writer.write(force=True)
