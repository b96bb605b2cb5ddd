"""A replica group whose waits end at the generation's abort (chameleon_runtime.abortable),
on two real processes and gloo: DTensor's collectives run on it as on a plain group, and
a member whose mate never joins its ``clip_grad_norm_`` is let go at the abort instead of
waiting out gloo's timeout."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.clock import slack
from tests.launcher.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]


def _member(rank: int, port: int, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from chameleon_runtime.abortable import AbortableGroup, gloo_group
    from chameleon_runtime.liveness import Interrupts

    torch.set_num_threads(1)
    interrupts = Interrupts()

    def make(store, r, size, timeout):  # noqa: ANN001, ANN202 - torch's constructor
        return AbortableGroup(
            gloo_group(store, r, size, timedelta(seconds=120)),
            lambda: interrupts.aborted(0),
            lambda event: interrupts.watch(0, event),
        )

    dist.Backend.register_backend("abortable-test", make, devices=["cpu"])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    group = dist.new_group([0, 1], backend="abortable-test")
    mesh = DeviceMesh.from_group(group, "cpu")
    w = torch.nn.Parameter(distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)]))
    w.grad = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    found: dict = {"norm": torch.nn.utils.clip_grad_norm_([w], 100.0).full_tensor().item()}
    found["full"] = w.full_tensor().sum().item()
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, group=group)
    found["sum"] = t.tolist()
    store.set(f"through{rank}", "1")
    store.wait(["through0", "through1"])
    if rank == 0:  # the mate has left the step: rank 0 alone takes the norm
        threading.Timer(1.0, interrupts._abort, args=(0,)).start()
        started = time.monotonic()
        torch.nn.utils.clip_grad_norm_([w], 100.0)
        found["aborted_after_s"] = time.monotonic() - started
        started = time.monotonic()
        torch.nn.utils.clip_grad_norm_([w], 100.0)  # posted after the abort: not at all
        found["after_abort_s"] = time.monotonic() - started
    Path(f"{out}.{rank}.json").write_text(json.dumps(found))
    # rank 1 stays till rank 0 is through (a mate that exits ends the norm with an
    # error, not at the abort), rank 0 till rank 1 has heard it (rank 0 serves the store)
    if rank == 0:
        store.set("written0", "1")
        store.wait(["bye1"])
    else:
        store.wait(["written0"])
        store.set("bye1", "1")
    os._exit(0)  # (rank 0's norm is still posted on gloo: the process ends with it)


@pytest.mark.slow  # real processes, seconds: the full suite runs it, the fast tier does not
@pytest.mark.timeout(60)  # 3 s measured
def test_dtensor_collectives_run_on_it_and_the_abort_ends_a_wait_a_mate_never_joins(tmp_path):
    out = str(tmp_path / "member")
    mp.start_processes(_member, args=(free_port(), out), nprocs=2, start_method="spawn")
    found = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]
    for f in found:
        assert abs(f["norm"] - 8**0.5) < 1e-6  # the norm over both members' shards
        assert f["full"] == 28.0
        assert f["sum"] == [3.0, 3.0, 3.0]
    assert 0.9 <= found[0]["aborted_after_s"] < slack(5.0)
    assert found[0]["after_abort_s"] < slack(0.5)
