"""The control plane: torch.distributed TCPStores, listening where we say, carrying JSON.

TCPStore's server binds every interface whatever host name it is given; we bind the
listening socket ourselves (loopback unless told to use another address) and hand it over
with ``master_listen_fd``. Values are JSON text: nothing from the network is unpickled.

Every restart attempt gets a fresh worker store on a new port. torch 2.13's env://
rendezvous no longer prefixes its keys per attempt ("we create a new TCPStore for every
retry"), but torchrun's agent keeps one store for the whole job, so restarted gloo workers
read the dead attempt's addresses and fail with "connection refused" in connectFullMesh,
or wait on stale barrier counts. A new store per attempt removes the stale keys.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from chameleon_runtime.protocol import link

if TYPE_CHECKING:  # imported when a store is made: torch takes seconds to import
    from torch.distributed import TCPStore


class StoreError(RuntimeError):
    """The store could not be hosted or reached; ``str()`` is one line."""


class QueueEmpty(StoreError):
    """A queue popped without blocking had nothing in it (launcher/etcd.py's queues; a
    TCPStore raises torch's QueueEmptyError)."""


def drain(store: Any, key: str) -> list[bytes]:
    """Everything queued at ``key`` now, in order, on a TCPStore or an EtcdStore. Popped
    until empty rather than counted first: TCPStore's ``queue_len`` holds the GIL while it
    waits for its answer, with no timeout, and across a partition the answer never comes;
    every other thread of the process stopped with it, the lease watch that was to fence
    the node among them (CI: a cut-off agent ran on for 60 s; measured on torch 2.13, and
    a non-blocking ``queue_pop`` releases the GIL and times out)."""
    from torch.distributed import QueueEmptyError

    items = []
    while True:
        try:
            items.append(store.queue_pop(key, block=False))
        except (QueueEmptyError, QueueEmpty):
            return items
        except Exception:
            if items:  # popped, so not to be lost: the error shows at the next look
                return items
            raise


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def bind_listener(addr: str, port: int) -> socket.socket:
    """A listening socket on ``addr:port`` only (port 0 picks a free one). Plain Python:
    the launcher can bind, hand the port to its workers and only then import torch."""
    bind_to = "127.0.0.1" if is_loopback(addr) else addr
    family = socket.AF_INET6 if ":" in bind_to else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bind_to, port))
        # (in the try: with SO_REUSEADDR two agents can both bind a port nobody listens
        # on yet, and the second learns it lost only here: c10d agents started at once)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if port:
            raise StoreError(
                f"cannot listen on {bind_to}:{port} ({exc.strerror}): is another job using "
                "this port? choose another --master-port / --rdzv-endpoint"
            ) from None
        raise StoreError(f"cannot listen on {bind_to}: {exc.strerror}") from None
    return sock


def serve_store(sock: socket.socket, *, timeout_s: float = 60.0) -> TCPStore:
    """Serve a TCPStore on an already-listening socket (clients that connected before
    this wait in the listen backlog)."""
    from torch.distributed import TCPStore

    host, port = sock.getsockname()[:2]
    try:
        store = TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=sock.fileno(),
            use_libuv=True,
        )
    except Exception as exc:  # torch raises RuntimeError subclasses with long texts
        sock.close()
        raise StoreError(
            f"cannot start a TCPStore on {host}:{port}: {exc}".splitlines()[0]
        ) from None
    sock.detach()  # the store's server owns the descriptor now
    return store


def host_store(
    addr: str, port: int, *, timeout_s: float = 60.0, link_s: float | None = None
) -> TCPStore:
    """Serve a TCPStore on ``addr:port`` only (port 0 picks a free one). ``link_s``: drop a
    client's connection once its host has answered nothing for that long
    (chameleon_runtime.protocol.link)."""
    sock = bind_listener(addr, port)
    if link_s is not None:
        try:
            link.hold(sock, link_s)
        except OSError as exc:
            sock.close()
            raise StoreError(
                f"cannot set a {link_s:g} s deadline on the store's connections: {exc.strerror}"
            ) from None
    return serve_store(sock, timeout_s=timeout_s)


def connect_store(
    addr: str, port: int, *, timeout_s: float = 60.0, link_s: float | None = None
) -> TCPStore:
    """A client of the store at ``addr:port``. ``link_s``: its connection fails once the
    host has answered nothing for that long (chameleon_runtime.protocol.link)."""
    from torch.distributed import TCPStore

    try:
        store = TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        raise StoreError(
            f"cannot reach the store at {addr}:{port}: {str(exc).splitlines()[0]}"
        ) from None
    if link_s is not None:
        with contextlib.suppress(OSError):
            link.bound(addr, port, link_s)
    return store


def put_json(store: TCPStore, key: str, value: Any) -> None:
    store.set(key, json.dumps(value, separators=(",", ":")))


def get_json(store: TCPStore, key: str) -> Any | None:
    """The JSON value under ``key``, or None if it is not set (never blocks)."""
    if not store.check([key]):
        return None
    return json.loads(store.get(key).decode())
