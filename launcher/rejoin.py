"""Replacements for failed workers of a chameleon_runtime job, while it keeps training.

A worker dies but its node lives (a crash, a kill, a hang we killed): the leader asks that
node's agent to start the rank again, by writing ``respawn/<rank>`` (a count) in the worker
store. The new process starts as a spare: it loads no checkpoint and holds no layer,
announces itself to the leader (``Joined`` with the same count, planner.protocol) and
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

# Grow only when the expected throughput until the next failure improves by this much.
GROW_MARGIN = 0.01


@dataclass
class Rejoins:
    max_per_rank: int
    requested: dict[int, int] = field(default_factory=dict)  # rank -> latest count asked
    waiting: set[int] = field(default_factory=set)  # asked, not yet announced

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

    def forget(self, ranks: Iterable[int]) -> None:
        self.waiting.difference_update(ranks)


def worth_growing(*, current_s: float, grown_s: float, transition_s: float, mtbf_s: float) -> bool:
    """Samples per second until the next failure, staying versus moving: moving costs the
    transition once, then runs at the grown step time."""
    if grown_s <= 0 or current_s <= 0 or transition_s >= mtbf_s:
        return False
    stay = 1.0 / current_s
    grow = (mtbf_s - transition_s) / mtbf_s / grown_s
    return grow > stay * (1 + GROW_MARGIN)
