"""The coordinator (launcher/coordinator.py) on a real TCPStore, with the workers played by
the test through the protocol (chameleon_runtime.protocol.messages): aborts reach the mailboxes, reports
come through the inbox, the planner answers off the coordinator's thread, keys of old
generations are deleted, the deadline kills a silent survivor, a stall is blamed."""

import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from chameleon_runtime.protocol.messages import (
    MAILBOX,
    Abort,
    Applied,
    Keys,
    Ready,
    WaitingOn,
    WorkerStatus,
    encode,
)
from chameleon_runtime.protocol.wire import JobDescription, PlanMessage
from launcher.calibration import JobModel
from launcher.coordinator import Coordinator
from launcher.rejoin import Rejoins
from launcher.supervisor import Failure, FailureKind
from launcher.watch import Timeouts as WatchTimeouts
from planner.choice.selection import worth_growing
from planner.config import load_job
from planner.estimator.fit import fit_wait, waiting
from planner.job.failures import FailureRate
from planner.plans.plan import pipelines_plan
from tests.launcher.helpers import free_port

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
KEYS = Keys(0)
LAYERS = {0: [0, 1], 1: [2, 3], 2: [0, 1], 3: [2, 3]}
DESCRIPTION = JobDescription.model_validate(
    {
        "model": "m", "global_batch_size": 4, "micro_batch_size": 1, "param_bytes": 4,
        "grad_bytes": 4, "optimizer_bytes": 8, "dp": 2, "pp": 2, "memory_limit_bytes": 10**12,
        "link_bandwidth_bytes_per_s": 1e9, "link_latency_s": 1e-5, "checkpoint_interval_steps": 5,
        "layers": [{"name": f"l{i}", "num_params": 100, "forward_s": 0.01, "backward_s": 0.02,
                    "optimizer_s": 0.0, "activation_bytes": 64, "stash_bytes": 64} for i in range(4)],
    }
)  # fmt: skip


def two_by_two():
    return pipelines_plan(
        num_layers=4, num_micro_batches=4, pipelines=[[0, 1], [2, 3]],
        boundaries=[[0, 2, 4]] * 2, micro_batch_counts=[2, 2],
    )  # fmt: skip


def status(rank, *, step=3, waiting_on=None, progress=3):
    return WorkerStatus(
        pid=1000 + rank, beat=1, phase="train", generation=0, step=step, progress=progress,
        step_s=0.1, slowest_step_s=0.1, waiting_on=waiting_on,
    )  # fmt: skip


@pytest.fixture
def store():
    s = TCPStore(
        "127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=10),
    )  # fmt: skip
    first = PlanMessage.build(generation=0, policy="initial", resume_step=0, plan=two_by_two())
    s.set(KEYS.plan(0), first.model_dump_json())
    s.set(KEYS.latest, "0")
    s.set(KEYS.job, DESCRIPTION.model_dump_json())
    for r in range(4):
        s.set(KEYS.status(r), status(r).model_dump_json())
    return s


def make(store, *, policy="reroute", cluster=None, watch=None):
    emitted, killed = [], []
    model = JobModel(
        emit=lambda name, **kw: emitted.append((name, kw)), rate=FailureRate(3600.0, fixed_s=3600.0), num_nodes=1,
        workers_per_node=4, cluster=cluster,
    )  # fmt: skip
    c = Coordinator(
        store=store, attempt=0, world_size=4,
        emit=lambda name, **kw: emitted.append((name, kw)),
        kill=lambda ranks, why, silent_s: killed.append((ranks, why)), model=model,
        policy=policy,
        watch=watch,
    )  # fmt: skip
    return c, emitted, killed


def failure(rank):
    now = time.time()
    return Failure(rank, 0, FailureKind.SIGNAL, 0, now, now, exit_code=-9)


def ready(store, rank, *, after=0, step=3):
    message = Ready(
        rank=rank, pid=1000 + rank, after=after, applied=0, step=step, held=LAYERS[rank]
    )
    store.queue_push(KEYS.inbox, encode(message))


