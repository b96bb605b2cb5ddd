"""A deadline on a connection to a worker store: when the store's host has acknowledged
nothing for that long, the kernel ends the connection, and the call blocked on it raises.

Why: a TCPStore call across a network partition never returns. Measured in a network
namespace with the link taken down: ``get``, ``check`` and ``add`` (and a watcher's
blocking ``queue_pop``) were still blocked after 15 s with a store timeout of 2 s, as
c10d's timeout bounds waiting for a key, not a peer that went silent. A store that moved
(its leader's node cut off, a new leader serving another: chameleon_runtime.storeaddr)
would leave every connection to the old one blocked for good, in the workers and in the
agents, and the job with them. With the deadline such a call fails like one to a store
whose host was killed, and the code that follows a moved store takes over.

The store's host needs the same deadline on its side. A client killed while cut off
(its node fenced) cannot close its connection: with the deadline its kernel drops the
socket unseen. The store then still counts the dead client's blocking ``queue_pop`` as
waiting, and a push to that mailbox wakes neither it nor the replacement waiting there
(measured, torch 2.13's libuv server: the message stayed queued, the replacement blocked
until its rank was declared hung 60 s later). With the deadline on the host's side, the
host drops the dead connection itself.

How: ``TCP_USER_TIMEOUT`` (Linux), which ends the connection when data sent (a request,
or a keepalive probe) is unacknowledged for the deadline, and keepalive probes, so that
an idle connection (a blocking wait) is probed too: a quarter of the deadline apart, at
least a second. The peer's kernel answers both, so a store host busy in Python (or
stopped) is not taken for a lost one; the exception is a peer whose receive buffer
stays full for the whole deadline (a zero window, Linux 5.11 on), which the store's small
requests and replies never come near. c10d does not expose its client sockets: the
options are set on every socket of this process connected to the store's address, found
in /proc/self/fd, each time the runtime connects to it (chameleon_runtime.storeaddr); a
socket option is harmless on a socket other code opened to the same store, and is what
it needs too. Connections opened later by other code (torch's default group, made after
the runtime's) have none until the runtime connects again. On the host's side the
options are set on the listening socket, which every accepted connection inherits them
from.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

from chameleon_runtime.protocol.messages import STORE_LINK_ENV


def deadline_s() -> float | None:
    """The deadline the launcher set (its --heartbeat-timeout, where a store can move);
    None where it set none (a lost store then ends the worker anyway)."""
    raw = os.environ.get(STORE_LINK_ENV)
    return float(raw) if raw else None


def _peer_addresses(addr: str, port: int) -> set[tuple[str, int]]:
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except OSError:
        return {(addr, port)}
    return {(str(info[4][0]), port) for info in infos} | {(addr, port)}


def _peer(sock: socket.socket) -> tuple[str, int] | None:
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return None
    try:
        host, port = sock.getpeername()[:2]
    except OSError:  # not connected (a listening socket)
        return None
    return str(host).removeprefix("::ffff:"), int(port)  # (c10d connects over IPv6)


def hold(sock: socket.socket, seconds: float) -> None:
    """The deadline on one socket (a listening one passes it to what it accepts). The user
    timeout first: it is the deadline; with it set the probe count does not matter."""
    if not hasattr(socket, "TCP_USER_TIMEOUT"):  # (not Linux: no deadline to be had)
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, round(seconds * 1000)))
    gap = max(1, int(seconds / 4))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, gap)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, gap)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, min(127, max(1, round(seconds / gap))))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def connections() -> Iterator[tuple[socket.socket, tuple[str, int]]]:
    """Every TCP connection of this process, with its peer, borrowed: the socket is
    detached (never closed: the fd stays its owner's) and its blocking mode put back
    when the caller moves on. Wrapping an fd makes it non-blocking where a default
    timeout is set (socket.setdefaulttimeout, as scripts do for downloads)."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            blocking = os.get_blocking(fd)
            sock = socket.socket(fileno=fd)
        except OSError:  # closed meanwhile, or not a socket Python can wrap
            continue
        try:
            peer = _peer(sock)
            if peer is not None:
                yield sock, peer
        finally:
            sock.detach()
            with contextlib.suppress(OSError):  # (closed meanwhile by its owner)
                if os.get_blocking(fd) != blocking:
                    os.set_blocking(fd, blocking)


def bound(addr: str, port: int, seconds: float) -> int:
    """Give every connection of this process to ``addr:port`` a deadline of ``seconds``;
    how many connections it found."""
    peers = _peer_addresses(addr, port)
    count = 0
    for sock, peer in connections():
        if peer in peers:
            with contextlib.suppress(OSError):
                hold(sock, seconds)
                count += 1
    return count
