"""``cr.preempted()``: the scheduler asked this job to stop (a preemption notice the user
named in ``chameleon run --signals-to-handle``, docs/clusters.md): save and leave.

    for x, y in loader:
        ...
        optimizer.step()
        if cr.preempted():          # the same step on every member
            save_checkpoint()
            break

With the drop-in (``cr.ElasticDataParallel``) under chameleon run, the launcher does not
signal the workers: it tells each one, and a member that heard asks the others in the
step's commit (chameleon_runtime.stepmeta), so every member sees ``True`` right after the
same ``optimizer.step()``, and their checkpoints hold the same step. A step is never cut
short: the answer comes at the next commit after the notice.

In a plain script (no drop-in) the launcher forwards the signal itself, as torchrun does;
the first call here takes the preemption signals over (``CHAMELEON_PREEMPT_SIGNALS``, set
by the launcher) so that they no longer end the process, and later calls say whether one
came. Call it once before the loop; agreeing on the step to stop at is then the
script's (an all-reduce of the flag, as torchrun scripts do).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

SIGNALS_ENV = "CHAMELEON_PREEMPT_SIGNALS"  # comma-separated numbers, set by the launcher

_agreed: Callable[[], bool] | None = None  # the drop-in's agreement, once it exists
_heard: int | None = None  # a plain script's: the signal that came
_armed = False


def signals() -> list[int]:
    """The signals the launcher treats as preemption notices (--signals-to-handle)."""
    return [int(t) for t in filter(None, os.environ.get(SIGNALS_ENV, "").split(","))]


def hear(note: Callable[[int], None]) -> None:
    """A chameleon_runtime worker notes a notice that reaches it as a signal itself (Slurm
    signals every process of a job step, the workers too) as it notes the launcher's
    message: the signal's default action would end the process."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in signals():
        signal.signal(signum, lambda s, _frame: note(s))


def follow(agreed: Callable[[], bool]) -> None:
    """The drop-in's membership: its commits say when the members stop."""
    global _agreed
    _agreed = agreed


def preempted() -> bool:
    """Whether the job was asked to stop for a preemption: save and leave (module doc)."""
    if _agreed is not None:
        return _agreed()
    _arm()
    return _heard is not None


def _arm() -> None:
    global _armed
    if _armed or threading.current_thread() is not threading.main_thread():
        return
    _armed = True
    for signum in signals():
        signal.signal(signum, _heard_signal)


def _heard_signal(signum: int, _frame: object) -> None:
    global _heard
    _heard = signum
