"""launcher.etcd's store against a real 3-member cluster: what ControlPlane relies on."""

from __future__ import annotations

import threading
import time

import pytest

from chameleon_runtime.protocol.seal import Seal
from launcher.etcd import EtcdStore, parse_endpoints
from launcher.etcd_control import EtcdControlPlane
from launcher.rendezvous import RendezvousError
from launcher.store import QueueEmpty, drain
from tests.clock import budget

# real processes, seconds each: the full suite (CI) runs them, the fast tier does not
pytestmark = pytest.mark.slow


@pytest.mark.timeout(60)  # 2 s measured
def test_counters_are_atomic_across_connections(etcd):
    stores = [EtcdStore(parse_endpoints(etcd.endpoints)) for _ in range(4)]
    seen: list[int] = []
    threads = [
        threading.Thread(target=lambda s=s: seen.extend(s.add("n", 1) for _ in range(20)))
        for s in stores
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == list(range(1, 81))  # every add saw a value of its own


@pytest.mark.timeout(60)  # 1 s measured
def test_queue_keeps_order_and_leaves_no_items(etcd):
    store = EtcdStore(parse_endpoints(etcd.endpoints))
    for item in ("a", "b", "c"):
        store.queue_push("q", item)
    assert store.queue_len("q") == 3
    assert [store.queue_pop("q") for _ in range(3)] == [b"a", b"b", b"c"]
    assert store.queue_len("q") == 0
    assert sorted(store.keys("q/")) == ["q/head", "q/tail"]
    # drained without counting first (launcher/store.py drain), as a TCPStore's queue is
    for item in ("d", "e"):
        store.queue_push("q", item)
    assert drain(store, "q") == [b"d", b"e"]
    assert drain(store, "q") == []
    with pytest.raises(QueueEmpty):  # (not "slot never written": nobody took one)
        store.queue_pop("q", block=False)


@pytest.mark.timeout(60)  # 8 s measured
def test_a_leased_key_goes_when_its_lease_is_not_refreshed(etcd):
    store = EtcdStore(parse_endpoints(etcd.endpoints))
    lease = store.grant(2)
    assert store.create("leader", "me", lease=lease)
    assert not store.create("leader", "you")
    for _ in range(4):  # refreshed: outlives its TTL
        time.sleep(0.8)
        assert store.keepalive(lease)
    assert store.check(["leader"])
    deadline = time.monotonic() + budget(6)
    while store.check(["leader"]):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert not store.keepalive(lease)


@pytest.mark.timeout(60)  # 2 s measured
def test_calls_move_to_the_next_member_when_one_is_killed(etcd):
    store = EtcdStore(parse_endpoints(etcd.endpoints))
    store.set("k", "1")
    etcd.kill(0)
    store.set("k", "2")
    assert store.get("k") == b"2"


@pytest.mark.timeout(60)  # 1 s measured
def test_one_agent_leads_a_fresh_incarnation_and_the_next_joins_it(etcd):
    def open_one():
        return EtcdControlPlane.open(
            run_id="r", endpoints=etcd.endpoints, ttl_s=3, timeout_s=10,
            worker_host="127.0.0.1", seal=Seal("secret", "r"),
        )  # fmt: skip

    first, second = open_one(), open_one()
    assert (first.is_leader, second.is_leader) == (True, False)
    assert first.namespace == second.namespace == "chameleon/r/1"
    assert second.node_alive(first.key) and first.leader() == first.key
    # (both share one node key, being in one process: the leader leaves first)
    first.close(last=True)  # the job ended: its incarnation's keys are gone, at once
    assert first.store.keys("chameleon/r/1/") == []
    second.close(last=False)
    third = open_one()
    assert third.is_leader and third.namespace == "chameleon/r/2"
    assert third.store.keys("chameleon/r/1/") == []
    third.close(last=True)


@pytest.mark.timeout(60)  # 1 s measured
def test_an_agent_with_another_token_or_none_is_refused_by_name(etcd):
    def open_one(token):
        return EtcdControlPlane.open(
            run_id="t", endpoints=etcd.endpoints, ttl_s=3, timeout_s=10,
            worker_host="127.0.0.1", seal=Seal(token, "t"),
        )  # fmt: skip

    leader = open_one("right")
    for token, why in (
        ("wrong", "signed with another job token"),
        (None, "needs its job token .*"),
    ):
        with pytest.raises(RendezvousError, match=f"run 't' on etcd .* {why}: refused"):
            open_one(token)
    leader.put("r0/decision", {"action": "finish"})
    forged = EtcdStore(parse_endpoints(etcd.endpoints))  # a client without the token
    forged.set(f"{leader.namespace}/r0/world", '{"attempt": 0}')
    assert leader.get("r0/decision") == {"action": "finish"}
    assert leader.get("r0/world") is None  # unsigned: as if it were not there
    assert leader.seal.refused == 1
    leader.close(last=True)


def _plane(etcd, run_id="f"):
    return EtcdControlPlane.open(
        run_id=run_id, endpoints=etcd.endpoints, ttl_s=2, timeout_s=10,
        worker_host="127.0.0.1", seal=Seal("secret", run_id),
    )  # fmt: skip


@pytest.mark.timeout(60)  # 1 s measured
def test_an_agent_whose_lease_ran_out_can_write_nothing(etcd):
    from launcher.etcd import Fenced

    leader, follower = _plane(etcd), _plane(etcd)
    follower.put("r0/report", 1)
    assert leader.get("r0/report") == 1
    follower.store.revoke(follower.lease)  # what running out does: its keys go
    assert leader.node_alive(follower.key) is False
    writes = {
        "put": lambda: follower.put("r0/report", 2),
        "add": lambda: follower.add("r0/count", 1),
        "queue": lambda: follower.request_kill(0, leader.key, 1, "x", 1.0),
        "create": lambda: follower.store.create(follower._k("leader2"), "me"),
        "delete": lambda: follower.store.delete_key(follower._k("r0/report")),
        "delete_prefix": lambda: follower.store.delete_prefix(follower.namespace + "/"),
    }
    for name, write in writes.items():
        with pytest.raises(Fenced, match="lease ran out"):
            write()
        assert leader.get("r0/report") == 1, name
    with pytest.raises(Fenced):
        follower.beat()
    with pytest.raises(Fenced):
        follower.campaign()  # nor lead: the leader's key needs a live lease
    assert leader.store.keys(f"{leader.namespace}/r0/") == [f"{leader.namespace}/r0/report"]
    leader.close(last=True)


@pytest.mark.timeout(90)  # 22 s measured
def test_leases_outlive_an_outage_of_every_member(etcd, tmp_path):
    # etcd's new leader renews every lease: agents cut off from all of etcd together are
    # not lost for it (launcher/outage.py relies on this).
    from launcher.store import StoreError

    leader, follower = _plane(etcd, "o"), _plane(etcd, "o")
    for i in range(len(etcd.members)):
        etcd.kill(i)
    started = time.monotonic()
    with pytest.raises(StoreError, match="no etcd member answers"):
        follower.beat()
    with pytest.raises(StoreError):
        follower.put("r0/x", 1)  # once unreachable, a call tries each member once
    assert time.monotonic() - started < follower.store.unreachable_after_s + 2
    time.sleep(5)  # more than twice the lease's TTL
    etcd.start_all(tmp_path)
    deadline = time.monotonic() + budget(30)
    while True:
        try:
            follower.beat()
            break
        except StoreError:
            assert time.monotonic() < deadline, "etcd did not come back"
            time.sleep(0.2)
    assert leader.node_alive(follower.key) and leader.leader() == leader.key
    follower.put("r0/x", 1)
    assert leader.get("r0/x") == 1
    leader.close(last=True)


@pytest.mark.timeout(60)  # 1 s measured
def test_an_expired_lease_is_told_as_such_and_revoking_it_again_is_harmless(etcd):
    store = EtcdStore(parse_endpoints(etcd.endpoints))
    lease = store.grant(2)
    store.revoke(lease)
    assert store.keepalive(lease) is False
    store.revoke(lease)
