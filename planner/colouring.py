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

import networkx as nx


@dataclass(frozen=True)
class Task:
    participants: tuple[int, ...]
    duration_s: float


def colour_rounds(tasks: Sequence[Task]) -> list[int]:
    """The round of each task (0-based), such that tasks in one round share no worker."""
    if not tasks:
        return []
    order = sorted(range(len(tasks)), key=lambda i: (-tasks[i].duration_s, i))
    graph = nx.Graph()
    graph.add_nodes_from(range(len(tasks)))
    by_worker: dict[int, list[int]] = {}
    for i, task in enumerate(tasks):
        for worker in set(task.participants):
            by_worker.setdefault(worker, []).append(i)
    for members in by_worker.values():
        for a_pos, a in enumerate(members):
            for b in members[a_pos + 1 :]:
                graph.add_edge(a, b)
    colours = nx.coloring.greedy_color(graph, strategy=lambda _g, _c: iter(order))
    return [colours[i] for i in range(len(tasks))]


def rounds_time_s(tasks: Sequence[Task], rounds: Sequence[int]) -> float:
    """Time of a round-by-round schedule: the sum over rounds of the slowest task."""
    slowest: dict[int, float] = {}
    for task, r in zip(tasks, rounds, strict=True):
        slowest[r] = max(slowest.get(r, 0.0), task.duration_s)
    return sum(slowest.values())
