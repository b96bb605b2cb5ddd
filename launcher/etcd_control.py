"""The job's control plane on etcd: the same rounds, reports and decisions as on the
first node's TCPStore (launcher/rendezvous.py), but held by a cluster that outlives any
one node, and a leader that is elected instead of being whoever hosts the store.

Layout, under ``chameleon/<run_id>/``:
- ``incarnation``: the number of the job's current incarnation ``n``; a job is one
  incarnation, so a run id can be used again once its job has ended (or died: an
  incarnation with no leader and no live agent is stale and is replaced);
- ``<n>/alive/<agent>``: bound to the agent's lease (TTL --heartbeat-timeout, refreshed
  every beat): the key vanishes when the agent stops refreshing, which is how the leader
  sees a node lost (etcd's clock, no skew between hosts);
- ``<n>/leader``: the elected leader's agent key, bound to its lease: created by one
  transaction (the election) and gone when that agent dies, when the others campaign;
- ``<n>/r<a>/...``: the rounds, as on the TCPStore;
- ``ended``: ``{"incarnation": n, "exit_code", "reason"}``, written by the last leader as
  it removes ``<n>/`` (no lease: an agent of n that writes after that learns the job
  ended, not that it was fenced).
The leader still hosts each round's worker store; its node lost, the new leader takes the
round's decision (launcher/agent.py).
"""

from __future__ import annotations

import json
import math
import time

from chameleon_runtime.protocol.seal import Seal
from launcher.etcd import (
    EndMark,
    EtcdStore,
    _absent,
    _present,
    _unchanged,
    parse_endpoints,
    put_request,
)
from launcher.rendezvous import ControlPlane, RendezvousError, node_key
from launcher.store import StoreError

# etcd refuses leases shorter than about 1.5 election timeouts; 2 s is safe at defaults.
MIN_TTL_S = 2


def end_key(run_id: str) -> str:
    """Where the last leader of an incarnation says that it ended (``close``)."""
    return f"chameleon/{run_id}/ended"


