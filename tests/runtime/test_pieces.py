"""The runtime's parts without processes: data indexing, layer state round trips,
checkpoints, the step ledger, and the launcher's recovery coordinator on a fake store."""

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from chameleon_runtime import checkpoint
from chameleon_runtime.data import Batches
from chameleon_runtime.pace import Pace
from chameleon_runtime.shard import Shard
from chameleon_runtime.step import Ledger, MyPart
from launcher.inplace import Coordinator, Phase, _fit_wait, _waiting
from launcher.rejoin import Rejoins, worth_growing
from planner.config import load_job
from planner.plan import pipelines_plan
from planner.wire import JobDescription, PlanMessage

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def factory(i: int) -> nn.Module:
    return nn.Linear(4, 4)


def adam(params):
    return torch.optim.Adam(params, lr=0.1)


def test_micro_batches_cover_the_global_batch_by_sample_index():
    data = [(torch.tensor([i]), torch.tensor([i])) for i in range(10)]
    b = Batches(data, global_batch_size=4, micro_batch_size=2)
    assert b.num_micro_batches == 2
    assert b.indices(0, 1) == [2, 3]
    assert b.indices(2, 1) == [0, 1]  # wraps around the dataset
    assert b.inputs(1, 0).tolist() == [[4], [5]]


def test_layers_are_built_identically_wherever_they_are_built():
    a, b = Shard(factory, adam, seed=3), Shard(factory, adam, seed=3)
    a.ensure(0, 2)
    b.ensure(1, 3)
    assert torch.equal(a.layers[1].weight, b.layers[1].weight)
    assert not torch.equal(a.layers[0].weight, a.layers[1].weight)


def test_layer_state_round_trips_through_header_and_tensors():
    src = Shard(factory, adam, seed=0)
    src.ensure(0, 1)
    src.layers[0](torch.randn(2, 4)).sum().backward()
    src.step()
    header, tensors = src.export_layer(0)
    json.dumps(header)  # travels through the store as JSON
    received = [t.clone() for t in tensors]
    dst = Shard(factory, adam, seed=99)
    dst.import_layer(header, received)
    assert torch.equal(dst.layers[0].weight, src.layers[0].weight)
    a, b = src.optimizers[0].state_dict()["state"], dst.optimizers[0].state_dict()["state"]
    assert torch.equal(a[0]["exp_avg"], b[0]["exp_avg"]) and torch.equal(a[0]["step"], b[0]["step"])
    shapes = [t.shape for t in Shard.empty_tensors(header)]
    assert shapes == [t.shape for t in tensors]


