"""The slow fault's charge (launcher/throttle.py): how long the slowed worker is stopped
after each run phase, from the CPU its main thread used and waited for in it and the
share of a CPU its peers get. The whole fault on real workers is
tests/launcher/test_slow_fault.py."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from launcher.throttle import (
    MAX_BOOST,
    MIN_WANTED_NS,
    _moved,
    _summed,
    owed_s,
    peers_pace,
    schedstat,
    share,
)


def test_a_worker_with_a_core_of_its_own_owes_factor_minus_one_times_what_it_ran():
    assert owed_s(3.0, 0.001, 0.0, peers=None) == pytest.approx(0.002)
    assert owed_s(3.0, 0.001, 0.0, peers=1.0) == pytest.approx(0.002)
    assert owed_s(1.0, 0.001, 0.0, peers=1.0) == 0.0


def test_a_phase_spent_waiting_on_a_peer_owes_nothing():
    # (the slow device's waits are not slower: only its work is)
    assert owed_s(3.0, 0.0, 0.0, peers=0.5) == 0.0


def test_on_a_contended_host_the_work_takes_factor_times_the_peers_time():
    # Its peers get half a CPU: a second of their work takes 2 s, so a second of the slowed
    # worker's must take 6 s, what it ran and waited to run included.
    for ran, waited in ((0.001, 0.0), (0.001, 0.001), (0.002, 0.0005)):
        stop = owed_s(3.0, ran, waited, peers=0.5)
        assert (ran + waited + stop) / ran == pytest.approx(3.0 * 2.0)


def test_the_growth_is_capped_where_the_peers_hardly_ran():
    assert MAX_BOOST == 3.0
    assert owed_s(3.0, 0.001, 0.0, peers=0.1) == pytest.approx(0.001 * (3.0 * 3.0 - 1.0))
    assert owed_s(3.0, 0.001, 0.0, peers=0.0) == pytest.approx(0.001 * (3.0 * 3.0 - 1.0))
    # (and never below a whole CPU's: peers that got more than they wanted is noise)
    assert owed_s(3.0, 0.001, 0.0, peers=1.5) == pytest.approx(0.002)


def test_a_worker_that_waited_longer_than_it_owes_is_not_stopped():
    assert owed_s(3.0, 0.001, 0.005, peers=1.0) == 0.0


def test_a_phase_without_both_readings_is_charged_as_run_whole():
    assert _moved((1_000_000, 0), (3_000_000, 500_000), 0.01) == pytest.approx((0.002, 0.0005))
    assert _moved(None, (3_000_000, 0), 0.01) == (0.01, 0.0)
    assert _moved((5_000_000, 0), (3_000_000, 0), 0.01) == (0.01, 0.0)  # (a reused pid)


def test_peers_are_summed_and_a_reused_pid_is_left_out():
    before = {1: (0, 0), 2: (10_000_000, 0), 3: None}
    after = {1: (3_000_000, 1_000_000), 2: (1_000, 0), 3: (5, 5), 4: (9, 9)}
    # (2 went backwards: another process now; 3 unreadable before; 4 new)
    assert _summed(before, after) == pytest.approx(0.75)


def test_a_share_needs_enough_time_wanting_a_cpu_and_both_readings():
    assert share((0, 0), (3_000_000, 1_000_000)) == pytest.approx(0.75)
    assert share((10, 10), (10 + MIN_WANTED_NS // 4, 10)) is None
    assert share(None, (3_000_000, 0)) is None
    assert share((5_000_000, 0), (3_000_000, 0)) is None  # (a reused pid went backwards)


def test_schedstat_reads_a_live_process_and_none_for_a_gone_one():
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.1)  # (a process that has not run yet reads as no counters)
        first = schedstat(spin.pid)
        time.sleep(0.3)
        then = schedstat(spin.pid)
        if first is None:
            pytest.skip("this kernel keeps no /proc/<pid>/schedstat counters")
        assert then is not None and then[0] > first[0]
        assert (share(first, then) or 0.0) > 0.0
    finally:
        spin.kill()
        spin.wait()
    assert schedstat(spin.pid) is None


# A worker's loop between waits: passes of 4 ms of CPU, then 30 ms blocked (on a peer),
# each pass's wall time printed once it has ended.
PASSES = r"""
import sys, time
until = time.monotonic() + float(sys.argv[1])
while time.monotonic() < until:
    for _ in range(2):
        t = time.monotonic()
        spent = time.thread_time() + 0.004
        while time.thread_time() < spent:
            pass
        print(t, time.monotonic() - t, flush=True)
    time.sleep(0.03)
"""


@pytest.mark.slow
@pytest.mark.solo  # (a pass's time before the slowdown against during it)
@pytest.mark.timeout(60)  # 5 s measured
def test_every_pass_is_slowed_however_busy_the_agent_is_and_the_waits_are_not():
    """The slowed worker waits most of its time (as one dealt fewer micro-batches does),
    and the agent's own threads hold its GIL: each pass still takes about 3x as long, so
    the stops came in the passes, not in the waits; after the slowdown the worker runs
    on at full speed, and the cycle's process is gone."""
    import statistics
    import threading
    import types

    from launcher.throttle import Throttle

    worker = subprocess.Popen(
        [sys.executable, "-c", PASSES, "4.5"], stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    ended: list = []
    hold = threading.Event()

    def busy() -> None:  # (the agent's other threads: pure Python, holding the GIL)
        while not hold.is_set():
            sum(range(10_000))

    try:
        time.sleep(1.0)
        began = time.monotonic()
        hog = threading.Thread(target=busy, daemon=True)
        hog.start()
        throttle = Throttle(
            types.SimpleNamespace(pid=worker.pid, popen=worker), 3.0, 2.0,
            lambda lasted, duty: ended.append((lasted, duty)),
        )  # fmt: skip
        out, _ = worker.communicate(timeout=30)
        hold.set()
        throttle.close()
    finally:
        hold.set()
        worker.kill()
        worker.wait()
    passes = [tuple(map(float, ln.split())) for ln in out.splitlines() if ln]
    before = statistics.median(d for t, d in passes if t < began)
    during = statistics.median(d for t, d in passes if began + 0.3 < t < began + 2.0)
    after = statistics.median(d for t, d in passes if t > began + 2.3)
    print(f"pass {before * 1e3:.1f} ms, slowed {during * 1e3:.1f} ms, after {after * 1e3:.1f} ms")
    assert during >= 2.4 * before  # (3x asked; a passes' median at full speed read 1.0x)
    assert after <= 1.5 * before
    ((lasted, duty),) = ended
    assert lasted == pytest.approx(2.0, abs=0.3)
    assert duty.reached >= 0.9 * 3.0 and duty.priority in ("realtime", "nice", "normal")
    assert not throttle.active and throttle._cycle.returncode is not None


def test_the_peers_pace_counts_a_share_of_nothing_as_the_slowest_not_as_unknown():
    # (what `reached` divides by: a window in which the peers hardly ran is not a whole CPU)
    assert peers_pace(None) == 1.0 and peers_pace(1.5) == 1.0
    assert peers_pace(0.5) == pytest.approx(2.0)
    assert peers_pace(0.0) == 100.0