def tick_until(c, predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        outcome = c.tick()
        if outcome.restart:
            return outcome
        time.sleep(0.005)
    return None


def named(emitted, name):
    return [kw for n, kw in emitted if n == name]


def test_an_abort_reaches_every_mailbox_and_a_confirmed_plan_retires_the_old_keys(store):
    c, emitted, _ = make(store)
    c.tick()
    c.on_failures([failure(3)])
    for r in (0, 1, 2):  # each survivor's watcher pops it at once
        message = MAILBOX.validate_json(store.queue_pop(KEYS.mailbox(r), block=False))
        assert isinstance(message, Abort) and message.generation == 0
    assert store.check([KEYS.abort(0)]) and c.recovering
    for r in (0, 1, 2):
        ready(store, r)
    assert tick_until(c, lambda: store.check([KEYS.next(0)])) is None
    assert store.get(KEYS.next(0)) == store.get(KEYS.latest) == b"1"
    plan = PlanMessage.model_validate_json(store.get(KEYS.plan(1)))
    assert plan.policy == "reroute" and plan.resume_step == 3
    assert 3 not in {s.worker for s in plan.plan.stages}
    for r in {s.worker for s in plan.plan.stages} | {t.src for t in plan.transfers}:
        store.queue_push(KEYS.inbox, encode(Applied(rank=r, generation=1)))
    tick_until(c, lambda: named(emitted, "recovered"))
    (recovered,) = named(emitted, "recovered")
    assert (recovered["generation"], recovered["steps_lost"], recovered["resume_step"]) == (1, 0, 3)
    assert not [k for k in store.list_keys() if k.startswith(KEYS.generation(0))]
    assert store.check([KEYS.plan(1)])


def test_a_configured_cluster_reaches_the_planner(store):
    """``chameleon run --config``: the config's device memory, links and restart cost
    replace the workers' defaults; the launch's topology stays."""
    cluster = load_job(CONFIGS / "cpu_testbed.toml").cluster
    job = DESCRIPTION.to_job(
        num_nodes=1, workers_per_node=4, mtbf_s=60, step_s=0.1, restart_s=5, cluster=cluster
    )
    assert job.cluster.device_memory_bytes == cluster.device_memory_bytes == 2 * 2**30
    assert job.cluster.intra_node == cluster.intra_node and job.cluster.restart_s == 8
    assert (job.cluster.num_nodes, job.cluster.devices_per_node) == (1, 4)
    assert job.cluster.allreduce == "ring"  # what the runtime executes
    exact = DESCRIPTION.model_copy(update={"exact": True}).to_job(
        num_nodes=1, workers_per_node=4, mtbf_s=60, step_s=0.1, restart_s=5, cluster=cluster
    )
    assert exact.cluster.allreduce == "exchange"  # Trainer(exact=True), whatever the config
    # A device too small for any layout: no in-place policy fits, the job restarts.
    c, emitted, _ = make(store, policy="auto", cluster=replace(cluster, device_memory_bytes=1000))
    c.tick()
    c.on_failures([failure(3)])
    for r in (0, 1, 2):
        ready(store, r)
    outcome = tick_until(c, lambda: False)
    assert outcome is not None and outcome.restart
    (chosen,) = named(emitted, "plan_chosen")
    assert chosen["policy"] == "restart" and chosen["memory_limit_bytes"] == 1000
    assert not any(x["feasible"] for x in chosen["candidates"].values())


def test_a_survivor_that_does_not_answer_the_abort_is_killed_and_the_rest_go_on(store):
    # A survivor may be mid-step when the abort comes: it has the step timeout to answer.
    c, emitted, killed = make(store, watch=WatchTimeouts(step_s=0.3))
    c.tick()
    c.on_failures([failure(3)])
    ready(store, 0)
    ready(store, 1)
    tick_until(c, lambda: killed)
    assert killed[0][0] == [2] and "did not answer the abort" in killed[0][1]
    tick_until(c, lambda: store.check([KEYS.next(0)]))
    plan = PlanMessage.model_validate_json(store.get(KEYS.plan(1)))
    assert {s.worker for s in plan.plan.stages} == {0, 1}


def test_a_stalled_worker_is_blamed_alone(store):
    stuck = {
        0: WaitingOn(what="recv", peers=[1]),
        1: WaitingOn(what="compute"),
        2: WaitingOn(what="agree", name="commit/3"),
        3: WaitingOn(what="recv", peers=[2]),
    }
    for r, w in stuck.items():
        store.set(KEYS.status(r), status(r, waiting_on=w).model_dump_json())
    c, emitted, killed = make(store, watch=WatchTimeouts(step_s=0.5))
    c.tick()  # first look
    time.sleep(1.1)  # statuses are read once a second while the job trains
    c.tick()
    assert [ranks for ranks, _ in killed] == [[1]]
    assert "ranks [0, 2, 3] wait on it" in killed[0][1]


def test_a_clearly_faster_layout_is_pointed_out():
    # 4 light layers on 2 pipelines of 2 stages: pure data parallelism has no bubble.
    emitted = []
    model = JobModel(
        emit=lambda name, **kw: emitted.append((name, kw)), rate=FailureRate(3600.0, fixed_s=3600.0), num_nodes=1,
        workers_per_node=4, description=DESCRIPTION,
    )  # fmt: skip
    plan = two_by_two()
    model.hint_layout(model.job(plan, {}, 0), plan)
    (hint,) = [kw for name, kw in emitted if name == "layout_hint"]
    assert hint["best_step_s"] * 1.1 < hint["launched_step_s"]
    assert sorted(len(p) for p in hint["pipelines"]) == [1, 1, 1, 1]


def test_replacements_are_asked_for_within_budget_and_only_where_a_node_lives():
    asked: dict = {}
    rejoins = Rejoins(max_per_rank=2)
    assert rejoins.request({1, 2}, gone={2}, put=asked.__setitem__) == [1]
    assert asked == {1: 1} and rejoins.waiting == {1}
    rejoins.forget([1])
    assert rejoins.request({1}, gone=set(), put=asked.__setitem__) == [1]
    assert rejoins.request({1}, gone=set(), put=asked.__setitem__) == []  # budget spent
    assert asked[1] == 2


def test_growing_must_pay_for_its_transition_before_the_next_failure():
    assert worth_growing(current_s=1.0, grown_s=0.75, transition_s=1.0, mtbf_s=3600)
    assert not worth_growing(current_s=1.0, grown_s=0.995, transition_s=1.0, mtbf_s=3600)
    assert not worth_growing(current_s=1.0, grown_s=0.75, transition_s=30, mtbf_s=60)


def test_the_message_wait_fitted_makes_the_running_plan_take_its_measured_step():
    from planner.estimator.estimate import estimate
    from tests.synthetic import uniform_job

    job = uniform_job(dp=1, pp=4, num_layers=4, micro_batches=8)
    deep = pipelines_plan(
        num_layers=4, num_micro_batches=8, pipelines=[[0, 1, 2, 3]],
        boundaries=[[0, 1, 2, 3, 4]], micro_batch_counts=[8],
    )  # fmt: skip
    free = estimate(job, deep).step_s
    wait = fit_wait(job, deep, free * 1.5)
    assert wait is not None and wait > 0
    assert estimate(waiting(job, wait), deep).step_s == pytest.approx(free * 1.5, rel=1e-3)
    assert fit_wait(job, deep, free * 0.9) is None  # already slower than measured
    alone = pipelines_plan(
        num_layers=4, num_micro_batches=8, pipelines=[[0]], boundaries=[[0, 4]],
        micro_batch_counts=[8],
    )  # fmt: skip
    assert fit_wait(job, alone, estimate(job, alone).step_s * 1.5) is None  # no messages


def test_measured_transitions_calibrate_the_next_ones():
    from planner.choice.policy import reroute_candidate
    from planner.search.layouts import Search

    model = JobModel(
        emit=lambda name, **kw: None, rate=FailureRate(3600.0, fixed_s=3600.0), num_nodes=1,
        workers_per_node=4, description=DESCRIPTION,
    )  # fmt: skip
    plan = two_by_two()
    before = reroute_candidate(Search(model.job(plan, {}, 0)), plan, [3]).transition
    # A recovery predicted at 10 ms beside a 5 ms decision measured 45 ms: 4x the model,
    # of which the factor moves halfway (geometrically) at once.
    model.expect_transition(1, predicted_s=0.010, decision_s=0.005)
    assert model.observe_transition(1, 0.045) == pytest.approx(2.0)
    assert model.observe_transition(1, 0.045) == pytest.approx(2.0)  # counted once
    after = reroute_candidate(Search(model.job(plan, {}, 0)), plan, [3]).transition
    assert after.protocol_s == pytest.approx(2 * before.protocol_s)
    assert after.groups_s == pytest.approx(2 * before.groups_s)
    # A much faster one moves it back, by at most 2x per recovery.
    model.expect_transition(2, predicted_s=0.020, decision_s=0.0)
    assert model.observe_transition(2, 0.0001) == pytest.approx(1.0)


def auto_store(plan0=None):
    """A job whose script left the layout to the planner (pipeline_stages="auto"): its
    description, no plan 0 (unless ``plan0``: one the leader published earlier)."""
    s = TCPStore(
        "127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=10),
    )  # fmt: skip
    auto = DESCRIPTION.model_copy(update={"layout": "auto", "resume_step": 7, "dp": 4, "pp": 1})
    s.set(KEYS.job, auto.model_dump_json())
    if plan0 is not None:
        message = PlanMessage.build(generation=0, policy="launch", resume_step=7, plan=plan0)
        s.set(KEYS.plan(0), message.model_dump_json())
        s.set(KEYS.latest, "0")
    return s


def test_the_leader_plans_the_launch_layout_once():
    store = auto_store()
    c, emitted, _ = make(store, policy="auto")
    c.tick()  # plans and publishes generation 0
    (launch,) = named(emitted, "launch_planned")
    first = PlanMessage.model_validate_json(store.get(KEYS.plan(0)))
    assert first.policy == "launch" and first.resume_step == 7 and store.get(KEYS.latest) == b"0"
    assert len(first.plan.stages) == launch["workers"] == 4 - launch["spares"]
    c.tick()  # the state machine starts from it, as from a script's own layout
    assert named(emitted, "resumed") and len(named(emitted, "launch_planned")) == 1
    # A successor that finds one published keeps it (written once).
    other = PlanMessage.build(generation=0, policy="launch", resume_step=7, plan=two_by_two())
    store.compare_set(KEYS.plan(0), "", other.model_dump_json())
    assert PlanMessage.model_validate_json(store.get(KEYS.plan(0))) == first


def test_a_launch_layout_that_calibration_shows_slow_is_re_partitioned_in_place():
    """Generation 0 on one pipeline of four stages (as a launch planned on wrong costs
    would be): once its steps calibrate the model, four replicas clearly pay, and the
    leader aborts the healthy generation to re-partition (event rebalance)."""
    deep = pipelines_plan(
        num_layers=4, num_micro_batches=4, pipelines=[[0, 1, 2, 3]],
        boundaries=[[0, 1, 2, 3, 4]], micro_batch_counts=[4],
    )  # fmt: skip
    store = auto_store(deep)
    for r in range(4):
        store.set(KEYS.status(r), status(r, step=20, progress=20).model_dump_json())
    c, emitted, _ = make(store, policy="auto")
    tick_until(c, lambda: named(emitted, "rebalance"))
    (rebalance,) = named(emitted, "rebalance")
    assert rebalance["estimated_step_s"] < rebalance["step_s"]
    for r in range(4):
        message = MAILBOX.validate_json(store.queue_pop(KEYS.mailbox(r), block=False))
        assert isinstance(message, Abort) and message.generation == 0
    for r in range(4):
        store.queue_push(
            KEYS.inbox,
            encode(Ready(rank=r, pid=1000 + r, after=0, applied=0, step=20, held=[r])),
        )
    tick_until(c, lambda: store.check([KEYS.next(0)]))
    (chosen,) = named(emitted, "plan_chosen")
    assert chosen["rebalance"] and chosen["policy"] == "reparallelize"
    assert not named(emitted, "layout_hint")  # judged again, not pointed out


def test_a_worker_lost_before_the_launch_is_left_out_of_it():
    """Nothing is held before generation 0: a worker lost then costs no restart (it used
    to: "ranks failed before training started"), the launch is planned without it."""
    store = auto_store()
    c, emitted, _ = make(store, policy="auto")
    c.on_failures([failure(3)])
    outcome = c.tick()
    assert not outcome.restart, outcome.reason
    first = PlanMessage.model_validate_json(store.get(KEYS.plan(0)))
    assert 3 not in {s.worker for s in first.plan.stages}
    assert named(emitted, "resumed") and not c.recovering  # a spare lost: nothing to abort
