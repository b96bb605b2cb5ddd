"""The replicas' consistency check (chameleon_runtime.consistency): one replica's weights
moved by hand after a step (a bit flip, a bug) is found at the next check and healed from
the majority, or, with no majority, the job stops with a one-line error."""

from pathlib import Path

import pytest

from tests.runtime import test_habits
from tests.runtime.test_habits import assert_close

pytestmark = pytest.mark.slow


def chameleon(tmp: Path, name: str, workers: int, *extra: str):
    done, states, _ = test_habits.chameleon(
        tmp, name, "plain", None, "--global-batch", str(8 * workers), *extra, workers=workers
    )
    return done, states


@pytest.fixture(scope="module")
def ddp3(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp3")
    done, states = test_habits.torchrun(tmp, "ddp", "ddp", "plain", 3, "--global-batch", "24")
    assert done.returncode == 0, done.stderr[-2000:]
    return states[0]


@pytest.mark.timeout(90)  # 10 s measured; 22 s with a core busy
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


@pytest.mark.timeout(60)  # 4 s measured
def test_the_check_finds_a_drift_within_its_interval(tmp_path):
    # Checked every 4 steps: moved after step 5, found at step 8; the replicas agree to
    # the bit from then on (steps 6 and 7 were trained on the drifted replica's
    # gradients too, which no check can undo).
    done, ours = chameleon(tmp_path, "four", 3, "--check-every", "4", "--perturb", "2,5")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "check at step 8: rank(s) [2]" in done.stdout + done.stderr
    assert ours[0] == ours[1] == ours[2]


@pytest.mark.timeout(60)  # 4 s measured
def test_two_replicas_that_disagree_stop_the_job(tmp_path):
    done, ours = chameleon(tmp_path, "two", 2, "--check-every", "4", "--perturb", "1,5")
    assert done.returncode == 1
    assert ours == {}
    assert (
        "replicas hold different weights at step 8 (ranks [0, 1] fall into 2 groups; first "
        "difference in 'head.bias') and no majority says which are right: stopped"
    ) in done.stdout + done.stderr


@pytest.mark.timeout(60)  # 6 s measured
def test_the_check_heals_under_plain_torchrun_too(tmp_path, ddp3):
    done, states = test_habits.torchrun(
        tmp_path, "tr", "chameleon", "plain", 3, "--global-batch", "24", "--check-every", "1",
        "--perturb", "0,5",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rank(s) [0] held weights different" in done.stderr
    for state in states.values():
        assert_close(ddp3, state, 1e-9)
