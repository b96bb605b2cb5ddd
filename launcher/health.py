"""``--health-check CMD``: a node proves itself before it joins a job or hosts a
replacement (ft_launcher checks its nodes before rendezvous the same way).

``CMD`` runs through ``/bin/sh -c`` on the node, with the launcher's environment plus
``CHAMELEON_HEALTH_CHECK=join`` (before the rendezvous) or ``=replace`` (before a
replacement of rank ``CHAMELEON_HEALTH_RANK`` starts): exit 0 is healthy; anything else,
or no answer within ``TIMEOUT_S``, is not, and the last line it printed says why. A GPU
node would run ``nvidia-smi -q -d ECC`` or DCGM's diagnostics here; the tests run a
script that fails on demand.
"""

from __future__ import annotations

import os
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

TIMEOUT_S = 60.0


@dataclass(frozen=True)
class HealthResult:
    ok: bool
    why: str  # the check's last line, or why it has none
    seconds: float

    def to_json(self) -> dict:
        return {"ok": self.ok, "why": self.why, "seconds": round(self.seconds, 3)}


class HealthCheck:
    def __init__(self, command: str, timeout_s: float = TIMEOUT_S) -> None:
        self.command = command
        self.timeout_s = timeout_s
        self._pool: ThreadPoolExecutor | None = None

    def run(self, when: str, rank: int | None = None) -> HealthResult:
        env = dict(os.environ, CHAMELEON_HEALTH_CHECK=when)
        if rank is not None:
            env["CHAMELEON_HEALTH_RANK"] = str(rank)
        t0 = time.monotonic()
        try:
            done = subprocess.run(
                ["/bin/sh", "-c", self.command],
                env=env,
                capture_output=True,
                text=True,
                timeout=self.timeout_s,
            )
        except subprocess.TimeoutExpired:
            return HealthResult(False, f"no answer within {self.timeout_s:g} s", self.timeout_s)
        except OSError as exc:
            return HealthResult(False, f"could not run it: {exc}", time.monotonic() - t0)
        lines = [ln.strip() for ln in (done.stdout + "\n" + done.stderr).splitlines()]
        last = next((ln for ln in reversed(lines) if ln), "")
        if done.returncode == 0:
            return HealthResult(True, last[:200], time.monotonic() - t0)
        why = f"exit {done.returncode}" + (f": {last[:200]}" if last else "")
        return HealthResult(False, why, time.monotonic() - t0)

    def submit(self, when: str, rank: int | None = None) -> Future:
        """``run`` on a thread of its own: the launcher's loop does not wait for it."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="health")
        return self._pool.submit(self.run, when, rank)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
