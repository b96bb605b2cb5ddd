"""A worker store's connections across a cut link (chameleon_runtime.protocol.link): with
the launcher's deadline a blocked call fails once the host has answered nothing for the
deadline; without it, the same call is still blocked long after (what the deadline is
for: a store left behind by a new leader would hold its clients for good). And on the
host's side: a client killed while cut off keeps no mailbox from its replacement."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from chameleon_runtime.protocol.messages import STORE_LINK_ENV
from launcher.store import host_store
from tests.launcher.helpers import env

pytestmark = pytest.mark.slow

CLIENT = """
import sys, time
from datetime import timedelta
from chameleon_runtime import storeaddr
store = storeaddr.connect(sys.argv[1], int(sys.argv[2]), timedelta(seconds=300))
store.set("ready", "1")
print("connected", flush=True)
started = time.monotonic()
try:
    store.get("never")  # waits for a key nobody sets
except Exception as exc:
    print(f"failed after {time.monotonic() - started:.1f} s: {type(exc).__name__}", flush=True)
"""


def _blocked_call_across_a_cut(net, deadline: str | None) -> str | None:
    n = net(1)
    server = dist.TCPStore(
        n.hub, 0, is_master=True, timeout=timedelta(seconds=300), wait_for_workers=False
    )
    extra = {STORE_LINK_ENV: deadline} if deadline else {}
    child_env = {k: v for k, v in env().items() if k != STORE_LINK_ENV}
    client = subprocess.Popen(
        n.command(0, [sys.executable, "-c", CLIENT, n.hub, str(server.port)]),
        env={**child_env, **extra}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert client.stdout.readline().strip() == "connected"
        time.sleep(0.5)
        n.cut(0)
        try:
            out, _ = client.communicate(timeout=8)
        except subprocess.TimeoutExpired:
            return None
        return out.strip()
    finally:
        client.kill()
        client.wait()


@pytest.mark.timeout(60)  # 4 s measured
def test_a_call_across_a_cut_fails_at_the_deadline(net):
    said = _blocked_call_across_a_cut(net, "2")
    assert said is not None and said.startswith("failed after"), said
    assert 1.5 <= float(said.split()[2]) <= 4.5, said


@pytest.mark.timeout(60)  # 10 s measured
def test_without_a_deadline_the_same_call_never_returns(net):
    assert _blocked_call_across_a_cut(net, None) is None


WAITER = """
import sys
from datetime import timedelta
from chameleon_runtime import storeaddr
store = storeaddr.connect(sys.argv[1], int(sys.argv[2]), timedelta(days=1))
print("waiting", flush=True)
print(store.queue_pop("mailbox", block=True).decode(), flush=True)
"""


@pytest.mark.timeout(60)  # 9 s measured
def test_a_waiter_killed_while_cut_off_keeps_no_mailbox_from_its_replacement(net):
    # The old worker's kernel drops its socket unseen (the deadline, while cut off); the
    # host must drop its end too, or the push below wakes nobody (torch 2.13's server).
    n = net(1)
    server = host_store(n.hub, 0, timeout_s=300, link_s=2.0)
    child_env = {**env(), STORE_LINK_ENV: "2"}
    argv = [sys.executable, "-c", WAITER, n.hub, str(server.port)]
    old = subprocess.Popen(n.command(0, argv), env=child_env, stdout=subprocess.PIPE, text=True)
    assert old.stdout.readline().strip() == "waiting"
    time.sleep(0.5)
    n.cut(0)
    old.kill()
    old.wait()
    time.sleep(5.0)  # longer than both deadlines
    n.heal(0)
    new = subprocess.Popen(n.command(0, argv), env=child_env, stdout=subprocess.PIPE, text=True)
    try:
        assert new.stdout.readline().strip() == "waiting"
        time.sleep(0.5)
        server.queue_push("mailbox", "abort")
        out, _ = new.communicate(timeout=10)
        assert out.strip() == "abort"
    finally:
        new.kill()
        new.wait()
