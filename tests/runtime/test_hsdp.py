"""A sharded model on the drop-in API (chameleon_runtime.sharding): HSDP, 2 replica groups
of 2 shards, float64. The drop-in's run must train the weights plain HSDP trains (FSDP2 on
a 2-D mesh under torchrun), under chameleon run (and under torchrun: scripts/soak.sh).
tests/runtime/hsdp_script.py is the loop.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from chameleon_runtime.sharding import check_even_deal
from chameleon_runtime.shardlayout import ShardLayout
from tests.clock import budget
from tests.launcher.helpers import (
    devices_config,
    env,
    events,
    leftovers,
    lose_node_1,
    rank_outputs,
    run,
    stacks,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "runtime" / "hsdp_script.py")
HF = str(ROOT / "examples" / "train_hf.py")
# float64; plain HSDP averages (a sum then a division per group and across groups), the
# drop-in sums and divides once: the same numbers up to rounding
TOLERANCE = 1e-12


def torchrun(tmp: Path, name: str, mode: str, *extra: str, nproc: int = 4):
    cmd = [
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        SCRIPT, "--mode", mode, "--out", str(tmp / name), *extra,
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, *cmd], cwd=tmp, env={**env(), "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=budget(240),
    )  # fmt: skip
    return done, {r: out["state"] for r, out in rank_outputs(tmp, name).items()}


def chameleon(
    tmp: Path, name: str, *extra: str, workers: int = 4, launch: tuple = ("--max-rejoins", "0")
):
    done = run(
        "run", "--standalone", "--nproc-per-node", str(workers),
        "--events", str(tmp / f"{name}.events"), *launch,
        SCRIPT, "--mode", "dropin", "--out", str(tmp / name), *extra, cwd=tmp, timeout=240,
    )  # fmt: skip
    assert leftovers(tmp) == [], "workers outlived the launcher"
    return done, {r: out["state"] for r, out in rank_outputs(tmp, name).items()}


def plans(log: list[dict]) -> list[tuple[str, str]]:
    """The plans a run chose, (policy, label), less the roll-forward of a step that a
    joining replacement's abort interrupted mid-commit: a plan with no failure and no
    join, which only finishes that step, and after which the join is planned
    (launcher/recovery.py). Whether an abort lands mid-commit is the machine's timing."""
    chosen = []
    for i, e in enumerate(log):
        if e["event"] != "plan_chosen":
            continue
        if not e.get("failed") and not e.get("joined") and e["label"] == "keep groups":
            after = [x for x in log[i + 1 :] if x["event"] == "abort"][:1]
            assert after and "rolled forward" in after[0]["reason"], after
            continue
        chosen.append((e["policy"], e["label"]))
    return chosen


