"""Bounded state, end to end (tests/runtime/mlp.py): the store's key count does not grow
with steps, and a survivor's file descriptors and threads do not grow with recoveries.
The launcher's ``step`` events carry both (the store's key count; the lowest live rank's
fds and threads, from its heartbeat)."""

import statistics

import pytest

from tests.runtime.test_liveness import named, run_mlp

pytestmark = pytest.mark.slow


# Step events are sampled by time (at most one a second, and the job's last), so the run
# is made to last: its steps sleep SLEEP_S in all, so that the early window (8-40% of the
# steps) spans about 3 s however fast the machine is (a fast one ran 600 bare steps in two
# seconds and had no sample in it).
SLEEP_S = 9.0


@pytest.mark.parametrize(
    "steps", [300, pytest.param(2500, marks=pytest.mark.soak)], ids=["300", "2500-soak"]
)
@pytest.mark.timeout(90)  # 12 s measured
def test_the_store_does_not_grow_with_steps(tmp_path, steps):
    result, evs, _ = run_mlp(
        tmp_path, "long", workers=2, steps=steps, args=("--stages", "2"),
        extra_env={"MLP_STEP_SLEEP_S": str(SLEEP_S / steps)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    counts = [(e["step"], e["store_keys"]) for e in named(evs, "step")]
    assert counts[-1][0] == steps - 1, counts  # the job's last step is always told
    # A sample may catch one more step's keys in flight: compare each window's median
    # (300 steps: 24-120 against 240 on; the leak this caught grew 4 keys a step).
    early = [k for step, k in counts if 0.08 * steps <= step < 0.4 * steps]
    assert early, f"no step event between steps {0.08 * steps:.0f} and {0.4 * steps:.0f}: {counts}"
    late = statistics.median(k for step, k in counts if step >= 0.8 * steps)
    # Growth with steps, not a key or two written once: the end marks of the workers that
    # finished first (chameleon_runtime/control.py end), one per injected failpoint, and
    # once (a loaded host, a stage found slow and back twice) 17 keys to 19 at step 275.
    # Between the windows lie 0.4 of the steps (120 here): a leak of one key per 40 steps
    # is past this bar; the leak this caught grew 4 keys every step.
    assert late - statistics.median(early) <= 2, counts


@pytest.mark.timeout(60)  # 10 s measured
def test_a_survivors_threads_and_files_do_not_grow_with_recoveries(tmp_path):
    # Eight data-parallel workers; six of them die one after another: six recoveries.
    kills = [f"kill:rank={r},step={10 + 12 * i}" for i, r in enumerate((7, 6, 5, 4, 3, 2))]
    flags = [x for k in kills for x in ("--inject-fault", k)]
    result, evs, _ = run_mlp(
        tmp_path, "many", "--max-rejoins", "0", "--policy", "reroute", *flags, workers=8,
        steps=110, extra_env={"MLP_STEP_SLEEP_S": "0.03"}, args=("--stages", "1"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    recovered = named(evs, "recovered")
    assert len(recovered) == 6
    steps = named(evs, "step")

    def settled_after(i):
        """Rank 0's figures on the last step event before the next recovery began."""
        until = recovered[i + 1]["t"] if i + 1 < len(recovered) else float("inf")
        later = [e for e in steps if recovered[i]["t"] < e["t"] < until and e["rank"] == 0]
        return later[-1]

    first, last = settled_after(0), settled_after(5)
    # Before: +7 threads and +6 descriptors each recovery (a group leaked every time).
    assert last["threads"] <= first["threads"] + 1, (first, last)
    assert last["fds"] <= first["fds"] + 2, (first, last)
