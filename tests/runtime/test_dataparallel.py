"""The drop-in data-parallel API (chameleon_runtime.dataparallel, .sampler): the sampler's
deal, and a DDP loop against the same loop on the drop-in API under real torchrun."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from chameleon_runtime.sampler import ElasticSampler, deal, uneven_shares
from tests.clock import budget

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "runtime" / "dp_script.py")


def test_one_micro_batch_each_is_distributed_samplers_deal():
    data = list(range(100))
    for rank in range(4):
        ours = ElasticSampler(
            data, global_batch_size=20, micro_batch_size=5, seed=3, rank=rank, world_size=4
        )
        theirs = DistributedSampler(data, num_replicas=4, rank=rank, seed=3, drop_last=True)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            flat = [i for batch in ours for i in batch]
            assert flat == list(theirs)[: len(flat)]
            ours.step = (epoch + 1) * ours.steps_per_epoch  # as its optimizer's commits do


def test_every_membership_covers_the_same_global_batch():
    data = list(range(64))
    full = ElasticSampler(data, global_batch_size=16, micro_batch_size=2, rank=0, world_size=1)
    for step in range(4):
        batch = sorted(i for j in range(8) for i in full.indices(step, j))
        assert len(set(batch)) == 16
        for members in ([0, 1, 2, 3], [0, 2, 3], [1, 3], [2]):
            shares = [deal(8, members, r) for r in members]
            assert sorted(j for s in shares for j in s) == list(range(8))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1  # balanced
    # a new epoch draws a new order; a resumed sampler deals where its state says
    full.set_epoch(1)
    assert full.indices(4, 0) != full.indices(0, 0)
    again = ElasticSampler(data, global_batch_size=16, micro_batch_size=2, rank=0, world_size=1)
    again.load_state_dict({"epoch": 1, "step": 5, "seed": 0})
    first = next(iter(again))
    assert first == full.indices(5, 0) and again.issued[0].step == 5


def test_a_plan_that_deals_a_slow_member_fewer_is_followed_and_an_even_one_is_not():
    from planner.plans.plan import data_parallel, pipelines_plan

    assert uneven_shares(data_parallel([0, 1, 2], 8)) is None  # the sampler's own deal
    uneven = pipelines_plan(
        num_layers=1, num_micro_batches=8, pipelines=[[0], [1], [2]],
        boundaries=[[0, 1]] * 3, micro_batch_counts=[3, 4, 1],
    )  # fmt: skip
    shares = uneven_shares(uneven)
    assert shares == {0: (0, 1, 2), 1: (3, 4, 5, 6), 2: (7,)}
    data = list(range(64))
    got = []
    for rank in (0, 1, 2):
        s = ElasticSampler(data, global_batch_size=16, micro_batch_size=2, rank=rank, world_size=3)
        s.shares = shares
        batches = list(s)[: len(shares[rank])]  # the first step's
        assert [mb.index for mb in s.issued[: len(batches)]] == list(shares[rank])
        assert s.issued[len(batches) - 1].last  # its last micro-batch's backward syncs
        got += [i for b in batches for i in b]
    assert sorted(got) == sorted(i for j in range(8) for i in s.indices(0, j))  # the same batch


def test_bad_sizes_are_one_line_errors():
    with pytest.raises(ValueError, match="not a multiple"):
        ElasticSampler(list(range(10)), global_batch_size=6, micro_batch_size=4)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        ElasticSampler(list(range(3)), global_batch_size=4, micro_batch_size=2)


def _run(tmp_path: Path, name: str, mode: str, nproc: int, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, SCRIPT, "--mode", mode, "--out", str(out), *extra]
    if nproc > 1:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--standalone", *cmd[1:],
        ]  # fmt: skip
    done = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=budget(180),
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


# (scripts/soak.sh: in CI, test_habits runs this loop's habits under torchrun against
# DDP, and one worker accumulating the whole global batch alone: test_two_backwards)
@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(60)  # 11 s measured
def test_under_torchrun_it_trains_as_ddp_does(tmp_path):
    ddp = _run(tmp_path, "ddp", "ddp", 2)
    ours = _run(tmp_path, "ours", "chameleon", 2)
    # one worker accumulating both micro-batches of every step: the same global batches
    alone = _run(tmp_path, "alone", "chameleon", 1)
    assert len(ddp["losses"]) == 12
    for run in (ours, alone):
        assert run["losses"].keys() == ddp["losses"].keys()
        for step, value in ddp["losses"].items():
            assert run["losses"][step] == pytest.approx(value, rel=1e-5), step
        for key, value in ddp["weights"].items():
            assert run["weights"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_a_scheduler_accepts_the_wrapper_and_accumulation_waits_for_the_share():
    from torch import nn

    import chameleon_runtime as cr

    data = [(torch.randn(4), torch.tensor(0)) for _ in range(32)]
    sampler = cr.ElasticSampler(data, global_batch_size=8, micro_batch_size=2, world_size=1)
    model = cr.DataParallel(nn.Linear(4, 2), sampler)
    opt = cr.ElasticOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    commits = []
    for x, y in loader:
        nn.functional.cross_entropy(model(x), y).backward()
        committed = opt.step()
        commits.append(committed)
        if committed:
            schedule.step()
        opt.zero_grad()
    assert commits == [False, False, False, True] * 4  # 4 micro-batches a step, alone
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)
    assert sampler.step == 4
