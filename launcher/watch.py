"""Is a worker alive, and is it getting anywhere? Two questions, two sets of timeouts.
Pure: statuses and times in, verdicts out.

- Liveness (``Liveness``, each agent for its own workers): a chameleon_runtime worker's
  heartbeat thread beats every second whatever the main thread does; a beat that does not
  move for ``--heartbeat-timeout`` means the process is gone or frozen. A replacement is
  judged by its own beats only (the status carries its pid), and a worker that never
  beat by ``--startup-timeout`` is hung too.
- Progress (``Progress``, the leader, job-wide): a worker's step count, phase and
  generation must move within ``--step-timeout`` (auto: 10x the slowest completed step,
  never under 60 s) once it has completed a step, within ``--startup-timeout`` before its
  first step and while it checkpoints. Recovery phases are the recovery state machine's
  to time (launcher/recovery.py); spares and finished workers make no progress to judge.
- Heartbeats of plain scripts (``ScriptBeats``, each agent for its own workers): a
  script that calls ``chameleon_runtime.heartbeat()`` once a step is hung when its beats
  stop (see the class for the timeouts); one that never calls it is watched by its
  process state alone (launcher/local.py).
- Blame (``blame``): when one worker stalls its peers stall too, waiting for it. Each
  worker says what it waits on; the chain is followed to the worker that waits on no one
  but itself (its compute, its checkpoint), and that one alone is blamed, so the others
  recover in place instead of all being killed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from chameleon_runtime.protocol.messages import ScriptBeat, WorkerStatus

MIN_STEP_TIMEOUT_S = 60.0
STEP_TIMEOUT_FACTOR = 10.0
# Phases whose progress this module judges (the others: recovery, spare, done).
_JUDGED = {"startup", "train", "checkpoint"}
# Waits on nobody but oneself.
_OWN = {"compute", "checkpoint", "groups"}


@dataclass(frozen=True)
class Timeouts:
    heartbeat_s: float = 30.0
    step_s: float | None = None  # None: automatic
    startup_s: float = 600.0

    @property
    def beat_period_s(self) -> float:
        """How often workers beat: several beats fit in the timeout, at most one a second."""
        return min(1.0, self.heartbeat_s / 4)

    def step_timeout(self, slowest_step_s: float) -> float:
        if self.step_s is not None:
            return self.step_s
        return max(MIN_STEP_TIMEOUT_S, STEP_TIMEOUT_FACTOR * slowest_step_s)


class Liveness:
    """One agent's view of its workers' heartbeats."""

    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self._seen: dict[int, tuple[int, int, float]] = {}  # rank -> (pid, beat, moved at)

    def judge(
        self, rank: int, pid: int, started_at: float, status: WorkerStatus | None, now: float
    ) -> str | None:
        """Why the worker ``pid`` (spawned at ``started_at``) counts as hung, or None."""
        if status is not None and status.pid == pid and status.phase == "done":
            return None  # finished: it stops beating, and what its script does next is its own
        if status is not None and status.pid == pid:
            seen = self._seen.get(rank)
            if seen is None or seen[:2] != (pid, status.beat):
                self._seen[rank] = (pid, status.beat, now)
                return None
            silent = now - seen[2]
            if silent >= self.timeouts.heartbeat_s:
                return f"no heartbeat for {silent:.1f} s (step {status.step}, {status.phase})"
            return None
        seen = self._seen.get(rank)
        if seen is not None and seen[0] == pid:  # it beat before; its status is missing now
            silent = now - seen[2]  # (a new store not written yet: launcher/agent.py)
            if silent >= self.timeouts.heartbeat_s:
                return f"no heartbeat for {silent:.1f} s"
            return None
        # Not one beat of its own yet (a predecessor's status does not count).
        if now - started_at >= self.timeouts.startup_s:
            return f"no heartbeat within the startup timeout ({self.timeouts.startup_s:g} s)"
        return None

    def forgive(self, now: float) -> None:
        """Count every worker's silence from ``now``: until then this agent could not read
        the beats (the store out of reach, or moved to a new leader), and a worker's
        beats reach a moved store only once its own connection to the old one has failed
        (chameleon_runtime.protocol.link), up to a heartbeat timeout later. So the
        silence is counted from a heartbeat timeout after ``now``: a worker whose old
        connection failed only at its deadline (seen: 3.4 s after this agent had moved,
        with a timeout of 3 s) is not taken for hung."""
        since = now + self.timeouts.heartbeat_s
        self._seen = {rank: (pid, beat, since) for rank, (pid, beat, _) in self._seen.items()}


class ScriptBeats:
    """One agent's view of its plain scripts' heartbeats (chameleon_runtime.heartbeat):
    a worker that has beaten twice is hung when its beats stop for --heartbeat-timeout,
    or 10x the slowest gap between its beats when that is longer (a slow healthy step is
    not a hang); inside a section, for the section's timeout (None: the startup timeout);
    after one beat only, for the startup timeout (its first full step is still to come).
    A worker without beats is left to the process-state check."""

    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self._seen: dict[int, tuple[int, int, float]] = {}  # rank -> (pid, beats, moved at)

    def judge(
        self, rank: int, pid: int, beat: ScriptBeat | None, now: float
    ) -> tuple[str, float] | None:
        """(why the worker ``pid`` is hung, since when), or None."""
        if beat is None or beat.pid != pid:
            return None
        seen = self._seen.get(rank)
        if seen is None or seen[:2] != (pid, beat.beats):
            self._seen[rank] = (pid, beat.beats, now)
            return None
        silent = now - seen[2]
        if beat.section is not None:
            limit = beat.timeout_s or self.timeouts.startup_s
            where = f"in section {beat.section!r}, whose timeout is {limit:g} s"
        elif beat.slowest_gap_s is None:
            limit = self.timeouts.startup_s
            where = f"after its first, within the startup timeout ({limit:g} s)"
        else:
            limit = max(self.timeouts.heartbeat_s, STEP_TIMEOUT_FACTOR * beat.slowest_gap_s)
            where = f"(timeout {limit:g} s; slowest gap between beats {beat.slowest_gap_s:.2f} s)"
        if silent < limit:
            return None
        return f"no heartbeat for {silent:.1f} s {where}", seen[2]


@dataclass(frozen=True)
class Stall:
    rank: int
    stalled_s: float
    timeout_s: float
    why: str  # which timeout


class Progress:
    """The leader's view of every worker's progress, on its own clock."""

    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self._marks: dict[int, tuple[tuple, float]] = {}
        self.slowest_step_s = 0.0

    def observe(self, statuses: Mapping[int, WorkerStatus], now: float) -> None:
        for rank, s in statuses.items():
            mark = (s.pid, s.phase, s.generation, s.progress)
            if rank not in self._marks or self._marks[rank][0] != mark:
                self._marks[rank] = (mark, now)
            if s.slowest_step_s:
                self.slowest_step_s = max(self.slowest_step_s, s.slowest_step_s)

    def step_timeout_s(self) -> float:
        return self.timeouts.step_timeout(self.slowest_step_s)

    def stalled(self, statuses: Mapping[int, WorkerStatus], now: float) -> dict[int, Stall]:
        out = {}
        for rank, s in statuses.items():
            if s.phase not in _JUDGED or rank not in self._marks:
                continue
            if s.progress == 0 or s.phase == "checkpoint":
                timeout, why = self.timeouts.startup_s, "startup timeout"
                if s.phase == "checkpoint":
                    why = "startup timeout, which long phases get"
            else:
                timeout, why = self.step_timeout_s(), "step timeout"
            stalled = now - self._marks[rank][1]
            if stalled >= timeout:
                out[rank] = Stall(rank, stalled, timeout, why)
        return out


def _next(rank: int, statuses: Mapping[int, WorkerStatus]) -> list[int] | None:
    """The workers ``rank`` waits on; None when it waits on itself."""
    s = statuses[rank]
    w = s.waiting_on
    if w is None or w.what in _OWN:
        return None
    if w.what in ("recv", "send", "allreduce"):
        return [p for p in w.peers if p in statuses and p != rank]
    if w.what == "agree":
        # Everyone of its generation that has not reached the same agreement yet.
        return [
            r
            for r, o in statuses.items()
            if r != rank
            and o.generation == s.generation
            and o.phase in _JUDGED
            and not (o.waiting_on and o.waiting_on.what == "agree" and o.waiting_on.name == w.name)
        ]
    return []  # the launcher (a plan): no worker to blame


def _roots(start: int, statuses: Mapping[int, WorkerStatus], stalls: Mapping[int, Stall]):
    """The workers at the ends of ``start``'s wait chains."""
    frontier, seen = [start], {start}
    found: set[int] = set()
    while frontier:
        rank = frontier.pop()
        after = _next(rank, statuses)
        if after is None:
            found.add(rank)
            continue
        for peer in after:
            if peer not in seen:
                seen.add(peer)
                frontier.append(peer)
    if not found and all(_next(r, statuses) for r in seen):
        found = {r for r in seen if r in stalls}  # everyone waits on someone: a cycle
    return found


