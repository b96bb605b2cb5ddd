"""launcher/stragglers.py: a slow worker told from a slow step and from noise, with
hysteresis; and the pace a worker reports its speed by (chameleon_runtime.pace)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from chameleon_runtime.pace import WARMUP_STEPS, Pace
from chameleon_runtime.protocol.messages import WorkerStatus
from launcher import recovery as rc
from launcher.planning import Planner
from launcher.stragglers import SpeedWatch, Stragglers, factors, unit_costs
from planner.choice.stragglers import dealt_unevenly
from planner.plans.plan import pipelines_plan
from tests.synthetic import uniform_job


def test_a_factor_is_against_the_others_median_so_two_workers_compare():
    assert factors({0: 1.0, 1: 3.0}) == {0: pytest.approx(1 / 3), 1: pytest.approx(3.0)}
    f = factors({0: 1.0, 1: 1.1, 2: 0.9, 3: 2.0})
    assert f[3] == pytest.approx(2.0) and f[0] == pytest.approx(1 / 1.1)
    assert factors({0: 1.0}) == {}  # a lone worker has no peer to be slow against


def test_a_stages_replicas_are_its_peers_whatever_the_cost_table_says():
    """Two pipelines of two stages, rank 1 (stage 1 of the first) slowed 3x: stage 1's
    layers are cheap in the table but cost the runtime's own per-pass time, so against
    stage 0 it would look slow, rank 3 too; against its replica only rank 1 is."""
    raw = {0: 0.006, 1: 0.003, 2: 0.006, 3: 0.001}  # seconds per micro-batch, measured
    rates = {0: 1.0, 1: 30.0, 2: 1.0, 3: 10.0}  # ... over the table's cost of the layers
    holds = {0: (0, 2), 1: (2, 4), 2: (0, 2), 3: (2, 4)}
    assert factors(rates)[3] > 1.3  # (what the table alone would say)
    f = factors(rates, holds, raw)
    assert f[1] == pytest.approx(3.0) and f[3] < 1.0 and f[0] == f[2] == 1.0
    # a stage without replicas is compared by the table's rates with everyone
    assert factors({0: 1.0, 1: 2.0}, {0: (0, 2), 1: (2, 4)}, {0: 5.0, 1: 0.1})[1] == 2.0
    # a stage whose replicas are not judged (their passes too brief) is not judged either
    f = factors({0: 1.0, 1: 30.0, 2: 1.0}, holds, raw)
    assert 1 not in f and f[0] == 1.0


def test_a_slow_worker_is_found_once_and_recovered_once_with_hysteresis():
    watch = Stragglers()
    everyone = {0, 1, 2, 3}
    assert watch.look({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}, everyone) == []
    (found,) = watch.look({0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0}, everyone)
    assert (found.rank, found.recovered, found.factor) == (3, False, 2.0)
    assert watch.found == {3: 2.0}
    assert watch.look({0: 1.0, 1: 1.0, 2: 1.0, 3: 2.1}, everyone) == []  # said once
    # between the bars: still a straggler (no flapping around one threshold)
    assert watch.look({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.35}, everyone) == []
    assert watch.found == {3: 1.35}
    # one look under the bar is not yet back to speed (a dip mid-slowdown), two are
    assert watch.look({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.05}, everyone) == []
    assert watch.look({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.5}, everyone) == []  # the dip ended
    assert watch.look({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.1}, everyone) == []
    (back,) = watch.look({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.05}, everyone)
    assert (back.rank, back.recovered) == (3, True) and watch.found == {}
    assert back.worst == 2.1  # the largest factor while slow, not the one it was found at
    assert watch.worst == {}


def test_a_slow_step_is_no_straggler():
    watch = Stragglers()
    assert watch.look({0: 3.0, 1: 3.1, 2: 2.9}, {0, 1, 2}) == []


def test_a_stale_rate_neither_confirms_nor_clears():
    watch = Stragglers(confirm=2)
    assert watch.look({0: 1.0, 1: 3.0}, {0, 1}) == []
    assert watch.look({0: 1.0, 1: 3.0}, {0}) == []  # rank 1 ran no step since: no look
    assert [f.rank for f in watch.look({0: 1.0, 1: 3.0}, {0, 1})] == [1]
    assert watch.forget({1, 5}) == [1] and watch.found == {}


def test_rates_are_per_unit_of_modelled_work_so_unequal_stages_compare():
    # stage 0 holds layers costing 3 per micro-batch, stage 1 layers costing 1
    units = unit_costs({0: (0, 2), 1: (2, 3)}, [1.0, 2.0, 1.0])
    assert units == {0: 3.0, 1: 1.0}
    assert unit_costs({0: (0, 1), 1: (1, 2)}, [0.0, 0.0]) == {0: 1.0, 1: 1.0}
    watch = SpeedWatch()

    def status(step: int, per_mb: float, paced: int = 8) -> WorkerStatus:
        return WorkerStatus(
            pid=1, beat=step, phase="train", generation=0, step=step, progress=step,
            busy_s_per_mb=per_mb, pace_steps=paced,
        )  # fmt: skip

    # a generation's first steps: too few for a median, nobody judged
    assert watch.observe({0: status(4, 0.3, 2), 1: status(4, 0.9, 2)}, 0, units) == []
    # stage 0 takes 3x as long per micro-batch as stage 1: what its layers cost, no more
    assert watch.observe({0: status(5, 0.3), 1: status(5, 0.1)}, 0, units) == []
    (found,) = watch.observe({0: status(6, 0.3), 1: status(6, 0.25)}, 0, units)
    assert found.rank == 1 and found.factor == pytest.approx(2.5)
    # no new step: nothing judged; another generation's status: not compared
    assert watch.observe({0: status(6, 0.3), 1: status(6, 0.1)}, 0, units) == []
    assert watch.observe({0: status(7, 0.3), 1: status(7, 0.1)}, 1, units) == []


def test_the_pace_reports_the_median_time_a_micro_batch_took():
    pace = Pace()
    assert pace.means() == {"pace_steps": 0}  # not warm: no pace of this generation
    for _ in range(WARMUP_STEPS):
        pace.add(0, 1.0, 1.0, 1.0, 0.0, busy_s=9.0, micro_batches=1)  # warm-up: left out
    for busy in (0.2, 0.2, 0.2, 2.0):  # one step paused (a collection): not its speed
        pace.add(0, 1.0, 1.0, 1.0, 0.0, busy_s=busy, micro_batches=2)
    assert pace.means()["busy_s_per_mb"] == pytest.approx(0.1)
    assert pace.means()["pace_steps"] == 4
    pace.add(0, 1.0, 1.0, 1.0)  # a step without micro-batches (a spare's): no rate of it
    assert pace.means()["busy_s_per_mb"] == pytest.approx(0.1)


def test_the_pass_clock_times_passes_only_and_starts_afresh_after_a_take():
    import time

    import torch

    from chameleon_runtime.pace import PassClock

    clock = PassClock(torch.device("cpu"))
    began = clock.start()
    time.sleep(0.02)
    clock.stop(began)
    time.sleep(0.05)  # (a wait in the step's sums: not a pass)
    began = clock.start()
    time.sleep(0.01)
    clock.stop(began)
    assert 0.03 <= clock.take() < 0.06
    assert clock.take() == 0.0


def test_a_redeal_that_rounds_to_even_counts_is_the_even_deal_and_says_so():
    """Dealt again at a factor near the recovered bar, the deal's counts come out even:
    the planner's thread names that move the even deal. Named "uneven deal", it left the
    watch (which reads an even plan as nobody's) with no move back to tell, and the log
    with none (seen in CI: the last move "uneven deal: worker 1: 4 of 8")."""
    job = uniform_job(dp=2, pp=1, micro_batches=8)
    dealt = pipelines_plan(
        num_layers=8, num_micro_batches=8, pipelines=[[0], [1]],
        boundaries=[[0, 8], [0, 8]], micro_batch_counts=[6, 2],
    )  # fmt: skip
    assert dealt_unevenly(dealt)
    planner = Planner(model=None, policy="auto", gone=set(), emit=print, attempt=0)

    def replan(factor: float) -> dict:
        start = rc.StartPlanning(
            generation=3, base=2, failed=(), idle=(), resume_step=40, reached=40,
            replan=rc.Replan(slow=((1, factor),), horizon_s=30.0),
        )  # fmt: skip
        return planner._replan(start, dealt, replace(job, slow=()))

    try:
        near = replan(1.2)
        assert not dealt_unevenly(near["plan"]) and near["label"] == "even deal", near["label"]
        slow = replan(3.0)
        assert dealt_unevenly(slow["plan"]) and slow["label"].startswith("uneven deal: worker 1")
    finally:
        planner.close()


def test_the_leader_looks_every_few_steps_more_often_while_a_straggler_is_found():
    from launcher.stragglers import LOOK_MIN_S, LOOK_QUIET_MIN_S, LOOK_STEPS

    def statuses(step_s: float) -> dict[int, WorkerStatus]:
        return {
            r: WorkerStatus(pid=1, beat=1, phase="train", generation=0, step=9, progress=9,
                            mean_step_s=step_s)
            for r in (0, 1)
        }  # fmt: skip

    watch = SpeedWatch()
    # A fast job, none found: a quarter of a second (a second let a job of 30 steps a
    # second go 21-25 steps before it moved); a slow one: the period, never longer.
    assert watch.look_period_s(statuses(0.03), 1.0) == LOOK_QUIET_MIN_S
    assert watch.look_period_s(statuses(0.2), 1.0) == pytest.approx(LOOK_STEPS * 0.2)
    assert watch.look_period_s(statuses(18.0), 1.0) == 1.0
    assert watch.look_period_s({}, 1.0) == 1.0  # (no step measured yet)
    # One found: every few steps, down to a tenth of a second.
    watch.stragglers.found[1] = 3.0
    assert watch.look_period_s(statuses(0.03), 1.0) == LOOK_MIN_S
    assert watch.look_period_s(statuses(0.2), 1.0) == pytest.approx(LOOK_STEPS * 0.2)
