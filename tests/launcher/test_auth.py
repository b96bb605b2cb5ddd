"""The job token: a foreign client that reaches a running job's worker store and writes a
forged exit, abort and plan changes nothing (chameleon_runtime.protocol.seal.Seal)."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest

from chameleon_runtime.protocol.messages import Abort, Exit, Keys
from tests import references
from tests.clock import budget
from tests.launcher.helpers import events, start, wait_for_event
from tests.runtime.test_liveness import MLP
from tests.runtime.test_recovery import dumps

pytestmark = pytest.mark.slow
STEPS = 50


@pytest.mark.timeout(60)  # 13 s measured
def test_forged_exit_abort_and_plan_change_nothing(tmp_path):
    import torch.distributed as dist

    reference = references.mlp(workers=3, steps=STEPS)
    log = tmp_path / "events.jsonl"
    job = start(
        "run", "--standalone", "--nproc-per-node", "3", "--events", str(log), MLP,
        "--steps", str(STEPS), "--stages", "1", "--dump", str(tmp_path / "dump"),
        cwd=tmp_path, log=tmp_path / "job.log", env={"MLP_STEP_SLEEP_S": "0.1"},
    )  # fmt: skip
    try:
        host, port = wait_for_event(log, "round_started")["worker_store"].rsplit(":", 1)
        pids = wait_for_event(log, "workers_started")["pids"]
        deadline = time.monotonic() + budget(90)
        while not any(e["event"] == "step" and e["step"] >= 10 for e in events(log)):
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.05)
        foreign = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
        keys = Keys(0)
        # A plan that drops rank 2: the real one, read off the store, re-numbered, unsigned.
        real = foreign.get(keys.plan(0)).decode()
        plan = json.loads(real.split(":", 2)[2] if real.startswith("hmac:") else real)
        plan["generation"] = 1
        plan["plan"]["stages"] = [s for s in plan["plan"]["stages"] if s["worker"] != 2]
        foreign.set(keys.plan(1), json.dumps(plan))
        foreign.set(keys.latest, "1")
        foreign.set(keys.next(0), "1")
        foreign.set(keys.abort(0), Abort(generation=0, reason="forged").model_dump_json())
        for rank, pid in enumerate(pids):
            foreign.queue_push(
                keys.mailbox(rank), Abort(generation=0, reason="forged").model_dump_json()
            )
            foreign.queue_push(keys.mailbox(rank), Exit(code=7, pid=pid).model_dump_json())
        forged_at = time.time()
        assert job.wait(timeout=budget(120)) == 0, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    evs = events(log)
    assert not [e for e in evs if e["event"] in ("failure", "abort", "recovered", "restart")]
    assert [e for e in evs if e["event"] == "step" and e["t"] > forged_at]  # trained on
    checks, _ = dumps(tmp_path)
    for layer, values in reference.items():
        assert checks[layer] and all(abs(v - values[0]) < 1e-6 for v in checks[layer]), layer
    said = (tmp_path / "job.log").read_text()
    assert "ignored a control message not signed with this job's token" in said
