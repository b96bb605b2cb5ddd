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


def test_an_agreement_holds_for_all_members_or_for_none_under_racing_aborts(monkeypatch):
    monkeypatch.setenv("CHAMELEON_JOB_TOKEN", "test-token")
    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    controls = [Control("127.0.0.1", master.port, r, timeout_s=30) for r in range(MEMBERS)]
    rng = random.Random(0)
    outcomes = {True: 0, False: 0}
    try:
        for generation in range(60):
            held: list[bool | None] = [None] * MEMBERS
            arrive = [rng.random() * 0.004 for _ in range(MEMBERS)]
            abort_after = rng.random() * 0.006 if rng.random() < 0.8 else None

            threads = [
                threading.Thread(target=_member, args=(controls[i], generation, arrive[i], held, i))
                for i in range(MEMBERS)
            ]
            for t in threads:
                t.start()
            if abort_after is not None:
                time.sleep(abort_after)
                for c in controls:  # as the coordinator aborts: one message per mailbox
                    c.push_signed(c.keys.mailbox(c.rank), Abort(generation=generation))
            for t in threads:
                t.join(timeout=20)
            assert None not in held, f"generation {generation}: a member never returned"
            assert len(set(held)) == 1, f"generation {generation}: {held}"
            outcomes[held[0]] += 1
    finally:
        for c in controls:
            c.close()
    # both outcomes were exercised: aborts that came first, and agreements that held
    assert outcomes[True] > 0 and outcomes[False] > 0, outcomes


def _store() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )


def test_later_poisons_leave_an_agreement_that_held_held():
    """Every member arrived (the last wrote "yes"), then two members' watchers heard the
    abort: the second poison wrote "no" over the "yes" before the slower members read it,
    and they resumed one step behind the rest (the chaos soak, seed 0: [134, 135])."""
    store = _store()
    for _ in range(MEMBERS):
        arrived = store.add("count", 1)
    assert arrived == MEMBERS
    store.set("done", "yes")
    for _ in range(MEMBERS):  # every member's watcher, and a second abort
        poison(store, "count", "done", MEMBERS)
    assert store.get("done") == b"yes"


def test_the_first_poison_decides_an_agreement_that_had_not_held():
    store = _store()
    store.add("count", 1)
    store.add("count", 1)
    poison(store, "count", "done", MEMBERS)
    assert store.get("done") == b"no"
    store.set("done", "unread")  # so that a write by anything after shows
    poison(store, "count", "done", MEMBERS)
    # the last member arrives after the abort: it must not find the counter complete
    assert store.add("count", 1) != MEMBERS
    poison(store, "count", "done", MEMBERS)
    assert store.get("done") == b"unread"


def test_an_abort_decides_held_when_the_last_member_died_before_writing_yes():
    """The last member's add completed the arrivals, and it was killed before its set of
    "yes" (a kill in a recovery's confirm phase): the member that arrived first waited on
    the done key forever, and the launcher waited for it (CI, test_recovery's reserve
    case). The abort's poison finds every member arrived: the agreement held."""
    store = _store()
    for _ in range(MEMBERS):
        arrived = store.add("count", 1)
    assert arrived == MEMBERS  # ... and the last one dies here, "yes" unwritten
    poison(store, "count", "done", MEMBERS)
    assert store.get("done") == b"yes"
    poison(store, "count", "done", MEMBERS)  # a second abort changes nothing
    assert store.get("done") == b"yes"
