"""The slow fault's duty cycle (launcher/throttle.py): how long each stop lasts, from the
share of a CPU the slowed worker got in its run phase and the share its peers get. The
whole fault on real workers is tests/launcher/test_slow_fault.py."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from launcher.throttle import MAX_BOOST, MIN_WANTED_NS, _summed, schedstat, share, stop_s


def test_equal_shares_give_the_plain_cycle():
    assert stop_s(3.0, 0.001, own=0.5, peers=0.5) == pytest.approx(0.002)
    assert stop_s(3.0, 0.001, own=None, peers=0.5) == pytest.approx(0.002)
    assert stop_s(3.0, 0.001, own=1.0, peers=None) == pytest.approx(0.002)


def test_a_worker_the_scheduler_favoured_is_stopped_longer_in_proportion():
    # Continued, it ran at a whole core while its peers got half of one: to get a third
    # of what they get, it must be stopped for 5 run phases, not 2.
    assert stop_s(3.0, 0.001, own=1.0, peers=0.5) == pytest.approx(0.005)
    ran = 0.001
    stopped = stop_s(3.0, ran, own=1.0, peers=0.5)
    assert (1.0 * ran / (ran + stopped)) == pytest.approx(0.5 / 3.0)


def test_the_growth_is_capped_where_the_peers_hardly_ran():
    assert MAX_BOOST == 3.0
    assert stop_s(3.0, 0.001, own=1.0, peers=0.1) == pytest.approx(0.001 * (3.0 * 3.0 - 1.0))


def test_peers_are_summed_and_a_reused_pid_is_left_out():
    before = {1: (0, 0), 2: (10_000_000, 0), 3: None}
    after = {1: (3_000_000, 1_000_000), 2: (1_000, 0), 3: (5, 5), 4: (9, 9)}
    # (2 went backwards: another process now; 3 unreadable before; 4 new)
    assert _summed(before, after) == pytest.approx(0.75)


def test_a_worker_that_got_less_than_its_peers_is_never_stopped_less_than_plainly():
    # (its own share low: it waited on a peer, or the reading is noise; the slowdown
    # stays at least the asked factor of the host's time)
    assert stop_s(3.0, 0.001, own=0.2, peers=0.8) == pytest.approx(0.002)
    assert stop_s(1.0, 0.001, own=1.0, peers=1.0) == 0.0


def test_a_share_needs_enough_time_wanting_a_cpu_and_both_readings():
    assert share((0, 0), (3_000_000, 1_000_000)) == pytest.approx(0.75)
    assert share((10, 10), (10 + MIN_WANTED_NS // 4, 10)) is None
    assert share(None, (3_000_000, 0)) is None
    assert share((5_000_000, 0), (3_000_000, 0)) is None  # (a reused pid went backwards)


def test_schedstat_reads_a_live_process_and_none_for_a_gone_one():
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        first = schedstat(spin.pid)
        time.sleep(0.3)
        then = schedstat(spin.pid)
        if first is None:
            pytest.skip("this kernel has no /proc/<pid>/schedstat")
        assert then is not None and then[0] > first[0]
        assert (share(first, then) or 0.0) > 0.0
    finally:
        spin.kill()
        spin.wait()
    assert schedstat(spin.pid) is None
