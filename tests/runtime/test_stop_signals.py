"""A stop signal ends a worker blocked in one of the runtime's store waits at once
(chameleon_runtime/stopsignals.py): before, it sat there until the launcher's shutdown
timeout (30 s) killed it. A real worker process, a real TCPStore, a real SIGINT."""

import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch.distributed as dist

from tests.clock import budget, slack
from tests.launcher.helpers import env

WAITER = """
import signal, sys, time
from chameleon_runtime.control import Control
if sys.argv[3] == "handler":  # the script's own handler (a save on SIGTERM, say)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
control = Control("127.0.0.1", int(sys.argv[1]), rank=3)
print("waiting", flush=True)
if sys.argv[2] == "plan":
    control.wait("never/set")            # as for the next plan
else:
    time.sleep(30)                       # the script's own code: Python's handling
"""


def blocked(pid: int) -> None:
    """Wait until the process's main thread sleeps in the kernel (its store wait or its
    ``time.sleep``): it printed "waiting" just before entering it."""
    deadline = time.monotonic() + budget(30)
    while psutil.Process(pid).status() != psutil.STATUS_SLEEPING:
        assert time.monotonic() < deadline, "never blocked"
        time.sleep(0.01)


@pytest.mark.slow  # real processes, seconds: the full suite runs it, the fast tier does not
@pytest.mark.parametrize(
    ("where", "signum", "code", "handler"),
    [
        ("plan", signal.SIGINT, 128 + signal.SIGINT, "none"),
        # a handler of the script's own cannot run during the wait either
        ("plan", signal.SIGTERM, 128 + signal.SIGTERM, "handler"),
        ("script", signal.SIGINT, -signal.SIGINT, "none"),  # KeyboardInterrupt, as Python
        ("script", signal.SIGTERM, 7, "handler"),  # elsewhere the script's handler runs
    ],
)
@pytest.mark.timeout(60)  # 1 s measured
def test_a_stop_signal_ends_a_worker_blocked_in_a_store_wait(
    tmp_path, where, signum, code, handler
):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    worker = subprocess.Popen(
        [sys.executable, "-c", WAITER, str(store.port), where, handler],
        env={**env(), "TORCHELASTIC_RUN_ID": "t"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout.readline().strip() == "waiting"
        blocked(worker.pid)  # inside the wait
        sent = time.monotonic()
        worker.send_signal(signum)
        assert worker.wait(timeout=budget(30)) == code  # (the wait's own timeout: 30 s)
        assert time.monotonic() - sent < slack(2.0)
        if where == "plan" and signum == signal.SIGINT:
            assert "SIGINT while waiting for the launcher" in worker.stderr.read()
    finally:
        worker.kill()
        worker.wait()
