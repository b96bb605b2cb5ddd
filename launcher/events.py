"""The JSON-lines event log: every start, failure, detection, decision, restart, recovery
and exit, with wall-clock times, so a recovery can be replayed and measured
(``chameleon timeline EVENTS`` renders it).

One record per line: {"t": <unix seconds>, "event": <name>, ...fields}. Listeners (the
live view) see each record as it is written.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Record = dict[str, Any]


class EventLog:
    def __init__(self, path: Path | None, *, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._listeners: list[Callable[[Record], None]] = []
        self.records: list[Record] = []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        else:
            self._file = None

    def listen(self, callback: Callable[[Record], None]) -> None:
        self._listeners.append(callback)

    def emit(self, event: str, *, t: float | None = None, **fields: Any) -> Record:
        record = {"t": self._clock() if t is None else t, "event": event, **fields}
        with self._lock:
            self.records.append(record)
            if self._file is not None:
                self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        for callback in self._listeners:
            callback(record)
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_events(path: Path) -> list[Record]:
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{number}: not a JSON event line") from None
        if not isinstance(record, dict) or "t" not in record or "event" not in record:
            raise ValueError(f"{path}:{number}: an event needs 't' and 'event'")
        records.append(record)
    return records
