"""Replacements for failed workers of a chameleon_runtime job, while it keeps training.

A worker dies but its node lives (a crash, a kill, a hang we killed): the leader asks that
node's agent to start the rank again, by writing ``respawn/<rank>`` (a count) in the worker
store. The new process starts as a spare: it loads no checkpoint and holds no layer,
announces itself to the leader (``Joined`` with the same count, chameleon_runtime.protocol.messages) and
waits. The coordinator then weighs the job with it against the job
without it, and when the gain over the expected time to the next failure pays for the
move, re-partitions over everyone (the newcomer receives its layers from their holders,
as in any re-partition). Otherwise it stays a spare that a later recovery may use.

Each rank is replaced at most ``max_per_rank`` times, so a worker that keeps crashing
(a bad device, a bug that always strikes it) stops costing recoveries.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

# Steps after which the workers' step means (chameleon_runtime.pace: 2 warm-up steps, a
# window of 8) cover only steps run after a replacement's start-up, which competed for
# the host: the layout with it is judged then.
SETTLE_STEPS = 10


@dataclass
class Rejoins:
    """Replacements of one attempt: asked for, up (announced), admitted as spares, and
    settled enough for the layout with them to be judged."""

    max_per_rank: int
    requested: dict[int, int] = field(default_factory=dict)  # rank -> latest count asked
    waiting: set[int] = field(default_factory=set)  # asked, not yet up
    announced: dict[int, int] = field(default_factory=dict)  # up: rank -> generation joined
    joined: list[int] = field(default_factory=list)  # admitted, growth not judged yet
    settle_until: int = 0

    def request(
        self, ranks: Iterable[int], *, gone: set[int], put: Callable[[int, int], None]
    ) -> list[int]:
        """Ask for replacements of ``ranks`` (those whose node is not ``gone`` and that
        have budget left): ``put(rank, count)``. Returns the ranks asked for."""
        asked = []
        for rank in sorted(ranks):
            count = self.requested.get(rank, 0)
            if rank in gone or count >= self.max_per_rank:
                continue
            self.requested[rank] = count + 1
            self.waiting.add(rank)
            put(rank, count + 1)
            asked.append(rank)
        return asked

    def can_replace(self, rank: int) -> bool:
        """Whether ``rank`` has a replacement left (``max_per_rank``)."""
        return self.requested.get(rank, 0) < self.max_per_rank

    def forget(self, ranks: Iterable[int]) -> None:
        """``ranks`` failed (again): whatever was under way for them is over."""
        for rank in ranks:
            self.waiting.discard(rank)
            self.announced.pop(rank, None)

    def up(self, rank: int, count: int, generation: int) -> bool:
        """A replacement announced itself; False for a stale announcement."""
        if self.requested.get(rank) != count:
            return False
        self.waiting.discard(rank)
        self.announced[rank] = generation
        return True

    @property
    def listening(self) -> set[int]:
        """Replacements that may be listening for the leader's messages."""
        return self.waiting | set(self.announced)

    def admit(self, ranks: set[int], top_step: int) -> None:
        for rank in ranks:
            del self.announced[rank]
        self.joined = sorted(set(self.joined) | ranks)
        self.settle_until = top_step + SETTLE_STEPS

    def settled(self, top_step: int) -> list[int]:
        """Admitted replacements whose growth can be judged now (and is, once)."""
        if not self.joined or top_step < self.settle_until or self.waiting:
            return []
        joined, self.joined = self.joined, []
        return joined