def blame(statuses: Mapping[int, WorkerStatus], stalls: Mapping[int, Stall]) -> dict[int, str]:
    """The stalled workers at the roots of the stalled workers' wait chains, with why.
    A root that is not stalled itself (it still gets somewhere) is blamed for nothing; a
    cycle of waits (a deadlock) blames every worker in it. Its message names every worker
    whose wait chain ends at it, stalled past its own timeout yet or not (one that began
    the step later, on a loaded host, waits on it all the same)."""
    roots: dict[int, list[int]] = {}  # root -> workers waiting on it
    for start in sorted(stalls):
        for root in _roots(start, statuses, stalls):
            roots.setdefault(root, []).append(start)
    for start in sorted(set(statuses) - set(stalls)):
        for root in _roots(start, statuses, stalls) & roots.keys():
            roots[root].append(start)
    out = {}
    for root, waiting in sorted(roots.items()):
        stall = stalls.get(root)
        if stall is None:
            continue
        s = statuses[root]
        what = s.waiting_on.what if s.waiting_on else "compute"
        others = sorted(r for r in waiting if r != root)
        out[root] = (
            f"no progress for {stall.stalled_s:.1f} s ({stall.why} {stall.timeout_s:g} s) "
            f"in {what} at step {s.step}" + (f"; ranks {others} wait on it" if others else "")
        )
    return out
