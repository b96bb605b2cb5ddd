"""Stragglers: a worker slower than its peers, told apart from a slow step and a stall.

What is measured: each worker's passes' wall time per micro-batch, the median over its
recent steps (``WorkerStatus.busy_s_per_mb``, chameleon_runtime.pace). Its *factor* is
that over the median of its peers': the other workers holding the same layers (a
stage's replicas; every worker in data parallel), where there are any, since their work
is the same whatever the cost table says of it; else every other worker's, each divided
by what its layers cost per micro-batch in the job's cost table (a pipeline without
replicas, whose stages do unequal work; the runtime's own time per pass, which the table
leaves out, makes this the rougher comparison). Wall time, not CPU time: a throttled device or a stopped process spends no
more CPU per pass, only more time; and a pass's time leaves out the waits in
collectives, where the peers a slow worker holds up spend theirs.

- a straggler: its factor at least ``SLOW_FACTOR`` on ``CONFIRM_LOOKS`` looks in a row,
  each with steps it ran since the last (the median over the pace window already needs
  half its steps slow: a garbage collection or a checkpoint write does not count);
  recovered once its factor is under ``RECOVERED_FACTOR`` on ``RECOVER_LOOKS`` looks in
  a row of one plan, or under ``SLOW_FACTOR`` while the plan deals it lightly (a light
  deal reads slower at full speed: ``Stragglers.back_bar``);
- a worker whose passes are under ``MIN_SHARE`` of its step is not judged (nor compared
  with): its speed hardly moves the step;
- a slow step: every worker slower alike, so no factor moves: nothing to find (and
  nothing a plan could move work to);
- a stall: no step at all. The worker reports nothing new, so it is not judged here; the
  progress watch (launcher/watch.py) handles it as a hang.

Acting (``SpeedWatch.move``, unless ``--stragglers off``): while stragglers are found,
each look asks the planner whether an uneven deal pays over the time the slowdown has
lasted so far (planner.choice.stragglers: a slowdown is expected to go on about as long
as it has gone on, so a brief one moves nothing, and a job whose worker flaps does not
oscillate); when it does, a ``Replan`` moves the job at a step boundary, nothing lost.
While planned around, a factor that drifts ``REDEAL_DRIFT`` from the one the deal was
made at (or another straggler, or one of them back to speed) is judged again, against the
running deal: dealt again if that pays, ``MAX_REDEALS`` times at most per slowdown. The
drift counts once the factor has held on two looks in a row (``Stragglers.steady``): as
the pace window drains at a slowdown's end, the median passes through values between the
slow one and 1 for a look, and a deal made at one of them moved the job a third time, its
new generation's first steps unjudged, before it was said back (benchmarks/stragglers.py,
the Trainer at 3x: dealt again at 1.39x as the slowdown ended, back some 40 steps after).
A worker dealt lightly whose factor eases into the band where a worker back to speed and
one still slowed read alike on a light deal is dealt evenly again, still found, and judged
there (``_eased``). Once every worker planned around is back to speed (or gone), a
``Replan`` with no slow worker deals evenly again. A failure's plan replaces ours: the
next look starts afresh, and no move is made on a factor read in an earlier generation
(``Stragglers.stale``): seen, a worker killed mid-slowdown and taken back in, its peer's
slowdown over by then, and the job dealt around the peer again at the 4.3x read before
the failure, 14 steps before it was said back.

Pure apart from the state of what was found: ``look`` is given the rates and which of
them are fresh, and says what changed.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from chameleon_runtime.protocol.messages import PACE_WINDOW, WorkerStatus
from launcher.recovery_events import Replan

SLOW_FACTOR = 1.5  # a worker this much slower than the others' median is a straggler
# ... until it is back under this (hysteresis: no flapping), or under SLOW_FACTOR while it
# is dealt lightly (Stragglers.back_bar). Not nearer 1: a worker dealt 1 or 2 micro-batches
# of 8 reads 13-18% slower per micro-batch than its peer with 6 or 7, on average, when
# neither is slow, and single looks at 1 of 8 in the Trainer read up to 1.6x (a per-step
# part of its passes' time: a CPU that idles between passes comes back cold), so with 1.2
# a worker back at speed was said so late, or never (benchmarks/stragglers.py: the
# drop-in dealt 6 of 8 to the end of the run, twice).
RECOVERED_FACTOR = 1.3
CONFIRM_LOOKS = 1  # looks in a row, each with new steps, before a straggler is said
# ... and before one is said back to speed: more, since a deal undone while the worker is
# still slow costs two moves (seen on a host with a core busy: one look's factor under
# the bar mid-slowdown, an even deal, and an uneven one again three steps later), where
# one said back a look late costs the steps of that look at the uneven deal.
RECOVER_LOOKS = 2
# A worker whose passes take less of its step than this is not judged: however slow they
# get they hardly move the step, and passes of a fraction of a millisecond (a cheap
# pipeline stage) vary by more than a slowdown's bar from one step to the next.
MIN_SHARE = 0.05
# A worker is judged once its pace window holds this many steps of its generation: the
# median of fewer moves with one step (a new generation's first steps after a recovery
# are uneven, as groups warm up and the host settles).
MIN_PACE_STEPS = PACE_WINDOW // 2 + 1
# A plan made around slow workers is dealt again once a factor has moved this much (either
# way) from the one the deal was made at, or another worker is found slow: the first
# move comes a few steps into a slowdown, while the median still mixes steps from before
# it (seen: a 3x slowdown planned around at 1.7x, 0.49 of the deal a 3x factor predicts).
REDEAL_DRIFT = 1.3
# ... at most this many times per slowdown: a factor that swings (on a host whose workers
# share cores the deal itself moves the others' speed) must not keep the job moving.
MAX_REDEALS = 2
# A straggler dealt lightly whose factor eases under this (a drift over the slow bar) is
# dealt evenly again, not around the eased factor: on a light deal a worker back to
# speed read up to 1.62x, and one slowed 2x read 1.97x at the least (``_eased``).
EASED_LIGHT = SLOW_FACTOR * REDEAL_DRIFT
LOOK_STEPS = 3  # the leader looks every this many steps (at most its period, a second) ...
LOOK_MIN_S = 0.1  # ... but not more often than this while one is found or planned around
# ... nor than this while none is: with a second between looks a job of 30 steps a second
# moved 21 to 25 steps after a 2x slowdown began (benchmarks/stragglers.py, the Trainer),
# most of it waiting for the next look; a look reads every worker's status in one round
# trip, so four a second cost a small job little, and a big one's steps are longer.
LOOK_QUIET_MIN_S = 0.25


@dataclass(frozen=True)
class Found:
    """A worker became a straggler (``recovered`` False) or recovered its speed."""

    rank: int
    factor: float  # its time per unit of work over the others' median, this look
    recovered: bool = False
    # Recovered: the largest factor it had while slow. The factor it is found at is an
    # early one (the pace median still mixes steps from before the slowdown).
    worst: float | None = None


def factors(
    rates: Mapping[int, float],
    holds: Mapping[int, object] | None = None,
    raw: Mapping[int, float] | None = None,
) -> dict[int, float]:
    """Each worker's rate over the median of the others' (nothing for a lone worker):
    against the others, so that with two workers the slow one is not half of the
    reference it is measured against. ``holds``: what each worker of the plan holds (its
    layers); where others hold the same, only they are its peers, and ``raw`` (its time
    per micro-batch, not scaled by the cost table) is compared (module doc); a worker
    whose peers have no rate is not judged."""
    raw = raw if raw is not None else rates
    out: dict[int, float] = {}
    for rank in rates:
        peers = _holding_same(rank, rates, holds)
        replicated = holds is not None and any(
            k != rank and layers == holds.get(rank) for k, layers in holds.items()
        )
        if replicated and not peers:
            continue
        if peers:
            mine, others = raw[rank], [raw[k] for k in peers]
        else:
            mine, others = rates[rank], [rates[k] for k in rates if k != rank]
        if others:
            reference = statistics.median(others)
            if reference > 0:
                out[rank] = mine / reference
    return out


def dealt_lightly(load: Mapping[int, int], holds: Mapping[int, object] | None = None) -> set[int]:
    """The workers the running plan deals two or more micro-batches a step fewer than a
    peer (``load``: the plan's, every worker of it; peers: those holding the same layers
    where others do, ``holds``, else every other). Two, as planner.choice.stragglers.
    dealt_unevenly counts a plan uneven: an even deal that does not divide (8 over 3: 3,
    3 and 2) leaves nobody light."""
    out = set()
    for rank, mine in load.items():
        peers = _holding_same(rank, load, holds) or [k for k in load if k != rank]
        if peers and max(load[k] for k in peers) - mine > 1:
            out.add(rank)
    return out


def _holding_same(
    rank: int, ranks: Collection[int], holds: Mapping[int, object] | None
) -> list[int]:
    """The others among ``ranks`` that hold the layers ``rank`` holds (none without
    ``holds``): its peers, for ``factors`` and ``dealt_lightly`` alike."""
    if not holds:
        return []
    return [k for k in ranks if k != rank and holds.get(k) == holds.get(rank)]


@dataclass
class Stragglers:
    slow: float = SLOW_FACTOR
    recovered: float = RECOVERED_FACTOR
    confirm: int = CONFIRM_LOOKS
    confirm_recovered: int = RECOVER_LOOKS
    found: dict[int, float] = field(default_factory=dict)  # straggler -> its last factor
    worst: dict[int, float] = field(default_factory=dict)  # straggler -> its largest factor
    # straggler -> its last factor, where the look before read it within REDEAL_DRIFT of it
    steady: dict[int, float] = field(default_factory=dict)
    _before: dict[int, float] = field(default_factory=dict)  # straggler -> its factor a look ago
    # stragglers whose factor was read in an earlier generation, until a look in this one
    stale: set[int] = field(default_factory=set)
    # the workers the running plan deals lightly (``dealt_lightly``), at the last look
    light: set[int] = field(default_factory=set)
    _streak: dict[int, int] = field(default_factory=dict)  # looks in a row past the bar

    def look(
        self,
        rates: Mapping[int, float],
        fresh: set[int],
        holds: Mapping[int, object] | None = None,
        raw: Mapping[int, float] | None = None,
        light: Collection[int] = (),
    ) -> list[Found]:
        """One look at the live workers' rates; ``fresh``: those that ran steps since the
        last look (a stale rate neither confirms nor clears); ``holds``, ``raw``:
        ``factors``'; ``light``: the workers the running plan deals lightly
        (``dealt_lightly``, ``back_bar``)."""
        self.light = set(light)
        changes: list[Found] = []
        for rank, factor in sorted(factors(rates, holds, raw).items()):
            if rank not in fresh:
                continue
            # (only a factor read clears it: a fresh status whose peers are not judged yet
            # gives none, and leaves the old factor stale)
            self.stale.discard(rank)
            slow_now = rank in self.found
            crossed = factor < self.back_bar(rank) if slow_now else factor >= self.slow
            self._streak[rank] = self._streak.get(rank, 0) + 1 if crossed else 0
            if slow_now:
                self.found[rank] = factor
                self.worst[rank] = max(self.worst.get(rank, factor), factor)
                before = self._before.get(rank)
                if before is not None and _ratio(before, factor) < REDEAL_DRIFT:
                    self.steady[rank] = factor
                else:
                    self.steady.pop(rank, None)
                self._before[rank] = factor
            if self._streak[rank] >= (self.confirm_recovered if slow_now else self.confirm):
                self._streak[rank] = 0
                if slow_now:
                    del self.found[rank]
                    self.steady.pop(rank, None)
                    self._before.pop(rank, None)
                    worst = self.worst.pop(rank, factor)
                    changes.append(Found(rank, factor, recovered=True, worst=worst))
                else:
                    self.found[rank] = self.worst[rank] = self._before[rank] = factor
                    changes.append(Found(rank, factor))
        return changes

    def back_bar(self, rank: int) -> float:
        """The factor a straggler must read under to count a look toward being back to
        speed: ``recovered``, but ``slow`` while the running plan deals it two or more
        micro-batches fewer than a peer. A light deal reads slower at full speed (its
        passes come after long waits on its peers, on a cold CPU: 1.0-1.6x seen for 1 of 8 in the Trainer, whose slowdown
        at 2x it read at 2.0-5.1x), and under the recovered bar such a worker, back to
        speed, read 1.39x on one look and was said back two looks later; one that read
        1.4-1.6x twice was dealt again, to 3 of 8, and back came 40-68 steps after the
        slowdown's end. Under the slow bar it is no straggler by the rule that found it; on
        the even deal, where that reading is taken without the light deal's penalty, one
        still slow is found again. No gap between the bars while light, then: a slowdown
        that reads about 1.5x there may be said back, dealt evenly and found again (two
        moves, and the next deal waits for the slowdown to have lasted long enough again);
        and a worker at full speed that reads over 1.5x on a light deal stays planned
        around, as it did under the recovered bar."""
        return self.slow if rank in self.light else self.recovered

    def new_generation(self) -> None:
        """A new plan runs: the factors read so far are not its own (``stale`` until a
        look reads them again), no look of it agrees with one of them (``steady``: two
        looks of one deal), and its looks count toward a change from none (``_streak``:
        a look under one deal's bar and one under another's are not two in a row)."""
        self.steady.clear()
        self._before.clear()
        self._streak.clear()
        self.stale = set(self.found)

    def forget(self, ranks: set[int]) -> list[int]:
        """Workers gone (failed, left out): what was found of them no longer holds.
        Returns the stragglers among them."""
        gone = sorted(r for r in ranks if r in self.found)
        for rank in ranks:
            for state in (self.found, self.worst, self.steady, self._before, self._streak):
                state.pop(rank, None)
            self.stale.discard(rank)
        return gone


def unit_costs(
    stages: Mapping[int, tuple[int, int]], layer_s: list[float], per_mb_s: float = 0.0
) -> dict[int, float]:
    """What a micro-batch's passes cost each worker by the cost table: the sum of its
    layers' forward and backward (``stages``: worker -> its layers [first, end)), and
    ``per_mb_s`` beyond them (the runtime's own, where measured). A table that prices
    nothing (not measured yet) counts micro-batches alone."""
    if sum(layer_s) <= 0:
        return dict.fromkeys(stages, 1.0)
    return {w: max(sum(layer_s[first:end]) + per_mb_s, 1e-12) for w, (first, end) in stages.items()}


@dataclass
class SpeedWatch:
    """The coordinator's look at its workers' speeds: which statuses are fresh (a step
    run since the last look, in the current generation), their rates, and what
    ``Stragglers`` finds in them."""

    stragglers: Stragglers = field(default_factory=Stragglers)
    plan_around: bool = True  # --stragglers on
    _seen: dict[int, tuple[int, int]] = field(default_factory=dict)  # rank -> (gen, step)
    _generation: int | None = None  # the generation last observed
    _since: dict[int, float] = field(default_factory=dict)  # straggler -> when found
    # The slow workers the running plan was made around.
    moved: tuple[tuple[int, float], ...] = ()
    # How many times the running deal was dealt again since the job left the even deal.
    _redeals: int = 0

    def observe(
        self,
        statuses: Mapping[int, WorkerStatus],
        generation: int,
        unit_s: Mapping[int, float],
        now: float = 0.0,
        holds: Mapping[int, object] | None = None,
        load: Mapping[int, int] | None = None,
    ) -> list[Found]:
        """``unit_s``: each worker's modelled passes per micro-batch (``unit_costs``);
        the workers it names are those the plan trains on; ``holds``: each one's layers;
        ``load``: the micro-batches the plan deals each a step (none: nobody is light).
        A straggler found now has been
        slow for at least the steps that moved the median of its pace window: that long
        counts toward how long its slowdown has lasted (``move``)."""
        if generation != self._generation:
            self._generation = generation
            self.stragglers.new_generation()
        rates: dict[int, float] = {}
        raw: dict[int, float] = {}  # per micro-batch, for peers holding the same layers
        fresh = set()
        for rank, status in statuses.items():
            per_mb = status.busy_s_per_mb
            if rank not in unit_s or per_mb is None or status.generation != generation:
                continue
            if status.phase != "train":
                continue
            if (status.pace_steps or 0) < MIN_PACE_STEPS:
                continue  # a generation's first steps: too few for the median to hold
            busy = per_mb * (status.micro_batches or 0)
            if status.mean_step_s and busy < MIN_SHARE * status.mean_step_s:
                continue
            rates[rank], raw[rank] = per_mb / unit_s[rank], per_mb
            mark = (status.generation, status.step)
            if self._seen.get(rank) != mark:
                self._seen[rank] = mark
                fresh.add(rank)
        for rank in [r for r in self._seen if r not in statuses]:
            del self._seen[rank]  # (bounded: the live workers' marks only)
        light = dealt_lightly(load, holds) if load else set()
        changes = self.stragglers.look(rates, fresh, holds, raw, light)
        for found in changes:
            if not found.recovered:
                status = statuses[found.rank]
                step_s = status.mean_step_s or status.step_s or 0.0
                self._since[found.rank] = now - (PACE_WINDOW // 2 + 1) * step_s
        return changes

    def forget(self, ranks: set[int]) -> list[int]:
        for rank in ranks:
            self._seen.pop(rank, None)
            self._since.pop(rank, None)
        return self.stragglers.forget(ranks)

    @property
    def slowed(self) -> bool:
        """A straggler is found or planned around: steps now are not the job's pace."""
        return bool(self.stragglers.found or self.moved)

    def look_period_s(self, statuses: Mapping[int, WorkerStatus], default_s: float) -> float:
        """How soon to look again: every few steps, at most ``default_s``, and at least
        0.1 s while a straggler is found or planned around (0.25 s while none is), so
        that the move there and the move back follow its speed within a few steps on a
        fast job, not a second later."""
        steps = sorted(s.mean_step_s for s in statuses.values() if s.mean_step_s)
        if not steps:
            return default_s
        floor = LOOK_MIN_S if self.slowed else LOOK_QUIET_MIN_S
        return min(default_s, max(floor, LOOK_STEPS * steps[len(steps) // 2]))

    def move(
        self,
        now: float,
        uneven: bool,
        choose: Callable[[tuple[tuple[int, float], ...], float], bool],
    ) -> Replan | None:
        """The move to make now, if any (module doc). ``choose(slow, horizon_s)``: whether
        the planner would leave the even plan for slow workers ``slow`` over that horizon.
        ``uneven``: whether the running plan deals unevenly (planner.choice.stragglers.
        dealt_unevenly): a failure's or a growth's plan that replaced ours does not, and
        a successor leader finds one that does."""
        found, steady = self.stragglers.found, self.stragglers.steady
        for rank in found:
            self._since.setdefault(rank, now)  # (found before a successor took over)
        for rank in [r for r in self._since if r not in found]:
            del self._since[rank]
        if self.moved and not uneven:
            self.moved, self._redeals = (), 0  # a failure's or a growth's plan runs now
        elif uneven and not self.moved:
            # (a successor leader, or found again: the plan is around someone)
            self.moved = tuple(sorted(found.items())) or ((-1, 1.0),)
        if not self.plan_around:
            return None
        if self.moved and not any(rank in found for rank, _ in self.moved):
            self.moved, self._redeals = (), 0
            return Replan(slow=(), horizon_s=0.0)
        # A straggler whose last factor is under its bar to be back (``back_bar``) may be
        # back to speed (said after RECOVER_LOOKS such looks) or dipping: neither is a
        # factor to deal at, first or again (seen: dealt 4 of 8, "uneven", a look before
        # it was said back). A factor that keeps swinging across the bar is never said
        # back: it is not back, and the deal made stays.
        if any(f < self.stragglers.back_bar(r) for r, f in found.items()):
            return None
        if self.stragglers.stale & set(found):
            return None  # (read before the generation running now: module doc)
        if self.moved:
            made_at = dict(self.moved)  # (drift is counted from the deal's factors)
            if _eased(made_at, steady, self.stragglers.light):
                # Back to the even deal, still found: there its factor is read without
                # the light deal's penalty, and it is said back or dealt around again
                # (``_eased``). Not counted against MAX_REDEALS: it undoes a deal.
                self.moved = ()
                return Replan(slow=(), horizon_s=0.0)
            if self._redeals >= MAX_REDEALS or not _drifted(made_at, found, steady):
                return None
            # Dealt again if the planner prefers the deal at today's factors to the
            # running one at them (choose weighs the running plan as it is); asked at
            # each look while drifted, as the first move is (choose answers a factor it
            # was asked once from its cache). A worker found slow since is judged over
            # its own slowdown's length: a dip of another's is not planned around on
            # the first one's.
            lasting = [r for r in found if r not in made_at] or list(found)
        elif found:
            lasting = list(found)
        else:
            return None
        slow = tuple(sorted(found.items()))
        horizon_s = now - min(self._since[r] for r in lasting)
        if not choose(slow, horizon_s):
            return None
        self._redeals += bool(self.moved)
        self.moved = slow
        return Replan(slow=slow, horizon_s=horizon_s)


def _drifted(
    made_at: Mapping[int, float], found: Mapping[int, float], steady: Mapping[int, float]
) -> bool:
    """Whether the slow workers or their factors moved far enough from those the deal was
    made at: a worker found slow since, one of them back to speed, a factor that held on
    two looks (``steady``) moved REDEAL_DRIFT."""
    if set(found) ^ set(made_at):
        return True
    return any(_ratio(f, made_at[r]) >= REDEAL_DRIFT for r, f in steady.items() if r in made_at)


def _eased(
    made_at: Mapping[int, float], steady: Mapping[int, float], light: Collection[int]
) -> bool:
    """Whether a straggler dealt lightly eased, on a factor that held, from the one its
    deal was made at by REDEAL_DRIFT or more to under ``EASED_LIGHT``: where readings of a
    worker back to speed and of a slowdown that eased overlap on a light deal. Dealt
    again at it, a worker back to speed that read 1.51x on 1 of 8 was dealt 5 and 3 and
    came back 33 steps after its slowdown ended (the Trainer at 3x); the even deal tells
    the two apart."""
    return any(
        r in made_at and f < EASED_LIGHT and f * REDEAL_DRIFT <= made_at[r]
        for r, f in steady.items()
        if r in light
    )


def _ratio(a: float, b: float) -> float:
    """How far apart two factors are, either way (no distance where either is not one)."""
    return max(a / b, b / a) if a > 0 and b > 0 else 1.0
