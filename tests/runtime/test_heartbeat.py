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


def test_a_new_generations_status_has_no_pace_until_its_steps_give_one():
    """The pace means a worker reports are its last generation's until the new one's steps
    replace them: on entering a generation its status says 0 steps of pace (the leader
    judges a worker's speed only on its generation's own steps, launcher/stragglers.py)."""
    status = Status(rank=0)
    status.update(phase="train", generation=0, step=20, pace_steps=8, busy_s_per_mb=0.04)
    status.update(phase="groups", generation=1)
    assert status.get("pace_steps") == 0
    status.update(phase="train", step=21)  # (the same generation: nothing reset)
    status.update(generation=1, step=26, pace_steps=4, busy_s_per_mb=0.01)
    assert status.get("pace_steps") == 4
    status.update(phase="ready", generation=1)
    assert status.get("pace_steps") == 4
