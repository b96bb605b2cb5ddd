"""Rounds of communication by colouring a conflict graph (PAPER.md, restorer).

Two tasks conflict when they share a worker: a worker takes part in one transfer or one
all-reduce at a time. Colouring the conflict graph puts non-conflicting tasks in the same
round; rounds run one after another and a round lasts as long as its slowest task.

Greedy colouring in order of decreasing duration groups tasks of similar length together,
which keeps every round's slowest task close to its others (the sum of round maxima is what
the schedule costs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    participants: tuple[int, ...]
    duration_s: float


def colour_rounds(tasks: Sequence[Task]) -> list[int]:
    """The round of each task (0-based), such that tasks in one round share no worker:
    networkx's greedy colouring of the conflict graph in order of decreasing duration
    (tests hold the two equal), without building the graph, whose cliques (every pair of
    a bucket's 128 holders' other buckets) cost more than the colouring at 16k workers."""
    order = sorted(range(len(tasks)), key=lambda i: (-tasks[i].duration_s, i))
    taken: dict[int, int] = {}  # per worker: a bit per round its tasks are in so far
    get = taken.get
    rounds = [0] * len(tasks)
    for i in order:
        workers = tasks[i].participants
        used = 0
        for w in workers:
            used |= get(w, 0)
        bit = ~used & (used + 1)  # the lowest round none of them is in
        rounds[i] = bit.bit_length() - 1
        for w in workers:
            taken[w] = get(w, 0) | bit
    return rounds


def rounds_time_s(tasks: Sequence[Task], rounds: Sequence[int]) -> float:
    """Time of a round-by-round schedule: the sum over rounds of the slowest task."""
    slowest: dict[int, float] = {}
    for task, r in zip(tasks, rounds, strict=True):
        slowest[r] = max(slowest.get(r, 0.0), task.duration_s)
    return sum(slowest.values())
