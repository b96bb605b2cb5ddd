"""The heartbeat thread against a real TCPStore: the status a worker ends with reaches the
store, however soon after the change the thread is stopped."""

import json
from datetime import timedelta

import torch.distributed as dist

from chameleon_runtime.liveness import Heartbeat, Status
from chameleon_runtime.protocol.messages import Keys
from chameleon_runtime.protocol.seal import Seal


def test_the_last_status_is_written_when_the_thread_stops_at_once():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    keys = Keys(0)
    for attempt in range(20):  # the race was lost about one time in ten
        status = Status(rank=attempt)
        beat = Heartbeat("127.0.0.1", server.port, keys, status, 0, Seal(None, ""))
        status.update(phase="spare")
        status.update(phase="done", step=attempt)
        beat.close()  # before the thread had a chance to write "done"
        written = json.loads(server.get(keys.status(attempt)))
        assert (written["phase"], written["step"]) == ("done", attempt)
