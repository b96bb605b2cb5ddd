"""The control plane on an etcd v3 cluster (``--rdzv-backend etcd``): the subset of
TCPStore's interface that ``launcher.rendezvous.ControlPlane`` speaks (set, get, check,
add, queues), plus leases, over several endpoints.

Why etcd3gw (docs/launcher.md has the comparison): it speaks etcd's JSON gateway over
HTTP, so there is no gRPC or protobuf pin to clash with torch's; it is maintained (by
OpenStack) where python-etcd3 last released in 2020. Every call goes to one endpoint and
moves on to the next when that one does not answer: a member killed mid-run costs one
refused connection, and a cluster that lost its leader answers again after its election.

Keys are JSON text, as on the TCPStore. Counters are compare-and-swap loops on the key's
revision (etcd has no atomic add); queues are a head and a tail counter with one key per
item, popped by their single reader.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

from launcher.store import QueueEmpty, StoreError

T = TypeVar("T")


class Fenced(StoreError):
    """etcd refused a write because this agent's lease is gone: the job has counted this
    node lost and gone on without it, so anything it would write is stale."""


class JobEnded(Fenced):
    """etcd refused a write because the job this agent joined has ended: its last leader
    removed the incarnation's keys, the guard among them, while this agent's lease still
    held (a node that joined as the job finished, or a follower slow to leave). Not a
    fence: the node was not counted lost, it has nothing left to do. A Fenced, so that
    code that knows only the fence still writes nothing more."""

    def __init__(self, exit_code: int, reason: str) -> None:
        super().__init__(f"the job ended (exit code {exit_code}: {reason})")
        self.exit_code = exit_code
        self.reason = reason


@dataclass(frozen=True)
class EndMark:
    """Where this agent's job says it ended (launcher/etcd_control.py ``close``): a key
    outside the incarnation's prefix, naming the incarnation; with the lease that holds
    the agent's guard, to tell the end of the job from the end of the lease."""

    key: str
    incarnation: str
    lease: int


