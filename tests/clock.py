"""Wall-clock time in the tests: one slack factor for every latency margin, and each test's
budget, so that a wait inside a test ends before pytest's timeout does.

A test asserts what happened (the same weights, recovered in place, the count of
failures, the exit code) exactly. Where it also bounds how long something took (a crash
detected, a signal obeyed), the bound is the product's own figure plus a margin for a
shared core, and every such margin is ``slack(seconds)``: the seconds the product needs
on an idle machine, times ``CHAMELEON_TEST_SLACK`` (default 3). ``CHAMELEON_TEST_SLACK=1``
holds an idle machine to the figures themselves. Speed targets are ratios in
``benchmarks/``, never here.

The budget: tests/conftest.py sets, before each test, the moment its pytest timeout will
fire; ``budget(seconds)`` cuts a wait so that it ends ``MARGIN_S`` before that moment.
A job that runs out then fails as a job (its log's tail in the message, its processes
killed), not as a bare pytest timeout.

A timeout only catches a hang, so it is set well past a slow day: at least three times
what the test took in a CI run with one core kept busy (`python3 -c 'while True: pass'`,
the gate's fourth run), and the marker's comment gives that figure where it decides. A
host a third slower, and a busier one, still leave the test twice its time.
"""

from __future__ import annotations

import os
import time

SLACK = float(os.environ.get("CHAMELEON_TEST_SLACK", "3"))
# What a test needs after its last wait: reading logs, killing a job, the leak check.
MARGIN_S = 10.0

_deadline: list[float | None] = [None]


def slack(seconds: float) -> float:
    """A latency bound of ``seconds`` on an idle machine, as this run allows it."""
    return seconds * SLACK


def set_deadline(timeout_s: float | None) -> None:
    """tests/conftest.py: the test now starting times out ``timeout_s`` from now (None:
    no timeout)."""
    _deadline[0] = None if not timeout_s else time.monotonic() + timeout_s


def budget(seconds: float) -> float:
    """A wait of up to ``seconds``, cut to end ``MARGIN_S`` before the test's timeout
    (at least 1 s)."""
    deadline = _deadline[0]
    if deadline is None:
        return seconds
    return max(1.0, min(seconds, deadline - MARGIN_S - time.monotonic()))