def relative(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert a.keys() == b.keys()
    worst = 0.0
    for key, want in a.items():
        diff = sum((x - y) ** 2 for x, y in zip(want, b[key], strict=True)) ** 0.5
        worst = max(worst, diff / (sum(x * x for x in want) ** 0.5 or 1.0))
    return worst


# A killed rank's replacement grows its group back (or is taken back) well before the
# end of this many steps: at step 12-15, 3.6 s into the run, here (a fork of the warm
# server); on a host twice as slow the steps are too.
GROW_STEPS = "40"


@pytest.fixture(scope="module")
def free_run(tmp_path_factory):
    """The failure-free run under chameleon run for a set of script flags, trained once
    for every test of this module that compares with it: rank -> state. (Its launch
    flags are the defaults: a failure-free run of the drop-in keeps the script's layout,
    whatever config the planner is given.)"""
    made: dict[tuple, dict] = {}

    def get(*extra: str, workers: int = 4) -> dict:
        if (extra, workers) not in made:
            tmp = tmp_path_factory.mktemp("free")
            done, states = chameleon(tmp, "free", *extra, workers=workers)
            assert done.returncode == 0, done.stderr[-3000:]
            made[(extra, workers)] = states
        return made[(extra, workers)]

    return get


@pytest.fixture(scope="module")
def plain_hsdp(tmp_path_factory) -> dict:
    """Plain HSDP (FSDP2 on a 2-D mesh) under torchrun: rank -> state."""
    tmp = tmp_path_factory.mktemp("plain")
    done, plain = torchrun(tmp, "plain", "plain")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(plain) == [0, 1, 2, 3]
    for rank in range(4):
        assert relative(plain[0], plain[rank]) == 0.0  # every rank holds the same model
    return plain


@pytest.mark.slow
@pytest.mark.timeout(120)  # 23 s measured; 35 s with a core busy
def test_the_drop_in_trains_what_plain_hsdp_trains(plain_hsdp, free_run):
    under_chameleon = free_run()
    for rank in range(4):
        assert relative(plain_hsdp[0], under_chameleon[rank]) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.soak  # (scripts/soak.sh: the drop-in under torchrun is in CI, test_habits)
@pytest.mark.timeout(90)  # 12 s measured
def test_under_plain_torchrun_the_drop_in_trains_what_plain_hsdp_trains(tmp_path, plain_hsdp):
    done, under_torchrun = torchrun(tmp_path, "torchrun", "dropin")
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(4):
        assert relative(plain_hsdp[0], under_torchrun[rank]) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.timeout(60)  # 5 s measured
def test_a_kill_drops_the_damaged_group_in_place(tmp_path, free_run):
    """kill -9 of rank 1 (group 0 = ranks 0, 1) at step 3: the planner drops group 0, group
    1 takes every micro-batch of each step (4 each), and ends with the failure-free
    weights; nothing restarts."""
    free = free_run()
    done, killed = chameleon(
        tmp_path, "kill",
        launch=("--max-rejoins", "0", "--policy", "reroute", "--inject-fault", "kill:rank=1,step=3"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    log = events(tmp_path / "kill.events")
    chosen = [e for e in log if e["event"] == "plan_chosen" and e.get("generation", 1) >= 1]
    assert [e["policy"] for e in chosen] == ["reroute"], chosen
    assert "drop 1 replica group(s) of [0, 1]" in chosen[0]["label"]
    assert not [e for e in log if e["event"] == "decision" and e.get("action") == "restart"]
    # group 0's survivor waits as a spare (its clip_grad_norm_ in the failed turn took no
    # collective of the broken group) and writes nothing
    assert [e["rank"] for e in log if e["event"] == "failure"] == [1]
    assert sorted(killed) == [2, 3]
    for rank in (2, 3):
        assert relative(free[0], killed[rank]) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.timeout(90)  # 23 s measured
def test_a_kill_re_shards_the_group_then_grows_it_back_whole(tmp_path, free_run):
    """kill -9 of rank 1 at step 3, its replacement started, the planner's own choices:
    group 0 is re-sharded over rank 0 alone (the rows of rank 1's shard and their
    optimizer state from rank 3, its column in group 1), which then holds the whole
    model and runs turns of one micro-batch while group 1 runs turns of two, its sums
    paired piece by piece with group 1's shards (chameleon_runtime.rowsums); once the
    replacement is up the group grows back whole: the replacement healed from rank 3,
    rank 0 cut back to its half. Every rank ends with the failure-free weights. Planned
    as if each worker had a device (devices_config)."""
    config = ("--config", str(devices_config(tmp_path)))
    free = free_run("--steps", GROW_STEPS)
    done, grown = chameleon(
        tmp_path, "kill", "--steps", GROW_STEPS,
        launch=(*config, "--inject-fault", "kill:rank=1,step=3"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    log = events(tmp_path / "kill.events")
    chosen = plans(log)
    assert chosen == [
        ("reparallelize", "re-shard replica group(s) [[0]] over their survivors"),
        ("reparallelize", "grow re-sharded group(s) [[0]] whole, healed shard by shard"),
    ], chosen
    assert not [e for e in log if e["event"] == "decision" and e.get("action") == "restart"]
    assert [e["rank"] for e in log if e["event"] == "failure"] == [1]
    assert sorted(grown) == [0, 1, 2, 3]
    for rank in range(4):
        assert relative(free[0], grown[rank]) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.soak  # (scripts/soak.sh: a re-shard over survivors is in CI, groups of 2)
@pytest.mark.timeout(60)  # 15 s measured
def test_a_group_of_three_re_shards_over_two_survivors(tmp_path, free_run):
    """6 workers, 2 groups of 3 shards, 12 micro-batches; kill -9 of rank 1: ranks 0 and 2
    cut every parameter in halves on a new mesh of two (each keeps what it had of its
    half and takes the rest of the middle third from rank 4), then group 0 runs 3 turns
    of 2 micro-batches and group 1 2 turns of 3. The failure-free weights, in place."""
    extra = ("--shards", "3", "--micro-batches", "12", "--steps", "6")
    free = free_run(*extra, workers=6)
    done, killed = chameleon(
        tmp_path, "kill", *extra, workers=6,
        launch=(
            "--max-rejoins", "0", "--policy", "reparallelize",
            "--inject-fault", "kill:rank=1,step=2",
        ),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    log = events(tmp_path / "kill.events")
    chosen = plans(log)
    assert chosen == [("reparallelize", "re-shard replica group(s) [[0, 2]] over their survivors")]
    assert sorted(killed) == [0, 2, 3, 4, 5]
    for rank in killed:
        assert relative(free[0], killed[rank]) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.timeout(60)  # 11 s measured
def test_a_dropped_group_is_taken_back_healed_shard_by_shard(tmp_path, free_run):
    """kill -9 of rank 1 at step 3, its replacement started, on devices too small for a
    re-shard: group 0 is dropped; once the replacement is up, the group (the survivor, idle since, and the
    replacement) is taken back, each member receiving its shard's parameters and
    optimizer state from the member of its column in group 1. All four end with the
    failure-free weights. Planned as if each worker had a device (devices_config): on
    this 2-core host two workers are as fast as four, and taking the group back would
    not pay."""
    # devices of 16 kB: a shard's state fits (11 kB planned), the whole model's that a
    # group re-sharded over rank 0 alone would hold does not (20 kB): dropping pays
    path = devices_config(tmp_path)
    path.write_text(path.read_text().replace("device_memory_gib = 2", "device_memory_gib = 1.5e-5"))
    config = ("--config", str(path))
    free = free_run("--steps", GROW_STEPS)
    done, healed = chameleon(
        tmp_path, "heal", "--steps", GROW_STEPS,
        launch=(*config, "--inject-fault", "kill:rank=1,step=3"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    log = events(tmp_path / "heal.events")
    chosen = plans(log)
    assert chosen == [
        ("reroute", "drop 1 replica group(s) of [0, 1]"),
        ("reparallelize", "take back replica group(s) [[0, 1]], healed shard by shard"),
    ], chosen
    assert [e["rank"] for e in log if e["event"] == "failure"] == [1]
    assert sorted(healed) == [0, 1, 2, 3]
    for rank in range(4):
        assert relative(free[0], healed[rank]) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.soak  # (scripts/soak.sh: a kill mid-migration is in CI, test_recovery and test_dropin)
@pytest.mark.timeout(90)  # 30 s measured
def test_a_replacement_killed_while_it_is_healed(tmp_path, free_run):
    """The second kill lands in the recovery that grows group 0 (re-sharded over rank 0
    at the first) back whole: the replacement of rank 1 dies while its shard streams in
    (recovery 2, phase migrate). Rank 0 keeps the whole model it holds ("keep groups"),
    or, if the growth was agreed before the kill, holds half and is re-sharded again;
    the next replacement is taken in, and every rank ends with the failure-free
    weights."""
    config = ("--config", str(devices_config(tmp_path)))
    free = free_run("--steps", "80")
    done, healed = chameleon(
        tmp_path, "twice", "--steps", "80",
        launch=(*config, "--max-rejoins", "2", "--inject-fault", "kill:rank=1,step=3",
                "--inject-fault", "kill:rank=1,recovery=2,phase=migrate"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:] + stacks(done.stderr)
    log = events(tmp_path / "twice.events")
    assert [e["rank"] for e in log if e["event"] == "failure"] == [1, 1]
    labels = [e["label"] for e in log if e["event"] == "plan_chosen"]
    assert labels[0] == "re-shard replica group(s) [[0]] over their survivors"
    # killed before the growth was agreed: rank 0 keeps the whole model; after: the
    # grown group is re-sharded again, rank 0 then holding half rows it kept
    assert labels[2] in ("keep groups", "re-shard replica group(s) [[0]] over their survivors")
    assert labels[-1] == "grow re-sharded group(s) [[0]] whole, healed shard by shard"
    assert not [e for e in log if e["event"] == "decision" and e.get("action") == "restart"]
    assert sorted(healed) == [0, 1, 2, 3]
    for rank in range(4):
        assert relative(free[0], healed[rank]) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.timeout(60)  # 16 s measured
def test_a_drifted_shard_is_healed_from_its_column(tmp_path, free_run):
    """3 replica groups of 2, the replicas compared every 4 steps: rank 4's shard of a
    weight is changed after step 8 commits (its column is ranks 0, 2, 4). The check at
    step 8 finds it outvoted and heals it from rank 0 before any forward uses it: the
    run ends with the weights of one without the fault."""
    flags = ("--micro-batches", "6", "--steps", "12", "--check-every", "4")
    free = free_run(*flags, workers=6)
    done, healed = chameleon(tmp_path, "drift", *flags, "--drift", "4:8", workers=6)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank(s) [4] held weights different from the others' (first in " in done.stderr
    assert "healed from rank 0" in done.stderr
    for rank in range(6):
        assert relative(free[0], healed[rank]) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.soak  # (scripts/soak.sh: a lost node is in CI, test_dropin; a dropped group too)
@pytest.mark.timeout(90)  # 25 s measured
def test_a_lost_node_takes_its_replica_group_and_the_job_goes_on(tmp_path, free_run):
    """Two agents on 127.0.0.1, two workers each: node 1 holds replica group 1 (ranks 2,
    3). Its agent is SIGKILLed mid-run (its workers die with it): node 0's group takes
    every micro-batch in place and ends with the failure-free weights."""
    free = free_run("--steps", "40")
    args = [SCRIPT, "--mode", "dropin", "--steps", "40", "--sleep", "0.1"]
    args += ["--out", str(tmp_path / "node")]
    evs = lose_node_1(tmp_path, args, flags=("--max-rejoins", "0"), timeout=90)
    assert [e["node"] for e in evs if e["event"] == "node_lost"] == [1]
    assert [e["attempt"] for e in evs if e["event"] == "workers_started"] == [0]  # in place
    chosen = [e["label"] for e in evs if e["event"] == "plan_chosen"]
    assert chosen == ["drop 1 replica group(s) of [2, 3]"], chosen
    assert leftovers(tmp_path) == []
    survived = {r: out["state"] for r, out in rank_outputs(tmp_path, "node").items()}
    assert sorted(survived) == [0, 1]
    for rank in (0, 1):
        assert relative(free[0], survived[rank]) <= TOLERANCE


HF_FLAGS = (
    "--shards", "2", "--float64", "--steps", "8", "--global-batch", "64",
    "--micro-batch", "8", "--seq-len", "32", "--checkpoint-every", "3",
)  # fmt: skip


def train_hf(tmp: Path, name: str, *launch: str):
    """examples/train_hf.py --shards 2 (GPT-2, float64) on 4 workers, saving with
    torch.distributed.checkpoint every 3 steps. (Sequences of 32 and 8 steps: the same
    paths, less work.)"""
    return run(
        "run", "--standalone", "--nproc-per-node", "4", "--max-rejoins", "0",
        "--events", str(tmp / f"{name}.events"), *launch, HF, *HF_FLAGS,
        "--checkpoint-dir", str(tmp / f"{name}.ckpt"), "--dump", str(tmp / name),
        cwd=tmp, timeout=300,
    )  # fmt: skip


@pytest.fixture(scope="module")
def free_hf(tmp_path_factory) -> dict:
    """train_hf's failure-free weights: rank -> weights."""
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("free_hf")
    done = train_hf(tmp, "free")
    assert done.returncode == 0, done.stderr[-3000:]
    return {r: out["weights"] for r, out in rank_outputs(tmp, "free").items()}


@pytest.mark.slow
@pytest.mark.timeout(120)  # 33 s measured
def test_every_holder_of_a_shard_lost_restarts_from_the_checkpoint_and_says_so(tmp_path, free_hf):
    """GPT-2 sharded in 2 (train_hf): ranks 1 and 3 (shard 1 of both groups) killed at
    step 4: nothing in place can go on, the launcher restarts, the job resumes from step
    3's checkpoint and ends with the failure-free weights."""
    done = train_hf(
        tmp_path, "lost", "--max-restarts", "1",
        "--inject-fault", "kill:rank=1,step=4", "--inject-fault", "kill:rank=3,step=4",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from step 3" in done.stdout
    log = events(tmp_path / "lost.events")
    (restart,) = [e for e in log if e["event"] == "decision" and e["action"] == "restart"]
    assert "shard(s) [1] of the model have no live copy" in restart["reason"], restart
    lost = {r: out["weights"] for r, out in rank_outputs(tmp_path, "lost").items()}
    assert sorted(lost) == [0, 1, 2, 3]
    for rank in range(4):
        for key, value in free_hf[0].items():
            assert abs(lost[rank][key] - value) <= 1e-12 * abs(value), key
    assert leftovers(tmp_path) == []


@pytest.mark.slow
@pytest.mark.soak  # (scripts/soak.sh: a re-shard in place is in CI, hsdp_script's model)
@pytest.mark.timeout(120)  # 20 s measured
def test_gpt2_re_sharded_in_place_trains_the_failure_free_weights(tmp_path, free_hf):
    """The same model re-sharded in place instead (--policy reparallelize, rank 1 alone
    killed): rank 0 holds GPT-2 whole from step 3 on, nothing reloaded."""
    done = train_hf(
        tmp_path, "reshard", "--policy", "reparallelize", "--inject-fault", "kill:rank=1,step=3"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    chosen = [
        e["label"] for e in events(tmp_path / "reshard.events") if e["event"] == "plan_chosen"
    ]
    assert chosen == ["re-shard replica group(s) [[0]] over their survivors"]
    assert "resumed from step" not in done.stdout
    resharded = {r: out["weights"] for r, out in rank_outputs(tmp_path, "reshard").items()}
    assert sorted(resharded) == [0, 2, 3]
    for rank in resharded:
        for key, value in free_hf[0].items():
            assert abs(resharded[rank][key] - value) <= 1e-12 * abs(value), key
    assert leftovers(tmp_path) == []


@pytest.mark.slow
@pytest.mark.timeout(60)  # 5 s measured
def test_part_of_a_turn_is_a_one_line_error(tmp_path):
    # 5 micro-batches for groups of 2: a member would run one more than its group-mate
    done = run(
        "run", "--standalone", "--nproc-per-node", "4", "--max-rejoins", "0", "--max-restarts",
        "0", SCRIPT, "--mode", "dropin", "--micro-batches", "5", "--out", str(tmp_path / "x"),
        cwd=tmp_path, timeout=240,
    )  # fmt: skip
    assert done.returncode != 0
    assert "is not a whole number of turns of 2" in done.stdout + done.stderr


def test_layout_groups_and_columns():
    layout = ShardLayout((0, 1, 2, 3, 5, 7), 2)
    assert layout.groups == [(0, 1), (2, 3), (5, 7)]
    assert layout.columns == [(0, 2, 5), (1, 3, 7)]
    assert layout.group_of(5) == (5, 7) and layout.column_of(3) == (1, 3, 7)
    assert layout.collectives() == sorted(
        [(0, 1, 2, 3, 5, 7), (0, 1), (2, 3), (5, 7), (0, 2, 5), (1, 3, 7)]
    )
    assert ShardLayout((0, 1), 1).collectives() == [(0, 1)]
    with pytest.raises(ValueError, match="whole replica groups"):
        ShardLayout((0, 1, 2), 2)


def test_a_step_of_part_of_a_turn_is_refused():
    check_even_deal(6, 2)  # 3 turns of 2: one group runs 2, another 1
    check_even_deal(5, 1)  # a whole model per worker accumulates unevenly: fine
    with pytest.raises(ValueError, match="not a whole number of turns of 2"):
        check_even_deal(5, 2)


def test_groups_take_turns_and_a_group_runs_in_lockstep():
    from chameleon_runtime.sampler import deal

    members = [0, 1, 2, 3, 4, 5]  # groups (0, 1), (2, 3), (4, 5)
    shares = {r: deal(10, members, r, shards=2) for r in members}
    assert shares == {0: [0, 6], 1: [1, 7], 2: [2, 8], 3: [3, 9], 4: [4], 5: [5]}
    # every member of a group as many; one group fewer; the whole step dealt once
    assert sorted(j for s in shares.values() for j in s) == list(range(10))
    # whole turns for every group: the same as the unsharded deal
    assert [deal(12, members, r, shards=2) for r in members] == [
        deal(12, members, r) for r in members
    ]


def test_a_rebuilt_model_trains_as_the_whole_model_even_from_an_unsharded_root():
    """chameleon_runtime.reshard.rebuild on one process: a model sharded by FSDP2, stepped
    once, its root left whole by an evaluation forward (no backward after it), set up
    again on a new mesh from its rows; it then trains as the unsharded model does, its
    AdamW state carried over (float64)."""
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from chameleon_runtime.reshard import rebuild, row_tensors
    from chameleon_runtime.shardlayout import local

    dist = pytest.importorskip("torch.distributed")
    import torch

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)).double()
        ref = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)).double()
        ref.load_state_dict(model.state_dict())
        mesh = DeviceMesh.from_group(dist.new_group([0]), "cpu")
        for m in (model[0], model[2], model):
            fully_shard(m, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
        x = torch.randn(4, 5, dtype=torch.double)

        def step():
            for net, o in ((model, opt), (ref, ref_opt)):
                net(x).sum().backward()
                o.step()
                o.zero_grad()

        step()
        with torch.no_grad():
            model(x)  # the root's parameters stay whole after it
        tensors = row_tensors(model, [opt])
        assert len(tensors) == 4 + 2 * 4  # parameters, then AdamW's two moments of each
        fresh = [local(t).clone() for t in tensors]
        mesh = DeviceMesh.from_group(dist.new_group([0]), "cpu")
        rebuild(model, [opt], tensors, fresh, mesh, ShardLayout((0,), 2, (1,)), 0)
        assert all(p.device_mesh.get_group() is mesh.get_group() for p in model.parameters())
        step()
        step()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.full_tensor(), q)
    finally:
        dist.destroy_process_group()
