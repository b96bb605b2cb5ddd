"""The replicas' consistency check (chameleon_runtime.consistency): one replica's weights
moved by hand after a step (a bit flip, a bug) is found at the next check and healed from
the majority, or, with no majority, the job stops with a one-line error."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher.helpers import env, leftovers, run
from tests.runtime.test_habits import assert_close, states

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "runtime" / "habits_script.py")

pytestmark = pytest.mark.slow


def chameleon(tmp: Path, name: str, workers: int, *extra: str):
    done = run(
        "run", "--standalone", "--nproc-per-node", str(workers), SCRIPT, "--mode", "chameleon",
        "--global-batch", str(8 * workers), "--out", str(tmp / name), *extra,
        cwd=tmp, timeout=240,
    )  # fmt: skip
    assert leftovers(tmp) == []
    return done, states(tmp, name)


@pytest.fixture(scope="module")
def ddp3(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp3")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
         SCRIPT, "--mode", "ddp", "--global-batch", "24", "--out", str(tmp / "ddp")],
        cwd=tmp, env={**env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((tmp / "ddp.rank0.json").read_text())["state"]


def test_a_drifted_replica_is_healed_from_the_majority_at_the_next_check(tmp_path, ddp3):
    # Moved after step 5, checked at every step: healed before it computes a gradient,
    # so the run ends on plain DDP's weights.
    done, ours = chameleon(tmp_path, "every", 3, "--check-every", "1", "--perturb", "1,5")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        "replica consistency check at step 5: rank(s) [1] held weights different from the "
        "others' (first in 'head.bias'); healed from rank 0"
    ) in done.stdout + done.stderr
    assert sorted(ours) == [0, 1, 2]
    for state in ours.values():
        assert_close(ddp3, state, 1e-9)


def test_the_check_finds_a_drift_within_its_interval(tmp_path):
    # Checked every 4 steps: moved after step 5, found at step 8; the replicas agree to
    # the bit from then on (steps 6 and 7 were trained on the drifted replica's
    # gradients too, which no check can undo).
    done, ours = chameleon(tmp_path, "four", 3, "--check-every", "4", "--perturb", "2,5")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "check at step 8: rank(s) [2]" in done.stdout + done.stderr
    assert ours[0] == ours[1] == ours[2]


def test_two_replicas_that_disagree_stop_the_job(tmp_path):
    done, ours = chameleon(tmp_path, "two", 2, "--check-every", "4", "--perturb", "1,5")
    assert done.returncode == 1
    assert ours == {}
    assert (
        "replicas hold different weights at step 8 (ranks [0, 1] fall into 2 groups; first "
        "difference in 'head.bias') and no majority says which are right: stopped"
    ) in done.stdout + done.stderr


def test_the_check_heals_under_plain_torchrun_too(tmp_path, ddp3):
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
         SCRIPT, "--mode", "chameleon", "--global-batch", "24", "--check-every", "1",
         "--perturb", "0,5", "--out", str(tmp_path / "tr")],
        cwd=tmp_path, env={**env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rank(s) [0] held weights different" in done.stderr
    for state in states(tmp_path, "tr").values():
        assert_close(ddp3, state, 1e-9)
