"""Membership: agents meet on a TCPStore hosted by the first agent (torch.distributed's own
store; no home-made transport), per round.

Keys live under ``<run_id>/``; the host writes ``chameleon/run_id`` first and every joining
agent checks it, so an agent of another job on the same endpoint is refused by name.

A round (one attempt of the workers):
- every agent writes ``r<a>/join/<i>`` (its key, node rank hint, workers, host) after
  taking a slot ``i`` from the ``r<a>/joined`` counter;
- the leader (the agent hosting the store) waits for enough agents, gives node ranks
  (static: the ones asked for; c10d: join order), starts this round's worker store and
  publishes ``r<a>/world``; an agent missing from it waits for the next round;
- agents report failures (``r<a>/fail/<i>``) and finished nodes (``r<a>/done/<key>``);
  the leader publishes its decision as ``r<a>/decision``;
- heartbeats: ``hb/<key>`` counts up every second; the leader watches the counts change
  on its own clock (no clock skew between hosts);
- the leader asks an agent to kill a worker it blamed for a stall through the queue
  ``r<a>/kill/<key>``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from launcher.args import RunArgs

from chameleon_runtime.protocol.seal import Seal
from launcher.store import StoreError, connect_store, drain, get_json, host_store, put_json
from launcher.supervisor import Failure

RUN_ID_KEY = "chameleon/run_id"
AUTH_KEY = "chameleon/auth"  # the job token's proof (chameleon_runtime.protocol.seal.Seal.proof)


class RendezvousError(RuntimeError):
    """Membership could not be established; ``str()`` is one line."""


@dataclass(frozen=True)
class NodeInfo:
    key: str
    node_rank: int
    nproc: int
    host: str
    rank_offset: int
    # The machine it runs on (``machine_id``): agents in network namespaces or containers
    # of one machine have hosts of their own but share its cores.
    machine: str = ""


@dataclass(frozen=True)
class World:
    attempt: int
    nodes: tuple[NodeInfo, ...]
    worker_addr: str
    worker_port: int

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)

    def node(self, key: str) -> NodeInfo | None:
        return next((n for n in self.nodes if n.key == key), None)

    def to_json(self) -> dict:
        return {
            "attempt": self.attempt,
            "worker_addr": self.worker_addr,
            "worker_port": self.worker_port,
            "nodes": [n.__dict__ for n in self.nodes],
        }

    @classmethod
    def from_json(cls, data: dict) -> World:
        return cls(
            attempt=data["attempt"],
            nodes=tuple(NodeInfo(**n) for n in data["nodes"]),
            worker_addr=data["worker_addr"],
            worker_port=data["worker_port"],
        )


def control_endpoint(a: RunArgs) -> tuple[str, int, bool | None]:
    """Where the control store is: (host, port, whether this agent hosts it; None: the
    first to bind the endpoint does, as with c10d)."""
    if a.standalone:
        return "127.0.0.1", 0, True
    if a.rdzv_backend == "c10d":
        if not a.rdzv_endpoint:
            raise RendezvousError("--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT")
        host, _, port = a.rdzv_endpoint.rpartition(":")
        if not host:
            host, port = a.rdzv_endpoint, "29400"
        if not port.isdigit():
            raise RendezvousError(f"--rdzv-endpoint must be HOST:PORT, got {a.rdzv_endpoint!r}")
        return host, int(port), None
    if a.rdzv_endpoint:
        host, _, port = a.rdzv_endpoint.rpartition(":")
        return host or a.master_addr, int(port or a.master_port), a.node_rank == 0
    return a.master_addr, a.master_port, a.node_rank == 0


def machine_id() -> str:
    """This machine's boot id: the same in every network namespace and container of one
    running kernel, unlike the host name or address; the host name where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def node_key() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class ControlPlane:
    # The leader hosts the store: it cannot be replaced (launcher/etcd_control.py can).
    elected = False

    def __init__(
        self,
        store: TCPStore,
        run_id: str,
        key: str,
        *,
        is_leader: bool,
        addr: str,
        port: int,
        seal: Seal | None = None,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.key = key
        self.is_leader = is_leader
        self.addr = addr
        self.port = port
        # Signs what this agent writes and opens what it reads (the agent's job token).
        self.seal = seal or Seal(None, run_id)

    @property
    def worker_host(self) -> str:
        """Where the leader serves each round's worker store."""
        return self.addr

    @property
    def endpoint(self) -> str:
        return f"{self.addr}:{self.port}"

    def node_alive(self, key: str) -> bool | None:
        """None: no leases here; the leader judges agents by their beat counts."""
        return None

    def leader(self) -> str | None:
        return None

    def campaign(self) -> bool:
        return self.is_leader

    def clone(self, *, timeout_s: float = 10.0) -> ControlPlane:
        """A connection of its own, for another thread (``timeout_s``: for each call)."""
        store = connect_store(self.addr, self.port, timeout_s=timeout_s)
        return ControlPlane(
            store, self.run_id, self.key, is_leader=False, addr=self.addr, port=self.port,
            seal=self.seal,
        )  # fmt: skip

    def close(self, *, last: bool, exit_code: int = 0, reason: str = "") -> None:
        """Nothing to release: the store ends with its host. (``exit_code``, ``reason``:
        how the job ended, when ``last``: etcd keeps it, launcher/etcd_control.py.)"""

    # -- setup -------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        *,
        run_id: str,
        addr: str,
        port: int,
        want_leader: bool | None,
        timeout_s: float,
        seal: Seal,
    ) -> ControlPlane:
        """Host the store (``want_leader``), join it, or (None) host it if we can bind the
        endpoint and join otherwise (c10d: the first agent on the endpoint's host leads)."""
        key = node_key()
        if want_leader is not False:
            try:
                store = host_store(addr, port, timeout_s=timeout_s)
                store.set(AUTH_KEY, seal.proof())
                put_json(store, RUN_ID_KEY, run_id)
                return cls(
                    store, run_id, key, is_leader=True, addr=addr, port=store.port, seal=seal
                )
            except StoreError:
                if want_leader:
                    raise
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                store = connect_store(addr, port, timeout_s=timeout_s)
                break
            except StoreError:
                if time.monotonic() > deadline:
                    raise RendezvousError(
                        f"no agent hosts {addr}:{port} (waited {timeout_s:g} s)"
                    ) from None
                time.sleep(0.5)
        try:
            store.wait([RUN_ID_KEY], timedelta(seconds=timeout_s))
            found = get_json(store, RUN_ID_KEY)
        except Exception:
            raise RendezvousError(f"{addr}:{port} is not a chameleon control store") from None
        if found != run_id:
            raise RendezvousError(
                f"the job at {addr}:{port} has run id {found!r}, not {run_id!r}: refused"
            )
        why = seal.refusal(store.get(AUTH_KEY) if store.check([AUTH_KEY]) else None)
        if why is not None:
            raise RendezvousError(f"the job at {addr}:{port} {why}: refused")
        return cls(store, run_id, key, is_leader=False, addr=addr, port=port, seal=seal)

    def _k(self, key: str) -> str:
        return f"{self.run_id}/{key}"

    def put(self, key: str, value: Any) -> None:
        self.store.set(self._k(key), self.seal.seal(json.dumps(value, separators=(",", ":"))))

    def get(self, key: str) -> Any | None:
        """The value under ``key``; None if unset, or not signed with the job token."""
        name = self._k(key)
        if not self.store.check([name]):
            return None
        body = self.seal.open(self.store.get(name), name)
        return None if body is None else json.loads(body)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self._k(key), amount)

    # -- rounds --------------------------------------------------------------------------

    def join(self, attempt: int, *, node_rank: int, nproc: int, host: str) -> None:
        slot = self.add(f"r{attempt}/joined", 1) - 1
        self.put(
            f"r{attempt}/join/{slot}",
            {
                "key": self.key,
                "node_rank": node_rank,
                "nproc": nproc,
                "host": host,
                "machine": machine_id(),
            },
        )

    def joined(self, attempt: int) -> list[dict]:
        count = self.add(f"r{attempt}/joined", 0)
        entries = []
        for slot in range(count):
            entry = self.get(f"r{attempt}/join/{slot}")
            if entry is not None:  # the joiner has taken the slot but not written it yet
                entries.append(entry)
        return entries

    def form_world(
        self,
        attempt: int,
        *,
        min_nodes: int,
        max_nodes: int,
        static_ranks: bool,
        worker_addr: str,
        worker_port: int,
        last_call_s: float,
        timeout_s: float,
    ) -> World:
        """Leader: wait for at least ``min_nodes`` agents (then ``last_call_s`` for more, up
        to ``max_nodes``) and publish the round's world."""
        deadline = time.monotonic() + timeout_s
        reached_min_at = None
        while True:
            entries = self.joined(attempt)
            if len(entries) >= max_nodes:
                break
            if len(entries) >= min_nodes:
                reached_min_at = reached_min_at or time.monotonic()
                if time.monotonic() - reached_min_at >= last_call_s:
                    break
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"only {len(entries)} of {min_nodes} node(s) joined within {timeout_s:g} s (round {attempt})"
                )
            time.sleep(0.05)
        # One entry per agent, its last (an agent may join again after a restart).
        entries = list({e["key"]: e for e in entries}.values())[:max_nodes]
        if static_ranks:
            ranks = [e["node_rank"] for e in entries]
            if sorted(ranks) != list(range(len(entries))):
                raise RendezvousError(
                    f"static rendezvous got node ranks {sorted(ranks)}: each of 0..{len(entries) - 1} must join once"
                )
            order = sorted(entries, key=lambda e: e["node_rank"])
        else:  # the leader first, then in join order
            order = sorted(entries, key=lambda e: e["key"] != self.key)
        nodes = []
        offset = 0
        for node_rank, entry in enumerate(order):
            nodes.append(
                NodeInfo(
                    entry["key"],
                    node_rank,
                    entry["nproc"],
                    entry["host"],
                    offset,
                    machine=entry.get("machine", ""),
                )
            )
            offset += entry["nproc"]
        world = World(attempt, tuple(nodes), worker_addr, worker_port)
        self.put(f"r{attempt}/world", world.to_json())
        return world

    def world(self, attempt: int) -> World | None:
        data = self.get(f"r{attempt}/world")
        return None if data is None else World.from_json(data)

    def wait_world(
        self, attempt: int, timeout_s: float, *, stop: Callable[[], bool]
    ) -> World | None:
        """Not the leader: wait for round ``attempt``'s world (None if ``stop`` first)."""
        deadline = time.monotonic() + timeout_s
        while not stop():
            try:
                world = self.world(attempt)
            except Exception:
                raise RendezvousError(
                    "lost the control store (the leader's node is gone)"
                ) from None
            if world is not None:
                return world
            if time.monotonic() > deadline:
                raise RendezvousError(f"round {attempt} did not form within {timeout_s:g} s")
            time.sleep(0.05)
        return None

    # -- reports and decisions ------------------------------------------------------------

    def report_failure(self, failure: Failure) -> None:
        slot = self.add(f"r{failure.attempt}/failures", 1) - 1
        self.put(f"r{failure.attempt}/fail/{slot}", failure.to_json())

    def failures(self, attempt: int) -> list[Failure]:
        out = []
        for slot in range(self.add(f"r{attempt}/failures", 0)):
            data = self.get(f"r{attempt}/fail/{slot}")
            if data is not None:
                out.append(Failure.from_json(data))
        return out

    def report_done(self, attempt: int) -> None:
        self.put(f"r{attempt}/done/{self.key}", True)

    def done(self, attempt: int, keys: list[str]) -> int:
        return sum(1 for k in keys if self.get(f"r{attempt}/done/{k}") is not None)

    def report_preempted(self, attempt: int, signum: int, deadline: float) -> None:
        """This node got a preemption notice: its workers save until ``deadline`` (wall
        clock), then the job stops (the leader's decision; launcher/supervisor.py)."""
        self.put(f"r{attempt}/preempted/{self.key}", {"signal": signum, "deadline": deadline})

    def preemptions(self, attempt: int, keys: list[str]) -> list[dict]:
        return [v for k in keys if (v := self.get(f"r{attempt}/preempted/{k}")) is not None]

    def decide(self, attempt: int, decision: dict) -> None:
        self.put(f"r{attempt}/decision", decision)

    def decision(self, attempt: int) -> dict | None:
        return self.get(f"r{attempt}/decision")

    def acknowledge(self, attempt: int) -> None:
        self.put(f"r{attempt}/ack/{self.key}", True)

    def wait_acknowledged(self, attempt: int, keys: list[str], timeout_s: float) -> None:
        """Leader: keep the store up until the other agents have read a final decision."""
        deadline = time.monotonic() + timeout_s
        pending = [k for k in keys if k != self.key]
        while pending and time.monotonic() < deadline:
            pending = [k for k in pending if self.get(f"r{attempt}/ack/{k}") is None]
            if pending:
                time.sleep(0.05)

    def request_kill(self, attempt: int, key: str, rank: int, reason: str, silent_s: float) -> None:
        """Leader: ask the agent ``key`` to kill ``rank`` as hung (a stall it was blamed
        for, launcher/watch.py), silent for ``silent_s``."""
        message = self.seal.seal(json.dumps([rank, reason, silent_s]))
        self.store.queue_push(self._k(f"r{attempt}/kill/{key}"), message)

    def kill_requests(self, attempt: int) -> list[tuple[int, str, float]]:
        name = self._k(f"r{attempt}/kill/{self.key}")
        out = []
        for raw in drain(self.store, name):
            body = self.seal.open(raw, name)
            if body is None:
                continue
            rank, reason, silent_s = json.loads(body)
            out.append((int(rank), str(reason), float(silent_s)))
        return out

    def beat(self) -> None:
        self.add(f"hb/{self.key}", 1)

    def beats(self, key: str) -> int:
        return self.add(f"hb/{key}", 0)


