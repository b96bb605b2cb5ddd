"""The habits of real training loops on the drop-in data-parallel API: each one is run as
plain DDP (torchrun, DistributedDataParallel), as the drop-in under torchrun (each of
those two: every habit in turn in one launch), and as the drop-in under chameleon run
with a kill -9 of one of the two workers in the middle (the survivor then accumulates both
micro-batches of every step). In float64 the final
weights must equal plain DDP's within 1e-9 relative (they are equal to the bit here:
with two workers the survivor's sum is gloo's, and halving is exact), or the job must
fail with a one-line error naming the habit. tests/runtime/habits_script.py is the loop.
"""

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.clock import budget
from tests.launcher.helpers import devices_config, env, events, leftovers, rank_outputs, run
from tests.runtime.habits_script import FLOAT32, HABITS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "runtime" / "habits_script.py")
TOLERANCE = 1e-9
FLOAT32_TOLERANCE = 1e-6  # autocast leaves float64 alone: these train in float32

pytestmark = pytest.mark.slow


def torchrun(tmp: Path, name: str, mode: str, habit: str, nproc: int = 2, *extra: str):
    out = tmp / name
    cmd = [SCRIPT, "--mode", mode, "--habit", habit, "--out", str(out), *extra]
    if nproc > 1:
        cmd = [
            "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *cmd,
        ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, *cmd],
        cwd=tmp,
        env={**env(), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=budget(240),
    )
    return done, states(tmp, name)


@pytest.fixture(scope="module")
def under_torchrun(tmp_path_factory) -> dict[str, tuple]:
    """Plain DDP and the drop-in under torchrun, every habit in turn in one launch of each
    (a launch costs seconds here; the habits, milliseconds): mode -> (the launch, habit ->
    rank -> state)."""
    tmp = tmp_path_factory.mktemp("torchrun")
    runs = {}
    for mode in ("ddp", "chameleon"):
        done, _ = torchrun(tmp, mode, mode, "all")
        runs[mode] = (done, {h: states(tmp, f"{mode}-{h}") for h in HABITS})
    return runs


def chameleon(tmp: Path, name: str, habit: str, kill: int | None, *extra: str, workers: int = 2):
    log = tmp / f"{name}.events"
    fault = ["--inject-fault", f"kill:rank={kill},step=5"] if kill is not None else []
    done = run(
        "run", "--standalone", "--nproc-per-node", str(workers), "--max-rejoins", "0",
        "--events", str(log), *fault,
        SCRIPT, "--mode", "chameleon", "--habit", habit, "--out", str(tmp / name), *extra,
        cwd=tmp, timeout=240,
    )  # fmt: skip
    assert leftovers(tmp) == [], "workers outlived the launcher"
    return done, states(tmp, name), events(log)


def states(tmp: Path, name: str) -> dict[int, dict[str, list[float]]]:
    return {rank: out["state"] for rank, out in rank_outputs(tmp, name).items()}


def assert_close(reference: dict[str, list[float]], state: dict[str, list[float]], rel: float):
    assert reference.keys() == state.keys()
    for key, want in reference.items():
        got = state[key]
        diff = sum((a - b) ** 2 for a, b in zip(want, got)) ** 0.5
        size = sum(a * a for a in want) ** 0.5 or 1.0
        assert diff <= rel * size, f"{key}: {diff / size:.3g} relative"


# The habits whose kill CI runs: one of each way a habit touches what a recovery hands
# over (buffers, unused parameters, several optimizers, loader processes, a compiled
# module, a scaler's state, the script's own collectives, reentrant checkpointing, kept
# gradients), each rank killed in some. The others' kills are the same recovery of the
# same state: scripts/soak.sh runs them (every habit's failure-free run is in CI, below).
KILLED_IN_CI = {
    "plain", "keep_grads", "checkpointing", "unused", "batchnorm", "two_optimizers",
    "loader_workers", "compile", "fp16_scaler", "user_collectives",
}  # fmt: skip
assert not KILLED_IN_CI - set(HABITS), KILLED_IN_CI - set(HABITS)


@pytest.mark.timeout(120)  # 30 s measured (the two launches of every habit)
def test_every_habit_trains_as_ddp_does(under_torchrun):
    done, ddp = under_torchrun["ddp"]
    assert done.returncode == 0, done.stderr[-2000:]
    done, ours = under_torchrun["chameleon"]
    assert done.returncode == 0, done.stderr[-2000:]
    for habit in HABITS:
        if habit == "two_backwards":  # (held to one process instead, below)
            continue
        rel = FLOAT32_TOLERANCE if habit in FLOAT32 else TOLERANCE
        assert sorted(ours[habit]) == [0, 1], habit
        for state in ours[habit].values():
            assert_close(ddp[habit][0], state, rel)


@pytest.mark.parametrize(
    "habit",
    [
        h if h in KILLED_IN_CI else pytest.param(h, marks=pytest.mark.soak)
        for h in HABITS
        if h != "two_backwards"
    ],
)
@pytest.mark.timeout(90)  # 8 s measured, besides the shared launches under torchrun
def test_a_habit_trains_as_ddp_does_through_a_kill(tmp_path, under_torchrun, habit):
    rel = FLOAT32_TOLERANCE if habit in FLOAT32 else TOLERANCE
    done, ddp = under_torchrun["ddp"]
    assert done.returncode == 0, done.stderr[-2000:]
    reference = ddp[habit][0]
    # Killed: rank 0 (the first micro-batch's holder, the buffers' source, the saver)
    # for every other habit and the script's own collectives, rank 1 for the rest.
    kill = 0 if habit == "user_collectives" else HABITS.index(habit) % 2
    done, survived, evs = chameleon(tmp_path, "kill", habit, kill)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(survived) == [1 - kill]
    assert [e["rank"] for e in evs if e["event"] == "fault_injected"] == [kill]
    (recovered,) = [e for e in evs if e["event"] == "recovered"]
    assert recovered["steps_lost"] == 0
    assert_close(reference, survived[1 - kill], rel)
    if habit == "user_collectives":
        assert_saved(tmp_path, "kill", survived[1 - kill], saver=1 - kill)


