"""Where this attempt's worker store is now. It starts at MASTER_ADDR:MASTER_PORT, hosted
by the leader agent. On etcd (``--rdzv-backend etcd``) the leader is elected, and when
its node is lost the new leader serves a new store: every agent then writes the new
address, with a higher epoch, to its node's store file (CHAMELEON_STORE_FILE, replaced
atomically), and each of a worker's connections (its main thread's, its heartbeat's, its
mailbox watcher's) moves there when the old store stops answering. Without the file (one
node, or the TCPStore backends) a lost store ends the worker, as before."""

from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta

import torch.distributed as dist
from pydantic import ValidationError

from chameleon_runtime.protocol import link
from chameleon_runtime.protocol.messages import STORE_FILE_ENV, STORE_WAIT_ENV, StoreAddress


def read() -> StoreAddress | None:
    path = os.environ.get(STORE_FILE_ENV)
    if not path:
        return None
    try:
        with open(path) as f:
            return StoreAddress.model_validate_json(f.read())
    except (OSError, ValidationError):
        return None


def newer_than(epoch: int) -> StoreAddress | None:
    """The store that replaced epoch ``epoch``'s, once the agent has written it; None
    when none is coming (no store file) or none came in time."""
    if not os.environ.get(STORE_FILE_ENV):
        return None
    deadline = time.monotonic() + float(os.environ.get(STORE_WAIT_ENV, "60"))
    while time.monotonic() < deadline:
        found = read()
        if found is not None and found.epoch > epoch:
            return found
        time.sleep(0.05)
    return None


def connect(addr: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A client of the worker store at ``addr:port``, its connection given the launcher's
    deadline where it set one (chameleon_runtime.protocol.link): a store left behind
    across a partition then fails like one whose host was killed, instead of never."""
    store = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
    seconds = link.deadline_s()
    if seconds is not None:
        with contextlib.suppress(OSError):
            link.bound(addr, port, seconds)
    return store