def beat_until(
    control: ControlPlane,
    stop: threading.Event,
    period_s: float,
    on_beat: Callable[[float], None],
    on_fenced: Callable[[str], None],
) -> None:
    """An agent's heartbeat thread: count up ``hb/<key>`` (or refresh the etcd lease)
    every ``period_s`` until ``stop``, on a connection of its own (the main thread's is not
    shared across threads). ``on_beat(sent)``: a beat sent at ``sent`` (monotonic) went
    through. On etcd a lease found expired is told to ``on_fenced``; through an outage of
    etcd this keeps trying (its next leader renews every lease). On the TCPStore a call
    across a partition may never return (some have no timeout): the lease is watched on
    this node's clock instead (launcher/outage.py, ControlLink.watch_lease)."""
    from launcher.etcd import Fenced

    try:
        beat = control.clone()
    except Exception:
        return
    while not stop.wait(period_s):
        sent = time.monotonic()
        try:
            beat.beat()
        except Fenced as exc:
            on_fenced(str(exc))
            return
        except Exception:
            if not control.elected:  # a fresh connection for the next beat (the lease
                with contextlib.suppress(Exception):  # watch judges a long silence)
                    beat = control.clone()
            continue  # etcd's outage or this node's cut: the lease decides
        on_beat(sent)
