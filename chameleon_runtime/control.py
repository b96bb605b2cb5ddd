"""The worker's side of the control channel: JSON in the store the launcher hosts for this
attempt (MASTER_ADDR:MASTER_PORT). Keys, all under ``chameleon/<attempt>/``:

    aware/<rank>              a worker using this runtime (the launcher recovers in place)
    hb/<rank>                 heartbeat: {count, step, gen, t, step_s}, after every step
    layer/<i>                 measured costs of layer i (from its holders)
    plan/<gen>, gen           a plan generation (the launcher publishes later ones)
    abort/<gen>               stop generation <gen> now (a failure was detected)
    ready/<gen>/<rank>        a survivor waiting for plan <gen>: {step, first, end}
    commit/<gen>/<step>       how many workers finished step <step>; .../done once all have
    exit/<rank>               fault injection: exit with this code at the next step

A watcher thread with its own connection polls ``abort/<gen>`` for the current generation
and sets an event the communication layer checks. Polling, because a TCPStore ``wait``
that times out prints two c10d warnings each time; a ``check`` costs about 25 us.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from chameleon_runtime.comm import Aborted

WATCH_PERIOD_S = 0.02


def key_prefix(attempt: int) -> str:
    """Keys of one restart attempt. chameleon run gives each attempt a fresh store; under
    torchrun the store outlives a restart, and stale keys of the dead attempt must not be
    read (the very bug that breaks torchrun's own gloo restarts)."""
    return f"chameleon/{attempt}/"


# Far beyond any number of members: a poisoned commit counter never reaches it again.
COMMIT_POISON = 1 << 40


class Control:
    def __init__(
        self, addr: str, port: int, rank: int, *, attempt: int = 0, timeout_s: float = 300.0
    ) -> None:
        self.rank = rank
        self.prefix = key_prefix(attempt)
        self.addr, self.port = addr, port
        self.store = dist.TCPStore(
            addr, port, is_master=False, timeout=timedelta(seconds=timeout_s)
        )
        self.abort = threading.Event()
        self._watch_gen = 0
        self._watch_lock = threading.Lock()
        self._beats = 0
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="abort-watcher", daemon=True)
        self._watcher.start()

    def _key(self, name: str) -> str:
        return self.prefix + name

    # -- JSON helpers ------------------------------------------------------------------

    def put(self, name: str, value: Any) -> None:
        self.store.set(self._key(name), json.dumps(value, separators=(",", ":")))

    def get(self, name: str) -> Any | None:
        key = self._key(name)
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key).decode())

    def forget(self, name: str) -> None:
        self.store.delete_key(self._key(name))

    def add(self, name: str, amount: int) -> int:
        return self.store.add(self._key(name), amount)

    # -- aborts ------------------------------------------------------------------------

    def watch(self, generation: int) -> None:
        """Watch ``abort/<generation>`` from now on (clears a stale abort)."""
        with self._watch_lock:
            self._watch_gen = generation
            self.abort.clear()
        if self.get(f"abort/{generation}") is not None:
            self.abort.set()

    def _watch(self) -> None:
        store = dist.TCPStore(self.addr, self.port, is_master=False, timeout=timedelta(seconds=60))
        while not self._stop.wait(WATCH_PERIOD_S):
            with self._watch_lock:
                gen = self._watch_gen
            try:
                aborted = store.check([self._key(f"abort/{gen}")])
            except Exception:
                return  # the store is gone: the launcher is ending this worker
            if aborted:
                with self._watch_lock:
                    if self._watch_gen == gen:
                        self.abort.set()

    def close(self) -> None:
        """Stop the watcher and wait for it: a daemon thread still inside a store call
        when the interpreter finalizes is killed while unwinding through C++ that may not
        throw, and the process dies with "terminate called without an active exception"
        (seen once in ~20 demo runs, on a worker that had finished)."""
        self._stop.set()
        if self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5.0)

    # -- heartbeats and reports --------------------------------------------------------

    def register(self, info: dict) -> None:
        self.put(f"aware/{self.rank}", info)

    def heartbeat(
        self,
        *,
        step: int,
        generation: int,
        step_s: float | None,
        state: str = "training",
        cpu_s: float | None = None,
        compute_cpu_s: float | None = None,
        means: dict[str, float] | None = None,
    ) -> None:
        """``means``: the recent steps' averages (``Pace.means``) the launcher fits to."""
        self._beats += 1
        self.put(
            f"hb/{self.rank}",
            {
                "count": self._beats,
                "step": step,
                "gen": generation,
                "t": time.time(),
                "step_s": step_s,
                "cpu_s": cpu_s,
                "compute_cpu_s": compute_cpu_s,
                "state": state,
                **(means or {}),
            },
        )

    def exit_requested(self) -> int | None:
        return self.get(f"exit/{self.rank}")

    # -- commit barrier ----------------------------------------------------------------

    def commit(self, generation: int, step: int, members: int) -> None:
        """Return once every member has finished ``step`` (then each applies it), or raise
        Aborted if the generation ends first. All or none, decided by one counter in the
        store: the step commits when the arrivals reach ``members``; a member that sees
        an abort first poisons the counter (one atomic add) so that no later arrival can
        reach it, unless it already had. (A ``done`` flag or a plain read is not enough:
        with them a member that saw the abort dropped a step that the last member, set
        done or arriving just after, applied, and the survivors then disagreed on the
        step to resume and the job restarted.)"""
        name = f"commit/{generation}/{step}"
        if self.add(name, 1) == members:
            self.put(f"{name}/done", True)
            return
        self._await(
            self._key(f"{name}/done"),
            f"generation {generation} aborted at step {step}",
            committed=lambda: self.add(name, -COMMIT_POISON) + COMMIT_POISON >= members,
        )

    def _await(self, key: str, why: str, *, committed: Callable[[], bool] | None = None) -> None:
        """Wait for ``key``; on an abort, raise unless ``committed`` says it is too late."""
        pause = 0.0005
        while not self.store.check([key]):
            if self.abort.is_set():
                if committed is not None and committed():
                    return
                raise Aborted(why)
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def barrier(self, name: str, members: int, *, generation: int) -> None:
        """A named all-members barrier that an abort of the generation cancels."""
        if self.add(f"barrier/{name}", 1) == members:
            self.put(f"barrier/{name}/done", True)
            return
        self._await(
            self._key(f"barrier/{name}/done"),
            f"generation {generation} aborted in barrier {name}",
        )
