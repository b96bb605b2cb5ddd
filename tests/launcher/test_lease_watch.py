"""A TCPStore follower's lease on its own clock (launcher/outage.py): real threads."""

import threading
import time

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
