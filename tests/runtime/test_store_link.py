"""The deadline on a worker's store connections (chameleon_runtime.protocol.link), against
real TCPStores: set on the connections to the store it is given and on no other, and a
store host that is frozen (its kernel still answers) is never taken for a lost one. A
cut link failing the connection is tested across a real partition
(tests/partitions/test_store_link_cut.py)."""

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from chameleon_runtime import storeaddr
from chameleon_runtime.protocol import link
from chameleon_runtime.protocol.messages import STORE_LINK_ENV


def _deadlines() -> dict[int, int]:
    """Peer port -> TCP_USER_TIMEOUT (ms) of every TCP connection of this process."""
    return {
        peer[1]: sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
        for sock, peer in link.connections()
    }


def test_the_deadline_is_set_on_the_stores_connections_and_no_other(monkeypatch):
    monkeypatch.setenv(STORE_LINK_ENV, "2.5")
    ours = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    other = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    client = storeaddr.connect("127.0.0.1", ours.port, timedelta(seconds=10))
    plain = dist.TCPStore("127.0.0.1", other.port, is_master=False)
    client.set("k", "v")
    plain.set("k", "v")
    deadlines = _deadlines()
    assert deadlines[ours.port] == 2500
    assert deadlines[other.port] == 0
    # A second connection to the same store gets it too (each connect sweeps them all).
    again = storeaddr.connect("127.0.0.1", ours.port, timedelta(seconds=10))
    assert again.get("k") == b"v"
    assert link.bound("127.0.0.1", ours.port, 2.5) >= 2


def test_without_the_launchers_deadline_a_connection_is_left_as_c10d_made_it(monkeypatch):
    monkeypatch.delenv(STORE_LINK_ENV, raising=False)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    storeaddr.connect("127.0.0.1", server.port, timedelta(seconds=10)).set("k", "v")
    assert _deadlines()[server.port] == 0


HOST = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
print(store.port, flush=True)
time.sleep(float(sys.argv[1]))
store.set("late", "here")
time.sleep(30)
"""


@pytest.mark.slow  # real processes, seconds: the full suite runs it, the fast tier does not
@pytest.mark.timeout(60)  # 6 s measured
def test_a_frozen_store_host_is_not_a_lost_one(monkeypatch):
    # Its kernel answers the probes while the process is stopped: a host busy (or
    # stopped) in Python for longer than the deadline keeps its connections.
    monkeypatch.setenv(STORE_LINK_ENV, "1")
    host = subprocess.Popen([sys.executable, "-c", HOST, "5"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        client = storeaddr.connect("127.0.0.1", port, timedelta(seconds=60))
        host.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        time.sleep(3.0)  # three deadlines frozen
        host.send_signal(signal.SIGCONT)
        assert client.get("late") == b"here"  # blocks until the host sets it
        assert time.monotonic() - started >= 3.0
    finally:
        host.kill()
        host.wait()


def test_a_default_socket_timeout_does_not_leave_the_stores_sockets_non_blocking(monkeypatch):
    # Wrapping an fd in a Python socket makes it non-blocking when a script has set a
    # default timeout; c10d's blocking reads would then fail with EAGAIN.
    monkeypatch.setenv(STORE_LINK_ENV, "3")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    before = socket.getdefaulttimeout()
    socket.setdefaulttimeout(5.0)
    try:
        client = storeaddr.connect("127.0.0.1", server.port, timedelta(seconds=10))
    finally:
        socket.setdefaulttimeout(before)
    clients = _client_fds(server.port)
    assert clients and all(os.get_blocking(fd) for fd in clients)
    client.set("k", "v")
    assert client.get("k") == b"v"


def test_a_long_deadline_is_set_whole(monkeypatch):
    # (Linux takes at most 127 keepalive probes: the user timeout is the deadline.)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    assert link.bound("127.0.0.1", server.port, 600.0) >= 1
    assert _deadlines()[server.port] == 600_000
    client.set("k", "v")


def _client_fds(port: int) -> list[int]:
    """This process's connections to the store on ``port`` (not the server's own sockets,
    which libuv keeps non-blocking)."""
    return [sock.fileno() for sock, peer in link.connections() if peer[1] == port]
