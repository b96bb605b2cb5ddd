"""``--inject-fault slow``: a real worker slowed from outside its process
(launcher/throttle.py). Its steps are bound by their compute (MLP_PASS_SPIN_S: CPU time,
as a device's work), so a worker that runs a third of the time takes about three times
as long, and its peer waits for it: the job slows, nothing fails, nobody is judged hung,
and the job's pace comes back when the slowdown ends. With ``--stragglers off``: the
slowdown as it is, not planned around (tests/runtime/test_stragglers.py)."""

from __future__ import annotations

import statistics

import pytest

from launcher.throttle import MAX_BOOST
from tests.launcher.helpers import events, leftovers, run
from tests.runtime.test_liveness import MLP

pytestmark = pytest.mark.slow

STEPS = 120
FOR_S = 3.0


def step_times(tmp_path, rank: int) -> dict[int, float]:
    lines = (tmp_path / f"steps.rank{rank}").read_text().split("\n")
    return {int(step): float(t) for _pid, step, t in (ln.split() for ln in lines if ln)}


@pytest.mark.solo  # (steps after the slowdown as fast as before it)
@pytest.mark.timeout(60)  # 9 s measured
def test_a_slowed_worker_slows_the_job_for_the_slowdown_and_no_longer(tmp_path):
    done = run(
        "run", "--standalone", "--nproc-per-node", "2", "--heartbeat-timeout", "3",
        "--events", str(tmp_path / "ev.jsonl"), "--stragglers", "off",  # (the fault alone)
        "--inject-fault", f"slow:rank=1,factor=3,step=20,for={FOR_S:g}",
        MLP, "--steps", str(STEPS), "--stages", "1",
        cwd=tmp_path, timeout=120,
        env={"MLP_PASS_SPIN_S": "0.01", "MLP_STEP_LOG": str(tmp_path / "steps")},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert leftovers(tmp_path) == []
    evs = events(tmp_path / "ev.jsonl")
    assert not [e for e in evs if e["event"] == "failure"]
    (injected,) = [e for e in evs if e["event"] == "fault_injected"]
    assert injected["kind"] == "slow" and injected["rank"] == 1
    (ended,) = [e for e in evs if e["event"] == "slowdown_ended"]
    assert ended["factor"] == 3 and ended["lasted_s"] == pytest.approx(FOR_S, abs=0.3)
    # Its work took about 3x what its peer's pace would have (the throttle's own account:
    # wall time per second of work), and the boost stayed within its bounds.
    assert ended["reached"] >= 0.9 * 3, ended
    assert 1.0 <= ended["boost"] <= ended["boost_max"] <= MAX_BOOST, ended
    assert ended["priority"] in ("realtime", "nice", "normal"), ended
    at = step_times(tmp_path, 0)
    began, over = injected["t"], injected["t"] + ended["lasted_s"]

    def gap(lo: float, hi: float) -> float:  # median time between steps done in [lo, hi)
        done_at = sorted(t for t in at.values() if lo <= t < hi)
        return statistics.median(b - a for a, b in zip(done_at, done_at[1:]))

    before = gap(at[5], began)
    during = gap(began + 0.3, over)
    after = gap(over + 0.3, max(at.values()) + 1)
    print(
        f"step every {before * 1e3:.0f} ms, slowed {during * 1e3:.0f} ms, after {after * 1e3:.0f} ms"
    )
    # 3x on an idle machine, where each worker has a core; with a core kept busy the
    # steps before are slowed by the third process too and the stopped worker, running,
    # has a core to itself: 1.5x seen. The job is slowed, then as fast as before.
    assert during >= 1.25 * before
    assert after <= 1.4 * before
    # The slowed worker is found by its passes' wall time against its peer's, and found
    # recovered after; the peer it holds up is not taken for a straggler.
    found = [e for e in evs if e["event"] in ("straggler", "straggler_recovered")]
    print([(e["event"], e["rank"], e["factor"], round(e["t"] - began, 2)) for e in found])
    assert [(e["event"], e["rank"]) for e in found] == [
        ("straggler", 1),
        ("straggler_recovered", 1),
    ]
    slow, back = found
    # Found at an early factor (the pace median still mixes steps from before the
    # slowdown: 1.92 once on CI's loaded host), but at its worst it shows the slowdown.
    assert slow["factor"] >= 1.5 and back["worst_factor"] >= 2.0
    assert back["worst_factor"] >= slow["factor"]
    assert began < slow["t"] < over and back["t"] > over
    assert "Stragglers" in done.stderr  # the run's summary (on stderr) has the row
