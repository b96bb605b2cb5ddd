"""A worker waiting for the plan after its generation (chameleon_runtime/control.py
``Control._wait_for_plan``), on a real TCPStore: the key it waits on may be deleted
under it once a later generation is confirmed without it (a spare, left out of the
plan); it follows the newest plan instead of waiting forever. And a replacement, which
starts listening mid-job, catching up on what its mailbox never brought."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from chameleon_runtime.control import END_MARK, PLAN_LOOK_S, Control, Finished
from chameleon_runtime.liveness import Interrupts
from chameleon_runtime.protocol.messages import Keys
from chameleon_runtime.protocol.seal import Seal
from chameleon_runtime.stopsignals import StopSignals


@pytest.fixture
def setup():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=30))
    seal = Seal("token", "run")
    control = Control.__new__(Control)  # its store, keys and seal only: no threads
    control.store, control.keys, control.seal = client, Keys(0), seal
    control.stop_signals = StopSignals(0)
    control._timeout = timedelta(seconds=30)
    control.interrupts = Interrupts()
    return server, control, seal


def waiting(control: Control, after: int) -> tuple[threading.Thread, list]:
    """``_wait_for_plan(after)`` on a thread: what it returned or raised lands in the list."""
    out: list = []

    def wait() -> None:
        try:
            control._wait_for_plan(after)
            out.append("returned")
        except Finished as done:
            out.append(done)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread, out


def test_a_successor_key_deleted_under_its_waiter_is_followed_by_the_newest_plan(setup):
    server, control, seal = setup
    thread, out = waiting(control, after=0)
    time.sleep(0.2)  # (waiting on generation 0's successor key, which never comes)
    # Generation 1 was published and confirmed by its members; generation 0's keys went.
    server.set(control.keys.latest, seal.seal("1"))
    thread.join(timeout=PLAN_LOOK_S * 10)
    assert out == ["returned"]


def test_a_key_deleted_between_the_wait_and_the_read_is_not_waited_for(setup):
    """The wait saw the key; it is gone before the read (the next generation confirmed
    meanwhile): the read gives up within PLAN_LOOK_S, not the store's whole timeout."""
    server, control, seal = setup
    server.set(control.keys.latest, seal.seal("1"))
    began = time.monotonic()
    assert control._get_within(control.keys.next(0), PLAN_LOOK_S) is None
    assert time.monotonic() - began < PLAN_LOOK_S * 5
    assert control.store.timeout == timedelta(seconds=30)  # (the store's own, back)


def test_the_successor_key_itself_wakes_its_waiter_and_a_forged_one_does_not(setup):
    server, control, seal = setup
    thread, out = waiting(control, after=0)
    server.set(control.keys.next(0), "forged")
    time.sleep(0.3)
    assert out == []  # (a forged key: the real one is waited for)
    server.set(control.keys.next(0), seal.seal("1"))
    thread.join(timeout=PLAN_LOOK_S * 10)
    assert out == ["returned"]


def test_the_end_of_training_in_the_successor_key_is_finished(setup):
    server, control, seal = setup
    thread, out = waiting(control, after=2)
    server.set(control.keys.latest, seal.seal("2"))  # (not newer than the one left)
    server.set(control.keys.next(2), seal.seal(f"{END_MARK}41"))
    thread.join(timeout=PLAN_LOOK_S * 10)
    assert len(out) == 1 and isinstance(out[0], Finished) and out[0].step == 41


def test_a_replacement_catches_up_on_an_abort_and_an_end_that_came_before_it_listened(setup):
    # The launcher aborts generation 0 (its key, and its mailboxes: not the replacement's,
    # which is asked for just after), then asks for the replacement; the replacement reads
    # generation 0 as the newest. Seen in CI: it waited as a spare on generation 0 to the
    # end of training, never taken in.
    server, control, seal = setup
    server.set(control.keys.abort(1), "forged")  # (not the launcher's: changes nothing)
    control.catch_up(1)
    assert not control.interrupts.aborted(1) and control.interrupts.finished is None
    server.set(control.keys.abort(0), seal.seal('{"kind": "abort", "generation": 0}'))
    control.catch_up(0)
    spare = threading.Event()
    with control.interrupts.watch(0, spare):  # the spare's wait ends at once
        assert spare.is_set()
    assert not control.interrupts.aborted(1)  # (only what was aborted)
    server.set(control.keys.finished, seal.seal("41"))
    control.catch_up(1)
    assert control.interrupts.finished == 41