# One request to one member: a live member answers in milliseconds; waiting longer only
# delays the move to the next one.
REQUEST_TIMEOUT_S = 2.0
# How long a call keeps trying every member before the cluster counts as unreachable: an
# etcd leader election takes about a second (election timeout 1 s by default, up to
# twice that when the first vote splits). The caller waits that long, and the agent's
# loop, which watches its workers, is the caller: at 15 s a worker killed in the first
# seconds of an outage was found 11 s late. Counting etcd out of reach too early costs
# nothing but the events: the job trains on and the next call tries again.
UNREACHABLE_AFTER_S = 5.0
# What etcd answers about a lease it no longer has (expired, or revoked).
LEASE_NOT_FOUND = "requested lease not found"


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """``HOST:PORT[,HOST:PORT...]`` (a scheme is allowed and dropped; port 2379 if none)."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        part = part.split("://", 1)[-1].rstrip("/")
        host, _, port = part.rpartition(":")
        if not host:
            host, port = part, "2379"
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise StoreError(f"--rdzv-endpoint {part!r} is not HOST:PORT")
        out.append((host, int(port)))
    if not out:
        raise StoreError("--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT[,HOST:PORT...]")
    return out


class EtcdStore:
    """One connection (an HTTP session per member) to an etcd cluster."""

    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        *,
        unreachable_after_s: float = UNREACHABLE_AFTER_S,
        guard: str | None = None,
    ):
        try:
            from etcd3gw.client import Etcd3Client
        except ImportError:  # a dependency of the package: only a broken install lacks it
            raise StoreError("--rdzv-backend etcd needs the etcd3gw package") from None
        self.endpoints = list(endpoints)
        self._clients = [
            Etcd3Client(host=h, port=p, timeout=REQUEST_TIMEOUT_S, api_path="/v3/")
            for h, p in endpoints
        ]
        self._current = 0
        self.unreachable_after_s = unreachable_after_s
        # The fence: a key bound to this agent's lease. Every write is a transaction that
        # holds only while it exists, so an agent the job has counted lost (its lease ran
        # out while it was cut off or frozen) cannot write stale state when it comes back.
        self.guard = guard
        self.end_mark: EndMark | None = None
        # Once no member answered, each call tries every member once (not for
        # unreachable_after_s): the caller rides out the outage on its own clock.
        self._unreachable = False

    def clone(self) -> EtcdStore:
        """A connection of its own, for another thread (sessions are not shared)."""
        twin = EtcdStore(
            self.endpoints, unreachable_after_s=self.unreachable_after_s, guard=self.guard
        )
        twin.end_mark = self.end_mark
        return twin

    @property
    def where(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def _call(self, op: Callable[[object], T]) -> T:
        from etcd3gw import exceptions

        patience = 0.0 if self._unreachable else self.unreachable_after_s
        deadline = time.monotonic() + patience
        last = ""
        while True:
            for _ in range(len(self._clients)):
                client = self._clients[self._current]
                try:
                    result = op(client)
                    self._unreachable = False
                    return result
                except (
                    exceptions.ConnectionFailedError,
                    exceptions.ConnectionTimeoutError,
                    exceptions.InternalServerError,  # "etcdserver: no leader" during an election
                ) as exc:
                    last = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                    self._current = (self._current + 1) % len(self._clients)
                except exceptions.Etcd3Exception as exc:  # an answer, but a refusal
                    self._unreachable = False
                    detail = (exc.detail_text or type(exc).__name__).strip()[:200]
                    raise StoreError(f"etcd at {self.where} refused a request: {detail}") from None
            if time.monotonic() >= deadline:
                self._unreachable = True
                raise StoreError(f"no etcd member answers at {self.where} ({last})")
            time.sleep(0.2)

    # -- keys --------------------------------------------------------------------------

    def _get(self, key: str) -> tuple[bytes, int] | None:
        """(value, mod_revision), or None if the key is not set."""
        found = self._call(lambda c: c.get(key, metadata=True))
        if not found:
            return None
        value, meta = found[0]
        return value, int(meta["mod_revision"])

    def set(self, key: str, value: str | bytes, lease: int | None = None) -> None:
        if self.guard is None:
            payload = put_request(key, value, lease)["request_put"]
            self._call(lambda c: c.post(c.get_url("/kv/put"), json=payload))
        elif not self._txn([], [put_request(key, value, lease)]):
            raise self._fenced()

    def get(self, key: str) -> bytes:
        found = self._get(key)
        if found is None:
            raise StoreError(f"key {key!r} is not set")
        return found[0]

    def check(self, keys: list[str]) -> bool:
        return all(self._get(k) is not None for k in keys)

    def delete_key(self, key: str) -> bool:
        done = self._txn_raw([], [{"request_delete_range": {"key": _b64(key)}}])
        if not done.get("succeeded", False):
            raise self._fenced()
        answer = done.get("responses", [{}])[0].get("response_delete_range", {})
        return int(answer.get("deleted", 0)) > 0

    def delete_prefix(self, prefix: str, *, put: tuple[str, str] | None = None) -> None:
        """Delete every key under ``prefix``; ``put``: and set this (key, value), outside
        the prefix, in the same transaction."""
        from etcd3gw.utils import _increment_last_byte

        erase = {"key": _b64(prefix), "range_end": _b64(_increment_last_byte(prefix))}
        also = [] if put is None else [put_request(*put)]
        if not self._txn([], [*also, {"request_delete_range": erase}]):
            raise self._fenced()

    def keys(self, prefix: str) -> list[str]:
        from etcd3gw.utils import _increment_last_byte

        end = _increment_last_byte(prefix)
        found = self._call(lambda c: c.get(prefix, metadata=True, range_end=end, keys_only=True))
        return [meta["key"].decode() for _, meta in found]

    def create(self, key: str, value: str | bytes, lease: int | None = None) -> bool:
        """Set ``key`` only if it is not set; whether this call set it."""
        if self._txn([_absent(key)], [put_request(key, value, lease)]):
            return True
        if self.guard is not None and self._get(self.guard) is None:
            raise self._fenced()
        return False

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer under ``key`` (0 if not set)."""
        while True:
            found = self._get(key)
            if found is None and amount == 0:
                return 0
            if found is not None and amount == 0:
                return int(found[0])
            value = (int(found[0]) if found else 0) + amount
            guard = _absent(key) if found is None else _unchanged(key, found[1])
            if self._txn([guard], [put_request(key, str(value))]):
                return value
            if self.guard is not None and self._get(self.guard) is None:
                raise self._fenced()

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise StoreError(f"timed out waiting for {keys}")
            time.sleep(0.05)

    def _txn(self, compare: list[dict], success: list[dict]) -> bool:
        return bool(self._txn_raw(compare, success).get("succeeded", False))

    def _txn_raw(self, compare: list[dict], success: list[dict]) -> dict:
        """One transaction; with a guard, it also holds only while the guard key exists."""
        if self.guard is not None:
            compare = [*compare, _present(self.guard)]
        txn = {"compare": compare, "success": success, "failure": []}
        return self._call(lambda c: c.transaction(txn))

    def _fenced(self) -> Fenced:
        """Why the guard failed: the job ended (JobEnded), else the lease ran out."""
        ended = self._ended()
        if ended is not None:
            return ended
        return Fenced(
            "this agent's etcd lease ran out (it was cut off or stopped for longer than "
            "--heartbeat-timeout): the job counted this node lost and went on without it"
        )

    def _ended(self) -> JobEnded | None:
        """JobEnded when the end mark names this agent's incarnation and the agent's lease
        still holds (a lease that ran out is a fence, whatever the job did after)."""
        mark = self.end_mark
        if mark is None:
            return None
        try:
            found = self._get(mark.key)
            value = json.loads(found[0]) if found is not None else {}
            if str(value.get("incarnation")) != mark.incarnation or not self.keepalive(mark.lease):
                return None
            return JobEnded(int(value.get("exit_code", 0)), str(value.get("reason", "")))
        except (StoreError, ValueError, TypeError, AttributeError):
            return None

    # -- queues (one reader each) -----------------------------------------------------

    def queue_push(self, key: str, value: str) -> None:
        slot = self.add(f"{key}/tail", 1) - 1
        self.set(f"{key}/{slot}", value)

    def queue_len(self, key: str) -> int:
        return self.add(f"{key}/tail", 0) - self.add(f"{key}/head", 0)

    def queue_pop(self, key: str, block: bool = False) -> bytes:
        head = self.add(f"{key}/head", 0)
        if not block and head >= self.add(f"{key}/tail", 0):
            raise QueueEmpty(f"queue {key!r} is empty")  # (as a TCPStore's, at once)
        deadline = time.monotonic() + 5.0  # the pusher took the slot and writes it next
        while (item := self._get(f"{key}/{head}")) is None:
            if not block and time.monotonic() > deadline:
                raise StoreError(f"queue {key!r} slot {head} was never written")
            time.sleep(0.02)
        self.delete_key(f"{key}/{head}")
        self.add(f"{key}/head", 1)
        return item[0]

    # -- leases --------------------------------------------------------------------------

    def grant(self, ttl_s: int) -> int:
        result = self._call(
            lambda c: c.post(c.get_url("/lease/grant"), json={"TTL": ttl_s, "ID": 0})
        )
        return int(result["ID"])

    def keepalive(self, lease: int) -> bool:
        """Refresh ``lease``; False once it has expired (its keys are gone)."""
        try:
            result = self._call(lambda c: c.post(c.get_url("/lease/keepalive"), json={"ID": lease}))
        except StoreError as exc:
            if LEASE_NOT_FOUND in str(exc):  # (expired and forgotten)
                return False
            raise
        return int(result.get("result", {}).get("TTL", -1)) > 0

    def revoke(self, lease: int) -> None:
        try:
            self._call(lambda c: c.post(c.get_url("/kv/lease/revoke"), json={"ID": lease}))
        except StoreError as exc:
            if LEASE_NOT_FOUND not in str(exc):  # (gone already: nothing to revoke)
                raise


def put_request(key: str, value: str | bytes, lease: int | None = None) -> dict:
    """One put, as the gateway takes it in a transaction (``/kv/put`` takes its inside)."""
    put: dict = {"key": _b64(key), "value": _b64(value)}
    if lease is not None:
        put["lease"] = lease
    return {"request_put": put}


def _b64(value: str | bytes) -> str:
    from etcd3gw.utils import _encode

    return _encode(value)


def _absent(key: str) -> dict:
    return {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}


def _present(key: str) -> dict:
    return {"key": _b64(key), "result": "GREATER", "target": "CREATE", "create_revision": 0}


def _unchanged(key: str, mod_revision: int) -> dict:
    return {"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": mod_revision}
