"""The store agreement a step's commit (exact sums), a checkpoint and a migration rest on
(chameleon_runtime.control.Control.agree): all-or-none, whatever the moment an abort
reaches each member. Real TCPStore, real Control objects with their watcher threads, the
abort pushed signed to each mailbox as the launcher pushes it."""

import random
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from chameleon_runtime.control import Control, poison
from chameleon_runtime.protocol.messages import Abort

MEMBERS = 3


def _member(control: Control, generation: int, delay: float, held: list, i: int) -> None:
    time.sleep(delay)
    held[i] = control.agree(generation, "commit/1", MEMBERS).held


def _until(condition, what: str, timeout_s: float = 20.0) -> None:
    """Poll Python-side state only: the members' threads hold the store's sockets."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def _abort(launcher: Control, generation: int) -> None:
    """As the coordinator aborts: one message per mailbox, over a connection of its own. (A
    member's connection is busy while it waits: a push over it waited for the agreement to
    end, so every abort came after it.)"""
    for rank in range(MEMBERS):
        launcher.push_signed(launcher.keys.mailbox(rank), Abort(generation=generation))


def _run(controls: list[Control], generation: int, held: list, members, delays) -> list:
    threads = [
        threading.Thread(target=_member, args=(controls[i], generation, delays[i], held, i))
        for i in members
    ]
    for t in threads:
        t.start()
    return threads


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(timeout=20)


def test_an_agreement_holds_for_all_members_or_for_none_under_racing_aborts(monkeypatch):
    """Random races, and one generation in ten of each ordering forced, so that both
    outcomes are exercised however the host schedules the threads: with a core busy,
    every random abort once came after the agreement (CI, {True: 60, False: 0})."""
    monkeypatch.setenv("CHAMELEON_JOB_TOKEN", "test-token")
    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    controls = [Control("127.0.0.1", master.port, r, timeout_s=30) for r in range(MEMBERS)]
    launcher = Control("127.0.0.1", master.port, MEMBERS, timeout_s=30)
    everyone = range(MEMBERS)
    rng = random.Random(0)
    outcomes = {True: 0, False: 0}
    try:
        for generation in range(60):
            held: list[bool | None] = [None] * MEMBERS
            kind = generation % 10
            if kind == 0:  # every member heard the abort before any arrived: none held
                _abort(launcher, generation)
                _until(
                    lambda g=generation: all(c.interrupts.aborted(g) for c in controls),
                    f"generation {generation}: every member to hear the abort",
                )
                # one after another: members that arrive together may all arrive before
                # the first of them poisons it, and then it holds for all of them
                for i in everyone:
                    _join(_run(controls, generation, held, (i,), [0.0] * MEMBERS))
                assert held == [False] * MEMBERS, f"generation {generation}: {held}"
            elif kind == 1:  # two members wait when the abort comes, the third after it
                waiting = (0, 1)
                first = _run(controls, generation, held, waiting, [0.0] * MEMBERS)
                _until(
                    lambda w=waiting: all(controls[i]._pending is not None for i in w),
                    f"generation {generation}: two members to wait",
                )
                _abort(launcher, generation)
                _join(first)  # the poison woke them
                _join(_run(controls, generation, held, (2,), [0.0] * MEMBERS))
                assert held == [False] * MEMBERS, f"generation {generation}: {held}"
            elif kind == 2:  # no abort: it holds
                _join(_run(controls, generation, held, everyone, [0.0] * MEMBERS))
                assert held == [True] * MEMBERS, f"generation {generation}: {held}"
            else:  # an abort at a random moment, or none
                arrive = [rng.random() * 0.004 for _ in everyone]
                abort_after = rng.random() * 0.006 if rng.random() < 0.8 else None
                threads = _run(controls, generation, held, everyone, arrive)
                if abort_after is not None:
                    time.sleep(abort_after)
                    _abort(launcher, generation)
                _join(threads)
            assert None not in held, f"generation {generation}: a member never returned"
            assert len(set(held)) == 1, f"generation {generation}: {held}"
            outcomes[held[0]] += 1
    finally:
        for c in [*controls, launcher]:
            c.close()
    assert outcomes[True] >= 6 and outcomes[False] >= 12, outcomes


def _store() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )


def _last_arrives(store: dist.TCPStore) -> bool:
    """The last member's part of ``Control.agree``: held when its "yes" was the write."""
    return store.compare_set("done", "", "yes") == b"yes"


def test_later_poisons_leave_an_agreement_that_held_held():
    """Every member arrived (the last wrote "yes"), then two members' watchers heard the
    abort: a later poison that wrote "no" over the "yes" before the slower members read
    it had them resume one step behind the rest (the chaos soak, seed 0: [134, 135])."""
    store = _store()
    for _ in range(MEMBERS):
        arrived = store.add("count", 1)
    assert arrived == MEMBERS and _last_arrives(store)
    for _ in range(MEMBERS):  # every member's watcher, and a second abort
        poison(store, "done")
    assert store.get("done") == b"yes"


def test_the_first_write_decides_an_agreement_that_had_not_held():
    store = _store()
    store.add("count", 1)
    store.add("count", 1)
    poison(store, "done")
    poison(store, "done")  # (another member's watcher)
    assert store.get("done") == b"no"
    # the last member arrives after the abort: its count completes, its "yes" is not
    # the write, and it reads what the others read
    assert store.add("count", 1) == MEMBERS
    assert not _last_arrives(store)
    assert store.get("done") == b"no"


def test_an_abort_decides_when_the_last_member_died_before_writing_yes():
    """The last member's add completed the arrivals, and it was killed before its "yes"
    (a kill in a recovery's confirm phase): the member that arrived first waited on the
    done key forever, and the launcher waited for it (CI, test_recovery's reserve
    case). The abort's poison decides: not held, for everyone who reads it."""
    store = _store()
    for _ in range(MEMBERS):
        arrived = store.add("count", 1)
    assert arrived == MEMBERS  # ... and the last one dies here, "yes" unwritten
    poison(store, "done")
    assert store.get("done") == b"no"


def test_any_poisoner_decides_when_the_first_died_before_its_write():
    """Poisoning the counter and then writing "no" left a window: the first poisoner
    killed between the two, no later poison wrote anything, and the members waited
    forever. The done key is the one write now: any member's watcher makes it."""
    store = _store()
    store.add("count", 1)
    # (the first poisoner dies before writing: nothing of it is in the store)
    poison(store, "done")  # a second member's watcher
    assert store.get("done") == b"no"