def test_checkpoints_are_complete_or_absent(tmp_path):
    shard = Shard(factory, adam, seed=0)
    shard.ensure(0, 2)
    checkpoint.save_layers(tmp_path, 5, shard, [0, 1])
    assert checkpoint.latest(tmp_path) is None  # files written, step not published yet
    checkpoint.publish(tmp_path, 5, 2)
    assert checkpoint.latest(tmp_path) == 5
    other = Shard(factory, adam, seed=1)
    other.ensure(0, 2)
    checkpoint.load_layers(tmp_path, 5, other, [0, 1])
    assert torch.equal(other.layers[1].bias, shard.layers[1].bias)
    for step in (8, 11):
        checkpoint.save_layers(tmp_path, step, shard, [0, 1])
        checkpoint.publish(tmp_path, step, 2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000008", "step_000011"]
    assert not list(tmp_path.glob("**/*.tmp*"))


def _plan():
    return pipelines_plan(
        num_layers=4,
        num_micro_batches=4,
        pipelines=[[0, 1], [2, 3]],
        boundaries=[[0, 2, 4]] * 2,
        micro_batch_counts=[2, 2],
    )


def test_the_ledger_lists_every_message_of_a_step_both_ways():
    plan = _plan()
    shard = Shard(factory, adam, seed=0)
    shard.ensure(2, 4)
    part = MyPart.of(plan, 1, [20, 20, 20, 20])
    shapes = [(torch.Size([2, 4]), torch.float32)] * 4
    ledger = Ledger(part, shapes, shard)
    # Worker 1 (stage 1 of pipeline 0) receives 2 activations, sends 2 gradients, and
    # swaps its bucket's gradients with worker 3 (the other holder of layers 2-3).
    assert sorted(ledger.owed) == [(0, 0), (0, 2), (3, 1_000_000 + part.buckets[0].index)]
    assert sorted(ledger.owes) == [(0, 1), (0, 3), (3, 1_000_000 + part.buckets[0].index)]


class FakeStore:
    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


def _put(store, key, value):
    store.set("chameleon/0/" + key, json.dumps(value))


@pytest.fixture
def coordinator():
    store = FakeStore()
    emitted = []
    c = Coordinator(
        store=store,
        world_size=4,
        emit=lambda name, **kw: emitted.append((name, kw)),
        policy="reroute",
    )
    plan = _plan()
    _put(
        store,
        "plan/0",
        PlanMessage.build(generation=0, policy="initial", resume_step=0, plan=plan).model_dump(),
    )
    _put(store, "gen", 0)
    job = {
        "model": "m", "global_batch_size": 4, "micro_batch_size": 1, "param_bytes": 4, "grad_bytes": 4,
        "optimizer_bytes": 8, "dp": 2, "pp": 2, "memory_limit_bytes": 10**12, "link_bandwidth_bytes_per_s": 1e9,
        "link_latency_s": 1e-5, "checkpoint_interval_steps": 5,
        "layers": [{"name": f"l{i}", "num_params": 100, "forward_s": 0.01, "backward_s": 0.02, "optimizer_s": 0.0,
                    "activation_bytes": 64, "stash_bytes": 64} for i in range(4)],
    }  # fmt: skip
    _put(store, "job", job)
    for r in range(4):
        _put(
            store,
            f"hb/{r}",
            {"count": 1, "step": 2, "gen": 0, "t": 0, "step_s": 0.1, "state": "training"},
        )
    return c, store, emitted


def test_coordinator_aborts_collects_plans_and_confirms(coordinator):
    c, store, emitted = coordinator
    c.on_failures({3})
    assert c.phase is Phase.COLLECT and store.check(["chameleon/0/abort/0"])
    assert not c.tick().restart and c.phase is Phase.COLLECT  # survivors not ready yet
    for r in (0, 1, 2):
        _put(store, f"ready/1/{r}", {"step": 3, "held": []})
    assert not c.tick().restart
    assert c.phase is Phase.CONFIRM
    message = json.loads(store.get("chameleon/0/plan/1"))
    assert message["policy"] == "reroute" and message["resume_step"] == 3
    assert 3 not in [s["worker"] for s in message["plan"]["stages"]]
    for r in (0, 1, 2):
        _put(
            store,
            f"hb/{r}",
            {"count": 2, "step": 3, "gen": 1, "t": 0, "step_s": 0.1, "state": "applied"},
        )
    c.tick()
    assert c.phase is Phase.RUNNING
    assert [
        name for name, _ in emitted if name in ("abort", "decision", "plan_chosen", "recovered")
    ] == ["abort", "decision", "plan_chosen", "recovered"]


def test_a_failure_before_the_plan_is_applied_abandons_it(coordinator):
    c, store, emitted = coordinator
    c.on_failures({3})
    for r in (0, 1, 2):
        _put(store, f"ready/1/{r}", {"step": 3, "held": []})
    c.tick()
    assert c.phase is Phase.CONFIRM
    c.on_failures({2})  # worker 2 dies while applying generation 1
    assert store.check(["chameleon/0/abort/1"]) and c.phase is Phase.COLLECT and c.generation == 0
    for r in (0, 1):
        _put(store, f"ready/1/{r}", {"step": 3, "held": []})
    outcome = c.tick()
    # Workers 2 and 3 are gone: pipeline 0 (workers 0, 1) still holds every layer.
    assert not outcome.restart
    assert json.loads(store.get("chameleon/0/plan/1"))["plan"]["stages"][-1]["worker"] == 1


def test_survivors_that_disagree_on_the_step_force_a_restart(coordinator):
    c, store, _ = coordinator
    c.on_failures({3})
    _put(store, "ready/1/0", {"step": 3, "held": []})
    _put(store, "ready/1/1", {"step": 4, "held": []})
    _put(store, "ready/1/2", {"step": 3, "held": []})
    outcome = c.tick()
    assert outcome.restart and "disagree" in outcome.reason


def test_a_configured_cluster_reaches_the_planner(coordinator):
    """``chameleon run --config``: the config's device memory, links and restart cost
    replace the workers' defaults; the launch's topology stays."""
    c, store, emitted = coordinator
    cluster = load_job(CONFIGS / "cpu_testbed.toml").cluster
    description = JobDescription.model_validate(json.loads(store.get("chameleon/0/job")))
    job = description.to_job(
        num_nodes=1, workers_per_node=4, mtbf_s=60, step_s=0.1, restart_s=5, cluster=cluster
    )
    assert job.cluster.device_memory_bytes == cluster.device_memory_bytes == 2 * 2**30
    assert job.cluster.intra_node == cluster.intra_node and job.cluster.restart_s == 8
    assert (job.cluster.num_nodes, job.cluster.devices_per_node) == (1, 4)
    assert job.cluster.allreduce == "exchange"  # what the runtime executes

    # A device too small for any layout: no in-place policy fits, the job restarts.
    c.policy, c.mtbf_s = "auto", 900.0
    c.cluster = replace(cluster, device_memory_bytes=1000)
    c.on_failures({3})
    for r in (0, 1, 2):
        _put(store, f"ready/1/{r}", {"step": 3, "held": []})
    assert c.tick().restart
    chosen = [kw for name, kw in emitted if name == "plan_chosen"][-1]
    assert chosen["policy"] == "restart"
    assert chosen["memory_limit_bytes"] == 1000 and chosen["mtbf_s"] == 900.0
    assert not any(x["feasible"] for x in chosen["candidates"].values())


def test_a_clearly_faster_layout_is_pointed_out(coordinator):
    # 4 light layers on 2 pipelines of 2 stages: pure data parallelism has no bubble.
    c, _store, emitted = coordinator
    c.calibrate_now()
    (hint,) = [kw for name, kw in emitted if name == "layout_hint"]
    assert hint["best_step_s"] * 1.1 < hint["launched_step_s"]
    assert sorted(len(p) for p in hint["pipelines"]) == [1, 1, 1, 1]


def test_replacements_are_asked_for_within_budget_and_only_where_a_node_lives():
    asked: dict = {}
    rejoins = Rejoins(max_per_rank=2)
    assert rejoins.request({1, 2}, gone={2}, put=asked.__setitem__) == [1]
    assert asked == {"respawn/1": 1}
    assert rejoins.announced({"join/1": {"count": 0}}.get) == []  # a stale announcement
    assert rejoins.announced({"join/1": {"count": 1}}.get) == [1]
    rejoins.forget([1])
    assert rejoins.request({1}, gone=set(), put=asked.__setitem__) == [1]
    assert rejoins.request({1}, gone=set(), put=asked.__setitem__) == []  # budget spent
    assert asked["respawn/1"] == 2


def test_growing_must_pay_for_its_transition_before_the_next_failure():
    assert worth_growing(current_s=1.0, grown_s=0.75, transition_s=1.0, mtbf_s=3600)
    assert not worth_growing(current_s=1.0, grown_s=0.995, transition_s=1.0, mtbf_s=3600)
    assert not worth_growing(current_s=1.0, grown_s=0.75, transition_s=30, mtbf_s=60)


def test_a_spare_reports_no_step_and_its_death_aborts_nothing(coordinator):
    c, store, emitted = coordinator
    c.on_failures({3})
    for r in (0, 1):
        _put(store, f"ready/1/{r}", {"step": 3, "held": [0, 1]})
    _put(store, "ready/1/2", {"step": None, "held": []})  # a spare: its step is stale
    assert not c.tick().restart and c.phase is Phase.CONFIRM
    message = json.loads(store.get("chameleon/0/plan/1"))
    assert message["resume_step"] == 3
    for r in {s["worker"] for s in message["plan"]["stages"]}:
        _put(store, f"hb/{r}", {"count": 3, "step": 3, "gen": 1, "t": 0, "state": "applied"})
    c.tick()
    assert c.phase is Phase.RUNNING


def test_losing_a_worker_outside_the_plan_aborts_nothing(coordinator):
    c, store, emitted = coordinator
    # Generation 0 uses workers 0-2 only (3 was left out by an earlier re-partition).
    three = pipelines_plan(
        num_layers=4, num_micro_batches=4, pipelines=[[0, 1], [2]],
        boundaries=[[0, 2, 4], [0, 4]], micro_batch_counts=[2, 2],
    )  # fmt: skip
    message = PlanMessage.build(generation=0, policy="reparallelize", resume_step=0, plan=three)
    _put(store, "plan/0", message.model_dump())
    c.on_failures({3})
    assert c.phase is Phase.RUNNING and not store.check(["chameleon/0/abort/0"])
    assert ("spare_lost", {"attempt": 0, "ranks": [3]}) in emitted
    c.on_failures({2})  # a worker of the plan: a recovery
    assert c.phase is Phase.COLLECT and store.check(["chameleon/0/abort/0"])


def test_pace_leaves_out_warm_up_and_starts_again_with_each_generation():
    pace = Pace()
    for s in (1.0, 1.0, 0.1, 0.3):  # the first two are warm-up
        pace.add(0, s, 2 * s, s / 2)
    assert pace.means() == pytest.approx(
        {"mean_step_s": 0.2, "mean_cpu_s": 0.4, "mean_compute_cpu_s": 0.1}
    )
    pace.add(1, 5.0, 5.0, 1.0)
    assert pace.means() == {}


def test_the_message_wait_fitted_makes_the_running_plan_take_its_measured_step():
    from planner.estimate import estimate
    from tests.synthetic import uniform_job

    job = uniform_job(dp=1, pp=4, num_layers=4, micro_batches=8)
    deep = pipelines_plan(
        num_layers=4, num_micro_batches=8, pipelines=[[0, 1, 2, 3]],
        boundaries=[[0, 1, 2, 3, 4]], micro_batch_counts=[8],
    )  # fmt: skip
    free = estimate(job, deep).step_s
    wait = _fit_wait(job, deep, free * 1.5)
    assert wait is not None and wait > 0
    assert estimate(_waiting(job, wait), deep).step_s == pytest.approx(free * 1.5, rel=1e-3)
    assert _fit_wait(job, deep, free * 0.9) is None  # already slower than measured
    alone = pipelines_plan(
        num_layers=4, num_micro_batches=8, pipelines=[[0]], boundaries=[[0, 4]],
        micro_batch_counts=[8],
    )  # fmt: skip
    assert _fit_wait(job, alone, estimate(job, alone).step_s * 1.5) is None  # no messages


def test_a_commit_every_member_reached_wins_over_an_abort():
    # The last member's add is the commit point; it sets "done" just after. A member
    # that sees an abort in between must still apply the step, like the last one.
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from chameleon_runtime.comm import Aborted
    from chameleon_runtime.control import Control
    from tests.launcher.helpers import free_port

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    control = Control("127.0.0.1", port, 0)
    try:
        control.abort.set()
        with pytest.raises(Aborted):  # the other member had not arrived
            control.commit(0, 7, 2)
        # ...and when it arrives now, it must not take itself for the last and apply
        assert master.add("chameleon/0/commit/0/7", 1) != 2
        control.abort.clear()
        outcome = []

        def first_to_arrive():
            try:
                control.commit(0, 8, 2)
                outcome.append("applied")
            except Aborted:
                outcome.append("dropped")

        waiter = threading.Thread(target=first_to_arrive)
        waiter.start()
        while master.add("chameleon/0/commit/0/8", 0) < 1:
            time.sleep(0.001)
        master.add("chameleon/0/commit/0/8", 1)  # the other member arrives last...
        control.abort.set()  # ...and an abort comes before its "done"
        waiter.join(timeout=10)
        assert outcome == ["applied"]
    finally:
        control.close()