def assert_saved(tmp: Path, name: str, state: dict[str, list[float]], saver: int) -> None:
    """The torch.distributed.checkpoint the members saved holds the final weights; one
    member, the generation's lowest-ranked, said it was the saver."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tests.runtime.habits_script import Net

    shapes = Net("user_collectives").double().state_dict()
    loaded = {"model": {k: torch.zeros_like(v) for k, v in shapes.items()}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(loaded, checkpoint_id=str(tmp / f"{name}.dcp"))
    for key, values in state.items():
        assert loaded["model"][key].flatten().tolist() == values, key
    assert [p.name for p in tmp.glob(f"{name}.saver*")] == [f"{name}.saver{saver}"]


@pytest.mark.timeout(60)  # 7 s measured
def test_two_backwards_are_each_reduced(tmp_path, under_torchrun):
    # DDP reduces only the first backward after a forward: the second's gradients stay
    # on their rank and the replicas drift apart (measured: 10% apart after 12 steps).
    # The drop-in reduces each, so it is held to the one-process loop over the whole
    # global batch instead (one worker accumulating both micro-batches).
    done, alone = torchrun(tmp_path, "alone", "chameleon", "two_backwards", 1)
    assert done.returncode == 0, done.stderr[-2000:]
    done, ours = under_torchrun["chameleon"]
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(ours["two_backwards"]) == [0, 1]
    for state in ours["two_backwards"].values():
        assert_close(alone[0], state, TOLERANCE)
    done, survived, _ = chameleon(tmp_path, "kill", "two_backwards", 1)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_close(alone[0], survived[0], TOLERANCE)


@pytest.mark.timeout(90)  # 8 s measured; 21 s with a core busy
def test_an_unused_parameter_without_the_flag_is_a_one_line_error(tmp_path):
    done, _ = torchrun(tmp_path, "ours", "chameleon", "unused", 2, "--no-find-unused")
    assert done.returncode != 0
    assert "'spare.weight'" in done.stderr and "find_unused_parameters=True" in done.stderr
    done, _, _ = chameleon(tmp_path, "kill", "unused", 1, "--no-find-unused")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "find_unused_parameters=True" in done.stdout + done.stderr


@pytest.mark.timeout(60)  # 4 s measured
def test_an_exception_on_a_member_ends_the_job_with_its_error(tmp_path):
    # On rank 0, the lowest-ranked member: its exit used to announce the end of
    # training, and the other member exited 0 early.
    done, finished, evs = chameleon(tmp_path, "raise", "plain", None, "--raise-at", "3")
    assert done.returncode == 1, done.stdout[-2000:]
    assert finished == {}, "a member ran past the error to the end"
    (failure,) = [e for e in evs if e["event"] == "failure" and e["rank"] == 0]
    assert "ValueError: a bug at step 3" in failure["message"]
    assert not [e for e in evs if e["event"] == "recovered"]


@pytest.mark.soak  # 2,000 steps (scripts/soak.sh); the heal itself is in CI in test_dropin
def test_replacements_heal_through_kills_of_either_rank(tmp_path):
    # BatchNorm, 2,000 steps, rank 1 killed at step 100 and rank 0 (the one that healed
    # the first replacement) at 1,600, each replaced and healed from the other. A heal
    # used to send the buffers as the interrupted step's forwards had left them:
    # BatchNorm's count ended one ahead.
    done, ddp = torchrun(tmp_path, "ddp", "ddp", "batchnorm", 2, "--steps", "2000")
    assert done.returncode == 0, done.stderr[-2000:]
    log = tmp_path / "soak.events"
    done = run(
        "run", "--standalone", "--nproc-per-node", "2", "--config", str(devices_config(tmp_path)),
        "--max-rejoins", "2", "--events", str(log),
        "--inject-fault", "kill:rank=1,step=100", "--inject-fault", "kill:rank=0,step=1600",
        SCRIPT, "--mode", "chameleon", "--habit", "batchnorm", "--steps", "2000",
        "--check-every", "50", "--out", str(tmp_path / "soak"), cwd=tmp_path, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    evs = events(log)
    assert [e["ranks"] for e in evs if e["event"] == "rejoined" and e["taken_in"]][:1] == [[1]]
    survived = states(tmp_path, "soak")
    assert survived
    for state in survived.values():
        assert_close(ddp[0], state, TOLERANCE)


@pytest.mark.timeout(60)  # 9 s measured
def test_a_loop_that_counts_its_own_steps_ends_a_replacement_as_a_spare_does(tmp_path):
    # The replacement's own count starts at 0, so its loop goes on after the others end
    # (it stepped with them from the job's step on: its weights are the job's). It does
    # not train on alone: it ends as a spare does, said in one line; the job exits 0.
    done = run(
        "run", "--standalone", "--nproc-per-node", "2", "--config", str(devices_config(tmp_path)),
        "--max-rejoins", "1", "--inject-fault", "kill:rank=1,step=100",
        SCRIPT, "--mode", "chameleon", "--habit", "plain", "--steps", "1500", "--own-count",
        "--out", str(tmp_path / "own"), cwd=tmp_path, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 1's loop went on after the job's last step (1499)" in done.stderr
    assert sorted(states(tmp_path, "own")) == [0]  # (not the code after the replacement's loop)
