"""A slow worker planned around in a live run (launcher/stragglers.py,
planner.choice.stragglers): a drop-in float64 loop (tests/runtime/straggler_script.py),
one of its two workers slowed 3x from outside its process (``--inject-fault slow``). The
job moves to an uneven deal within 20 steps of the slowdown, back to the even one within
20 steps of finding the worker back to speed, loses no step, and ends with the weights of
the run without the slowdown. With ``--stragglers off`` it is only told; a slowdown that
comes and goes faster than a move pays for moves nothing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from chameleon_runtime.protocol.messages import WorkerStatus
from launcher.recovery_events import Replan
from launcher.stragglers import SpeedWatch
from tests.clock import slack
from tests.launcher.helpers import events, leftovers, run

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "runtime" / "straggler_script.py")
# Past the 7 s slowdown (below) with room to deal evenly again, however fast the host: a
# job planned around its slow worker runs near full speed, and one CI host's 180 steps
# were over before the slowdown was (found slow, never back).
STEPS = 260
TOLERANCE = 1e-9


def train(tmp: Path, name: str, *launch: str) -> tuple[list[dict], dict]:
    done = run(
        "run", "--standalone", "--nproc-per-node", "2", "--events", str(tmp / f"{name}.ev"),
        *launch, SCRIPT, "--steps", str(STEPS), "--out", str(tmp / name),
        "--log", str(tmp / f"{name}.steps"), cwd=tmp, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert leftovers(tmp) == []
    weights = {r: json.loads((tmp / f"{name}.rank{r}.json").read_text())["state"] for r in (0, 1)}
    return events(tmp / f"{name}.ev"), weights


def relative(a: dict, b: dict) -> float:
    worst = 0.0
    for key, want in a.items():
        diff = math.sqrt(sum((x - y) ** 2 for x, y in zip(want, b[key], strict=True)))
        worst = max(worst, diff / (math.sqrt(sum(x * x for x in want)) or 1.0))
    return worst


def step_at(tmp: Path, name: str, t: float) -> int:
    """The steps rank 0 had done at time ``t``."""
    lines = (tmp / f"{name}.steps.rank0").read_text().split("\n")
    return max([int(s) for s, when in (ln.split() for ln in lines if ln) if float(when) <= t] + [0])


def found_slow(log: list[dict], t: float) -> set[int]:
    """The ranks the job had found slow, and not back to speed, at time ``t``."""
    slow: set[int] = set()
    for e in log:
        if e["t"] < t and e["event"] == "straggler":
            slow.add(e["rank"])
        elif e["t"] < t and e["event"] == "straggler_recovered":
            slow.discard(e["rank"])
    return slow


def moves(log: list[dict]) -> list[dict]:
    return [e for e in log if e["event"] == "plan_chosen" and e.get("generation", 0) >= 1]


@pytest.mark.slow
@pytest.mark.solo  # (the slowed worker's speed against its peer's)
@pytest.mark.timeout(120)  # 25 s measured (two runs of 260 steps); 37 s with a core busy
def test_a_slowed_worker_is_dealt_fewer_micro_batches_and_the_weights_do_not_change(tmp_path):
    _, free = train(tmp_path, "free")
    # 7 s of slowdown: 110 steps idle, about 80 with a core busy, where the move took 47
    # (with 4 s, 45 steps: the slowdown was over before the job had moved; seen in CI)
    log, slowed = train(
        tmp_path, "slow", "--inject-fault", "slow:rank=1,factor=3,step=15,for=7"
    )  # fmt: skip
    assert not [e for e in log if e["event"] == "failure"]
    # Dealt again when the factor the first deal was made on drifts (twice at most per
    # slowdown). On a busy host (one to three other processes spinning, here), what the
    # job measures is not the injected slowdown alone: the worker sharing a core with them is
    # slower, a real noisy neighbour, and which worker that is moves as the scheduler
    # balances (seen: rank 1 found slow again at 1.5x 40 steps after the slowdown ended;
    # rank 0 found slow and dealt 3 of 8; the slowed rank "recovered" at step 62 of a
    # slowdown that lasted to 103, found again, and left even as the move no longer
    # paid). So each move is checked against what the job had measured: an uneven deal
    # only away from workers found slow before it, an even deal within 20 steps of the
    # last one found back to speed. How soon it is found back once the slowdown ends is
    # benchmarks/stragglers.py's figure on a quiet host, and SpeedWatch's pure tests'.
    every = moves(log)
    assert every and len(every) <= 8, every
    there = every[0]
    # (how uneven: by the speed measured, 6/2 or 5/3 of the 8 micro-batches here; 7/1
    # when the host is busy enough to slow the stopped worker's passes more still)
    uneven = ({"0": 7, "1": 1}, {"0": 6, "1": 2}, {"0": 5, "1": 3})
    assert there["label"].startswith("uneven deal") and there["load"] in uneven, there
    for move in every:
        # (found slow before the move; one may be found back to speed between the look
        # that asked for the move and its event)
        found = {e["rank"] for e in log if e["event"] == "straggler" and e["t"] < move["t"]}
        fewer = {int(r) for r, n in move["load"].items() if n < 4}
        if move["label"].startswith("uneven deal"):
            # (away from the workers the move names as slow, which the job had found so)
            named = {int(r) for r in move["slow"]}
            assert fewer and fewer <= named <= found, (move, found)
            assert sum(move["load"].values()) == 8 and min(move["load"].values()) >= 1, move
        else:
            assert move["label"] == "even deal" and move["load"] == {"0": 4, "1": 4}, move
    # ... and back: an even deal after the first uneven one, and after every time the
    # job found its last slow worker back to speed while dealt unevenly, within the
    # product's 20 steps (with the suite's margin), unless the run ended first.
    assert any(m["label"] == "even deal" for m in every[1:]), every
    for back in (e for e in log if e["event"] == "straggler_recovered"):
        before = [m for m in every if m["t"] < back["t"]]
        if found_slow(log, back["t"] + 1e-6) or not before or before[-1]["label"] == "even deal":
            continue
        at = step_at(tmp_path, "slow", back["t"])
        evened = [m for m in every if m["t"] > back["t"] and m["label"] == "even deal"]
        if STEPS - at > slack(20):
            assert evened and evened[0]["resume_step"] - at <= slack(20), (back, every)
    recovered = [e["steps_lost"] for e in log if e["event"] == "recovered"]
    assert recovered == [0] * len(every), recovered
    (began,) = [e for e in log if e["event"] == "fault_injected"]
    (ended,) = [e for e in log if e["event"] == "slowdown_ended"]
    slow_from = step_at(tmp_path, "slow", began["t"])
    slow_to = step_at(tmp_path, "slow", ended["t"])
    print(
        f"slowed at step {slow_from}, dealt unevenly from {there['resume_step']}; "
        f"back to speed at {slow_to}; moves: "
        + ", ".join(f"{m['label']} from {m['resume_step']}" for m in every)
    )
    # Planned around while the worker is still slow, and soon: the product's figure is
    # 20 steps (7 and 9 on an idle machine), with the suite's margin for a shared core
    # (tests/clock.py: 31 steps seen with one core busy).
    assert slow_from < there["resume_step"] < slow_to
    assert there["resume_step"] - slow_from <= slack(20)
    for rank in (0, 1):
        assert relative(free[0], slowed[rank]) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.soak  # (scripts/soak.sh: the drop-in's uneven deal is in CI; this is the Trainer's)
@pytest.mark.solo  # (the slowed worker's speed against its peer's)
@pytest.mark.timeout(90)  # 27 s measured
def test_a_slowed_pipeline_stage_is_dealt_fewer_micro_batches_by_the_trainer(tmp_path):
    """The Trainer (tests/runtime/mlp.py, passes bound by their compute): two pipelines of
    two stages, the first stage of the second slowed 3x. Its pipeline is dealt fewer
    micro-batches while it is slow, and the same again after; exact sums (``--exact``:
    float64, any order) end with the failure-free run's weights bit for bit."""
    mlp = str(ROOT / "tests" / "runtime" / "mlp.py")

    def fit(name: str, *launch: str) -> tuple[list[dict], dict]:
        done = run(
            "run", "--standalone", "--nproc-per-node", "4", "--events", str(tmp_path / name),
            *launch, mlp, "--steps", "200", "--stages", "2", "--global-batch", "16",
            "--exact", "--dump", str(tmp_path / name), cwd=tmp_path, timeout=180,
            env={"MLP_PASS_SPIN_S": "0.005"},
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        dump = json.loads((tmp_path / f"{name}.rank0.json").read_text())
        return events(tmp_path / name), dump["checksums"]

    _, free = fit("free")
    # (4 workers on this host's 2 cores: planned around only when asked, --stragglers on)
    log, slowed = fit(
        "slow", "--stragglers", "on", "--inject-fault", "slow:rank=2,factor=3,step=15,for=4"
    )
    there, *again, back = moves(log)
    assert len(again) <= 2, moves(log)  # (dealt again as the factor settles)
    for deal in (there, *again):
        assert "2" in deal["slow"], deal  # (around the slowed stage, whoever else)
        load = deal["load"]  # (how uneven: by the speed measured, 5/3 or 6/2 here)
        assert load["0"] == load["1"] > load["2"] == load["3"], deal
        assert sum(load.values()) == 16, deal
    assert back["load"] == {"0": 4, "1": 4, "2": 4, "3": 4}
    # The slowed stage is found; on 2 cores another worker's share of them may dip long
    # enough to be told too (seen once in CI: rank 1), but every deal above is around
    # the slowed pipeline: a dip is not planned around.
    flagged = [e["rank"] for e in log if e["event"] == "straggler"]
    assert 2 in flagged, flagged
    assert slowed == free


@pytest.mark.slow
@pytest.mark.solo  # (the slowed worker's speed against its peer's)
@pytest.mark.timeout(60)  # 9 s measured
def test_with_stragglers_off_a_slowed_worker_is_told_not_planned_around(tmp_path):
    log, _ = train(
        tmp_path, "off", "--stragglers", "off",
        "--inject-fault", "slow:rank=1,factor=3,step=15,for=3",
    )  # fmt: skip
    (began,) = [e for e in log if e["event"] == "fault_injected"]
    (ended,) = [e for e in log if e["event"] == "slowdown_ended"]
    told = [e for e in log if e["event"] == "straggler"]
    # Told, and once while it lasted. (A telling after it is the host's: with a core kept
    # busy by another process, the worker that shares its core is slower, and is told so;
    # CI saw rank 1 at 1.58x 0.3 s after the injected slowdown had ended.)
    assert told and told[0]["rank"] == 1 and told[0]["t"] >= began["t"]
    assert [e for e in told[1:] if e["t"] <= ended["t"]] == []
    assert moves(log) == []


# (scripts/soak.sh: a solo test, its machine's whole time; that a brief slowdown never
# pays for a move is in CI as the planner's break-even and SpeedWatch's pure tests)
@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.solo  # (the slowed worker's speed against its peer's)
@pytest.mark.timeout(60)  # 8 s measured
def test_slowdowns_briefer_than_a_move_pays_for_move_nothing(tmp_path):
    """A worker slowed again and again, for two or three steps each time: the job never
    leaves its even deal, so it never oscillates between deals."""
    flaps = [f"slow:rank=1,factor=3,step={s},for=0.08" for s in (15, 40, 65, 90, 115)]
    log, _ = train(tmp_path, "flap", *(x for f in flaps for x in ("--inject-fault", f)))
    assert len([e for e in log if e["event"] == "slowdown_ended"]) == 5
    assert moves(log) == []


def test_a_deal_made_on_an_early_factor_is_dealt_again_once_the_factor_settles():
    """SpeedWatch.move (pure): planned around at 1.7x (a median still mixing steps from
    before the slowdown), the worker settles at 3x: judged again, against the running
    deal, and dealt again when that pays. A factor within REDEAL_DRIFT of the deal's asks
    nothing; a refusal is asked again at the next look (as a first move is); another
    worker found slow is judged over its own slowdown's length; MAX_REDEALS bounds the
    deals of one slowdown."""
    from launcher.stragglers import MAX_REDEALS, REDEAL_DRIFT

    watch = SpeedWatch()
    asked = []
    pays = [True]

    def choose(slow, horizon_s):
        asked.append((slow, horizon_s))
        return pays[0]

    def reads(factors):  # what looks found: each factor held on two looks in a row
        watch.stragglers.found = dict(factors)
        watch.stragglers.steady = dict(factors)

    reads({1: 1.7})
    assert watch.move(100.0, False, choose) == Replan(slow=((1, 1.7),), horizon_s=0.0)
    reads({1: 1.7 * REDEAL_DRIFT * 0.95})  # not far enough
    assert watch.move(101.0, True, choose) is None
    assert len(asked) == 1
    reads({1: 3.0})
    watch.stragglers.steady = {}  # read once: it may be passing through
    assert watch.move(101.5, True, choose) is None
    assert len(asked) == 1
    reads({1: 3.0})
    pays[0] = False
    assert watch.move(102.0, True, choose) is None  # refused: the running deal stays
    pays[0] = True  # (the slowdown has lasted long enough now)
    assert watch.move(103.0, True, choose) == Replan(slow=((1, 3.0),), horizon_s=3.0)
    assert asked[1:] == [(((1, 3.0),), 2.0), (((1, 3.0),), 3.0)]
    assert watch.move(104.0, True, choose) is None  # dealt at 3x: nothing drifted
    assert len(asked) == 3
    # another straggler: over its own length (and at once: it was found on its own looks)
    watch.stragglers.found = {1: 3.0, 2: 2.0}
    assert watch.move(105.0, True, choose) == Replan(slow=((1, 3.0), (2, 2.0)), horizon_s=0.0)
    assert MAX_REDEALS == 2
    reads({1: 6.0, 2: 2.0})  # a third deal in one slowdown: not made
    assert watch.move(106.0, True, choose) is None
    assert len(asked) == 4
    reads({})
    assert watch.move(107.0, True, choose) == Replan(slow=(), horizon_s=0.0)
    # the next slowdown may be dealt again as often
    reads({1: 1.7})
    assert watch.move(110.0, False, choose) is not None
    reads({1: 3.0})
    assert watch.move(111.0, True, choose) is not None


def test_a_factor_passing_through_as_a_slowdown_ends_is_not_dealt_at():
    """Stragglers.look and SpeedWatch.move together: a worker dealt around at 4x whose
    slowdown ends reads, as its pace window drains, 1.4x for a look and then about 1:
    no deal is made at 1.4x (the job would move a third time, and its new generation's
    first steps go unjudged); it is said back and dealt evenly. A factor that holds on
    two looks is dealt again."""
    watch = SpeedWatch()
    asked = []

    def choose(slow, horizon_s):
        asked.append(slow)
        return True

    def look(step, factor):
        watch.observe(
            {r: status(step, busy, 4) for r, busy in ((0, 0.01), (1, 0.01 * factor))},
            generation=1, unit_s={0: 1.0, 1: 1.0},
        )  # fmt: skip

    def status(step, per_mb, mbs):
        return WorkerStatus(
            pid=1, beat=step, phase="train", generation=1, step=step, progress=step,
            busy_s_per_mb=per_mb, micro_batches=mbs, pace_steps=8,
        )  # fmt: skip

    moves = []
    for step, factor in [(10, 4.0), (13, 4.1), (16, 1.4), (19, 1.0), (22, 1.02), (25, 1.0)]:
        look(step, factor)
        moves.append(watch.move(float(step), bool(watch.moved), choose))
    assert moves[0] == Replan(slow=((1, 4.0),), horizon_s=moves[0].horizon_s)
    assert moves[1:4] == [None, None, None]
    assert moves[4] == Replan(slow=(), horizon_s=0.0)  # back: two looks under the bar
    assert asked == [((1, 4.0),)]
    # a slowdown that eases and holds there is dealt again
    for step, factor in [(40, 4.0), (43, 2.0), (46, 2.05)]:
        look(step, factor)
        moves.append(watch.move(float(step), bool(watch.moved), choose))
    assert moves[-3] is not None and moves[-2] is None
    assert moves[-1] == Replan(slow=((1, 2.05),), horizon_s=moves[-1].horizon_s)


def test_a_worker_dealt_lightly_is_back_under_the_slow_bar_not_dealt_again():
    """Stragglers.look and SpeedWatch.move together: a worker dealt 1 of 8 reads slower
    at full speed than its peer with 7 (its one pass after a long wait on a cold CPU:
    1.39-1.62x seen in the Trainer). Once its slowdown ends and it reads 1.45x on two
    looks it is said back and dealt evenly, not dealt again at 1.45x (nor at a 1.45x that
    held on two looks); on the even deal the same reading keeps a straggler a straggler
    (the recovered bar, 1.3x), and a look under one plan's bar and one under the next's
    are not two in a row."""
    from launcher.stragglers import dealt_lightly

    assert dealt_lightly({0: 7, 1: 1}) == {1} and dealt_lightly({0: 4, 1: 4}) == set()
    assert dealt_lightly({0: 3, 1: 3, 2: 2}) == set()  # an even deal of 8 over 3
    # peers are the workers holding the same layers: pipelines of 2 stages, 5 and 3 each
    holds = {0: (0, 2), 1: (2, 4), 2: (0, 2), 3: (2, 4)}
    assert dealt_lightly({0: 5, 1: 5, 2: 3, 3: 3}, holds) == {2, 3}

    def run(deal, factors, watch=None, generation=1):
        watch = watch or SpeedWatch()
        moves = []
        for step, factor in factors:
            dealt = deal if watch.moved else (4, 4)
            watch.observe(
                {r: _status(step, per_mb, mbs, generation) for r, per_mb, mbs in
                 ((0, 0.01, dealt[0]), (1, 0.01 * factor, dealt[1]))},
                generation=generation, unit_s={0: 1.0, 1: 1.0},
                load={0: dealt[0], 1: dealt[1]},
            )  # fmt: skip
            moves.append(watch.move(float(step), bool(watch.moved), lambda *_: True))
        return watch, moves

    slowdown = [(10, 4.0), (13, 4.1), (16, 4.2)]
    watch, moves = run((7, 1), [*slowdown, (19, 1.45), (22, 1.45)])
    assert moves[0] is not None and moves[0].slow == ((1, 4.0),)
    assert moves[1:4] == [None, None, None]
    assert moves[4] == Replan(slow=(), horizon_s=0.0)
    assert watch.stragglers.found == {}
    # 1.6x, then 1.45x: a factor that held (within REDEAL_DRIFT), far from 4x, one look
    # under the light bar: no deal at it; the next look says it back
    watch, moves = run((7, 1), [*slowdown, (19, 1.6), (22, 1.45), (25, 1.4)])
    assert watch.stragglers.found == {} and moves[3:] == [None, None, Replan((), 0.0)]
    # dealt 4 of 8 (evenly, say by a failure's plan) the same readings are a straggler's
    watch, moves = run((4, 4), [*slowdown, (19, 1.45), (22, 1.45)])
    assert watch.stragglers.found == {1: 1.45}
    assert all(m is None or m.slow for m in moves)
    # eased on the light deal to 1.6x, held: dealt evenly, still found; there it reads
    # 1.0x twice and is said back (no move), or 1.6x and is dealt around again at once
    # (its slowdown has lasted since step 10)
    eased = [*slowdown, (19, 1.6), (22, 1.6)]
    watch, moves = run((7, 1), eased)
    assert moves[3:] == [None, Replan((), 0.0)] and watch.stragglers.found == {1: 1.6}
    _, moves = run((4, 4), [(30, 1.0), (33, 1.0)], watch, generation=2)
    assert watch.stragglers.found == {} and moves == [None, None]
    watch, _ = run((7, 1), eased)
    _, moves = run((4, 4), [(30, 1.6)], watch, generation=2)
    assert moves[0].slow == ((1, 1.6),) and moves[0].horizon_s >= 20.0
    # ... and above EASED_LIGHT it is dealt again at the eased factor
    watch, moves = run((7, 1), [*slowdown, (19, 2.1), (22, 2.1)])
    assert moves[4] is not None and moves[4].slow == ((1, 2.1),)
    # a look under the light bar, then a failure's even plan: one look under 1.3x there
    # is one, not the second in a row
    watch, _ = run((7, 1), [*slowdown, (19, 1.45)])
    assert watch.stragglers.found == {1: 1.45}
    watch.move(20.0, False, lambda *_: True)  # (the failure's plan: even)
    run((4, 4), [(30, 1.25)], watch, generation=2)
    assert watch.stragglers.found == {1: 1.25}
    run((4, 4), [(33, 1.2)], watch, generation=2)
    assert watch.stragglers.found == {}


def _status(step, per_mb, mbs, generation=1):
    return WorkerStatus(
        pid=1, beat=step, phase="train", generation=generation, step=step, progress=step,
        busy_s_per_mb=per_mb, micro_batches=mbs, pace_steps=8,
    )  # fmt: skip


def test_after_a_failure_no_move_is_made_on_a_factor_read_before_it():
    """SpeedWatch (pure): dealt around a 4x worker when its peer fails, the failure's plan
    runs (even), then a rejoin's: the factor read before the failure is not dealt at
    again; a look in the new generation judges afresh (here: back to speed, no move)."""
    watch = SpeedWatch()

    def choose(slow, horizon_s):
        return True

    def look(generation, step, factor, paced=8, peer_paced=None):
        watch.observe(
            {
                r: WorkerStatus(
                    pid=1, beat=step, phase="train", generation=generation, step=step,
                    progress=step, busy_s_per_mb=0.01 * f, micro_batches=4, pace_steps=p,
                )
                for r, f, p in ((0, 1.0, paced if peer_paced is None else peer_paced),
                                (1, factor, paced))
            },
            generation=generation, unit_s={0: 1.0, 1: 1.0},
        )  # fmt: skip

    look(0, 10, 4.3)
    assert watch.move(10.0, False, choose) is not None  # dealt around rank 1
    look(3, 51, 4.3, paced=0)  # the failure's plan: too few steps to judge
    assert watch.move(11.0, False, choose) is None
    look(4, 63, 4.3, paced=0)  # a rejoin's plan, its first steps
    assert watch.move(12.0, False, choose) is None  # not dealt at the old 4.3x
    look(4, 66, 4.3, peer_paced=4)  # its own pace is read, its peer's not yet: no factor
    assert watch.move(12.5, False, choose) is None
    assert watch.stragglers.found == {1: 4.3}
    look(4, 70, 1.0)
    assert watch.move(13.0, False, choose) is None  # one look under the bar
    look(4, 73, 1.0)
    assert watch.stragglers.found == {} and watch.move(14.0, False, choose) is None
    # a factor read in the new generation is dealt at; a deal made again needs two of
    # its own looks to agree (not one of them and the last generation's)
    look(5, 80, 3.0)
    moved = watch.move(15.0, False, choose)
    assert moved is not None and moved.slow == ((1, 3.0),)
    look(5, 83, 6.0)  # (a look before the deal's generation runs)
    assert watch.move(15.5, True, choose) is None
    look(6, 90, 6.0)  # the deal's generation: its first look, at 6x
    assert watch.stragglers.steady == {} and watch.move(16.0, True, choose) is None
    look(6, 93, 6.0)
    assert watch.stragglers.steady == {1: 6.0}
    moved = watch.move(17.0, True, choose)
    assert moved is not None and moved.slow == ((1, 6.0),)


def test_the_move_waits_until_the_slowdown_has_lasted_long_enough_to_pay():
    """SpeedWatch.move (pure): a straggler found is planned around only once the time
    its slowdown has lasted makes the planner prefer moving; one that recovers before
    that moves nothing (no move there, none back)."""
    watch = SpeedWatch()
    asked = []

    def choose(slow, horizon_s):
        asked.append(horizon_s)
        return horizon_s >= 5.0  # the planner: a move pays from a 5 s horizon

    watch.stragglers.found = {3: 2.0}
    assert watch.move(100.0, False, choose) is None
    assert watch.move(103.0, False, choose) is None
    assert asked == [0.0, 3.0]
    watch.stragglers.found = {}  # recovered: nothing was moved, nothing moves back
    assert watch.move(104.0, False, choose) is None
    watch.stragglers.found = {3: 2.0}
    assert watch.move(110.0, False, choose) is None  # found again: its horizon starts again
    assert watch.move(115.0, False, choose) == Replan(slow=((3, 2.0),), horizon_s=5.0)
    assert watch.move(116.0, True, choose) is None  # planned around: no second move
    watch.stragglers.found = {}
    assert watch.move(117.0, True, choose) == Replan(slow=(), horizon_s=0.0)  # back
    assert watch.move(118.0, False, choose) is None
    # a failure's (or a growth's) plan replaced the one made around it: nothing to move
    # back from; the next looks judge afresh
    watch.stragglers.found = {3: 2.0}
    watch.move(120.0, False, choose)
    assert watch.move(126.0, False, choose) is not None
    watch.stragglers.found = {}
    assert watch.move(127.0, False, choose) is None
    # a successor leader finds the plan uneven and moves it back once nobody is slow
    successor = SpeedWatch()
    assert successor.move(130.0, True, choose) == Replan(slow=(), horizon_s=0.0)
    off = SpeedWatch(plan_around=False)
    off.stragglers.found = {3: 2.0}
    assert off.move(100.0, False, choose) is None and off.move(200.0, False, choose) is None