class EtcdControlPlane(ControlPlane):
    elected = True  # the leader is chosen by an election, and another can take over

    def __init__(
        self,
        store: EtcdStore,
        run_id: str,
        key: str,
        *,
        is_leader: bool,
        namespace: str,
        lease: int,
        worker_host: str,
        seal: Seal,
    ) -> None:
        super().__init__(
            store, run_id, key, is_leader=is_leader, addr=store.where, port=0, seal=seal
        )
        self.namespace = namespace
        self.lease = lease
        self._worker_host = worker_host
        # Every write from here on holds only while this agent's lease does (the fence).
        store.guard = self._k(f"alive/{key}")
        # ...or until the job ends: the last leader's close removes the guard with the
        # rest of the incarnation, and says so here (``close``), so that an agent still
        # joining or leaving then reads the end of the job, not a fence.
        store.end_mark = EndMark(end_key(run_id), namespace.rsplit("/", 1)[-1], lease)

    @property
    def worker_host(self) -> str:
        return self._worker_host

    @property
    def endpoint(self) -> str:
        return f"etcd {self.store.where} ({self.namespace})"

    def _k(self, key: str) -> str:
        return f"{self.namespace}/{key}"

    # -- setup -------------------------------------------------------------------------

    @classmethod
    def open(  # type: ignore[override]
        cls,
        *,
        run_id: str,
        endpoints: str,
        ttl_s: float,
        timeout_s: float,
        worker_host: str,
        seal: Seal,
    ) -> EtcdControlPlane:
        """Join the run's live incarnation, or start the next one as its leader."""
        store = EtcdStore(parse_endpoints(endpoints))
        key = node_key()
        base = f"chameleon/{run_id}"
        lease = store.grant(max(MIN_TTL_S, math.ceil(ttl_s)))
        deadline = time.monotonic() + timeout_s

        def make(leader: bool, namespace: str) -> EtcdControlPlane:
            return cls(
                store, run_id, key, is_leader=leader, namespace=namespace, lease=lease,
                worker_host=worker_host, seal=seal,
            )  # fmt: skip

        while time.monotonic() < deadline:
            found = store._get(f"{base}/incarnation")
            n = int(found[0]) if found else 0
            namespace = f"{base}/{n}"
            if found is not None and (
                store.check([f"{namespace}/leader"]) or store.keys(f"{namespace}/alive/")
            ):
                proof = store._get(f"{namespace}/auth")
                why = seal.refusal(proof[0] if proof else None)
                if why is not None:
                    store.revoke(lease)
                    raise RendezvousError(f"run {run_id!r} on etcd {store.where} {why}: refused")
                # Joined only while the incarnation is live: its last leader's close may
                # come between the look above and this write, and a plain put would bring
                # the ended incarnation back to life with this agent in it (which would
                # then campaign, win and lead it). ``auth`` has no lease; only the end of
                # the incarnation removes it.
                if store._txn(
                    [_present(f"{namespace}/auth"), _unchanged(f"{base}/incarnation", found[1])],
                    [put_request(f"{namespace}/alive/{key}", "1", lease)],
                ):
                    return make(False, namespace)
                continue  # it ended: look again (the next incarnation, as a requeue's)
            # Nobody lives in incarnation n: start n + 1 and lead it, in one transaction
            # (two agents starting together: one wins, the other joins it).
            fresh = f"{base}/{n + 1}"
            guard = (
                _absent(f"{base}/incarnation")
                if found is None
                else _unchanged(f"{base}/incarnation", found[1])
            )
            puts = [
                put_request(f"{base}/incarnation", str(n + 1)),
                put_request(f"{fresh}/leader", key, lease),
                put_request(f"{fresh}/alive/{key}", "1", lease),
                put_request(f"{fresh}/auth", seal.proof()),
            ]
            if store._txn([guard], puts):
                if found is not None:
                    store.delete_prefix(f"{namespace}/")  # the stale incarnation's keys
                return make(True, fresh)
        raise RendezvousError(f"could not join run {run_id!r} on etcd {store.where}")

    def clone(self, *, timeout_s: float = 10.0) -> EtcdControlPlane:
        return EtcdControlPlane(
            self.store.clone(), self.run_id, self.key, is_leader=self.is_leader,
            namespace=self.namespace, lease=self.lease, worker_host=self._worker_host,
            seal=self.seal,
        )  # fmt: skip

    # -- liveness and the leader --------------------------------------------------------

    def beat(self) -> None:
        """Refresh this agent's lease; an expired one is a lost node (the leader has
        counted this node's ranks as failed): say so instead of beating on."""
        if not self.store.keepalive(self.lease):
            raise self.store._fenced()

    def beats(self, key: str) -> int:
        return 0

    def node_alive(self, key: str) -> bool | None:
        return self.store.check([self._k(f"alive/{key}")])

    def leader(self) -> str | None:
        found = self.store._get(self._k("leader"))
        return None if found is None else found[0].decode()

    def campaign(self) -> bool:
        """The leader's key is gone (its lease expired): try to become the leader."""
        if self.store.create(self._k("leader"), self.key, lease=self.lease):
            self.is_leader = True
        return self.is_leader

    def close(self, *, last: bool, exit_code: int = 0, reason: str = "") -> None:
        """Leave: the lease goes (our keys with it); the last leader removes the job,
        first (a delete is guarded by the lease, launcher/etcd.py), and in the same
        transaction writes the end mark: the incarnation that ended and how. One key per
        run id, overwritten by the next incarnation's end: a requeue of the same run id
        starts incarnation n + 1, and only an agent of n reads n's end in it."""
        try:
            if last:
                incarnation = self.namespace.rsplit("/", 1)[-1]
                mark = {"incarnation": incarnation, "exit_code": exit_code, "reason": reason[:200]}
                self.store.delete_prefix(
                    f"{self.namespace}/", put=(end_key(self.run_id), json.dumps(mark))
                )
            self.store.revoke(self.lease)
        except StoreError:
            pass

    # -- what a successor needs (launcher/coordinator.py, snapshot) --------------------------------

    def mark_lost(self, attempt: int, key: str) -> None:
        self.put(f"r{attempt}/lost/{key}", True)

    def lost_nodes(self, attempt: int, keys: list[str]) -> set[str]:
        return {k for k in keys if self.get(f"r{attempt}/lost/{k}") is not None}
