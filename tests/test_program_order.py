"""The step program's messages between any two workers are received in the order they are
sent. NCCL and HCCL match point-to-point messages by that order alone (no tags), and the
runtime matches its gloo messages the same way: checked on launch plans, rerouted plans
and the search's re-partitions (heterogeneous stages)."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import pytest

from planner.config import load_job
from planner.plans.layout import initial_plan
from planner.plans.program import StepProgram, build_program
from planner.plans.reroute import RerouteInfeasible, reroute_plan
from planner.search.layouts import Search
from tests.synthetic import random_job

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
Stream = dict[tuple[int, int], list[tuple[str, int]]]


def streams(program: StepProgram) -> tuple[Stream, Stream]:
    """Per ordered pair (sender, receiver): the messages in the sender's program order and
    in the receiver's (``WorkerProgram.messages``, the order chameleon_runtime.step posts
    them in and checks itself against)."""
    sends: Stream = {}
    recvs: Stream = {}
    for p in program.workers:
        for m in p.messages():
            pair = (p.worker, m.peer) if m.send else (m.peer, p.worker)
            (sends if m.send else recvs).setdefault(pair, []).append((m.kind, m.index))
    return sends, recvs


def assert_fifo(program: StepProgram) -> None:
    sends, recvs = streams(program)
    assert sorted(sends) == sorted(recvs)
    for pair, sent in sends.items():
        assert sent == recvs[pair], f"{pair}: sent {sent[:6]}..., received {recvs[pair][:6]}..."


@pytest.mark.parametrize("seed", range(60))
def test_launch_and_rerouted_plans_receive_in_send_order(seed):
    rng = random.Random(seed)
    job = random_job(rng)
    plan = initial_plan(job)
    for _ in range(4):
        assert_fifo(build_program(plan, job.model.layer_params))
        try:
            plan = reroute_plan(plan, rng.sample(plan.workers, 1))
        except RerouteInfeasible:
            break


@pytest.mark.parametrize("config", ["cpu_testbed", "ascend910b_32_gpt13b"])
def test_repartitions_receive_in_send_order(config):
    job = load_job(CONFIGS / f"{config}.toml")
    search = Search(job).warm_up()
    launch = initial_plan(job)
    rng = random.Random(1)
    checked = 0
    for _ in range(10):
        lost = rng.sample(launch.workers, rng.randint(1, len(launch.workers) // 2))
        survivors = [w for w in launch.workers if w not in lost]
        for proposal in search.propose(launch, survivors):
            plans = [proposal.plan]
            with contextlib.suppress(RerouteInfeasible):
                plans.append(reroute_plan(proposal.plan, [proposal.plan.workers[0]]))
            for plan in plans:
                assert_fifo(build_program(plan, job.model.layer_params, global_norm=True))
                checked += 1
    assert checked > 20
