"""A TCPStore follower's lease on its own clock (launcher/outage.py): real threads."""

import threading
import time

import pytest

from launcher.outage import ControlLink


def watched(lease_s: float) -> tuple[ControlLink, list[str], threading.Event]:
    link = ControlLink(300.0, lambda *a, **k: None, lambda line: None)
    fenced: list[str] = []
    stop = threading.Event()
    link.watch_lease(lease_s, "10.0.0.1:29400", fenced.append, stop)
    return link, fenced, stop


def test_beats_that_go_through_keep_the_lease():
    link, fenced, stop = watched(0.3)
    try:
        for _ in range(10):
            link.beat(time.monotonic())
            time.sleep(0.05)
        assert fenced == []
    finally:
        stop.set()


def test_a_beat_sent_after_the_lease_ran_out_does_not_renew_it():
    # A node frozen whole (agent, threads, workers) and resumed: its heartbeat thread may
    # run before the watch and get a beat through at once. The leader may have counted
    # the node lost meanwhile, so that beat must not save it.
    link, fenced, stop = watched(0.3)
    try:
        link._last_beat = time.monotonic() - 1.0  # the last good beat, a freeze ago
        resumed = time.monotonic()
        while not fenced and time.monotonic() < resumed + 2.0:
            link.beat(time.monotonic())  # every beat from now on gets through
            time.sleep(0.02)
        assert fenced and "cut off from the control store at 10.0.0.1:29400" in fenced[0]
        assert time.monotonic() - resumed < 0.3  # at the watch's next look, not a lease later
    finally:
        stop.set()


# A follower agent across a cut: its main loop's store calls never answer. The lease
# watch must still fence it on time: a call may block, but not the other threads
# (TCPStore's queue_len held the GIL, the whole agent stopped, and its workers trained
# on). In a child process, the store's server frozen with SIGSTOP: a call holding the
# GIL would stop this test's own timeout too.
AGENT_LOOP = """
import os, sys, threading, time
from launcher.outage import ControlLink
from launcher.rendezvous import ControlPlane
from launcher.store import connect_store

port = int(sys.argv[1])
control = ControlPlane(
    connect_store("127.0.0.1", port, timeout_s=30.0), "run", "n2", is_leader=False,
    addr="127.0.0.1", port=port,
)
fenced = threading.Event()
link = ControlLink(300.0, lambda *a, **k: None, lambda line: None)
print("ready", flush=True)
sys.stdin.readline()  # the store's server is frozen now
# (the lease starts now: started before the freeze, it could run out before the call)
link.watch_lease(0.5, control.endpoint, lambda why: fenced.set(), threading.Event())
started = time.monotonic()

def told():
    fenced.wait()
    print(f"fenced after {time.monotonic() - started:.2f} s", flush=True)
    os._exit(0)

threading.Thread(target=told, daemon=True).start()
control.kill_requests(0)  # the follower loop's every-second look
print("the call returned", flush=True)
"""

SERVER = """
import time
from launcher.store import host_store
store = host_store("127.0.0.1", 0, timeout_s=30.0)
print(store.port, flush=True)
time.sleep(120)
"""


def stopped(pid: int) -> bool:
    """Every thread of ``pid`` stopped by a signal (Linux: state T in /proc)."""
    from pathlib import Path

    for task in Path(f"/proc/{pid}/task").iterdir():
        state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        if state not in ("T", "t"):
            return False
    return True


@pytest.mark.slow  # two interpreters importing torch
@pytest.mark.timeout(60)  # 5 s measured
def test_the_loops_store_calls_across_a_frozen_store_leave_the_lease_watch_running():
    import contextlib
    import os
    import signal
    import subprocess
    import sys

    from tests.launcher.helpers import env

    run = {"stdout": subprocess.PIPE, "text": True, "env": env()}
    server = subprocess.Popen([sys.executable, "-c", SERVER], **run)
    agent = None
    try:
        port = server.stdout.readline().strip()
        agent = subprocess.Popen(
            [sys.executable, "-c", AGENT_LOOP, port], stdin=subprocess.PIPE, **run
        )
        assert agent.stdout.readline().strip() == "ready"
        os.kill(server.pid, signal.SIGSTOP)
        # Stopped once every thread of it is: kill() returns before that, and on a busy
        # host the server's thread answered the agent's first call in between (CI, a
        # core kept busy: "the call returned").
        deadline = time.monotonic() + 10.0
        while not stopped(server.pid):
            assert time.monotonic() < deadline, "the store's server did not stop"
            time.sleep(0.01)
        agent.stdin.write("go\n")
        agent.stdin.flush()
        try:
            agent.wait(timeout=20)
        except subprocess.TimeoutExpired:
            raise AssertionError("the agent's threads stopped inside a store call") from None
        said = agent.stdout.read().strip()
        assert said.startswith("fenced after"), said
        assert float(said.split()[2]) >= 0.4  # by the lease, with the call under way
    finally:
        for p in (agent, server):
            if p is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()
