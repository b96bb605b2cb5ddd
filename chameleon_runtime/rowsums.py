"""A sharded gradient's sums across replica groups when the groups do not shard alike
(a group re-sharded over its survivors: chameleon_runtime.reshard).

Groups of ``S`` members hold the same rows at the same place, so a shard's gradient is
summed over its column, one all-reduce of a whole bucket. A group of ``S - 1`` cuts each
parameter elsewhere (FSDP2's ``Shard(0)``: ``ceil(n / k)`` rows a member), so the rows
one member holds are held, in another group, by one member or two. The rows are cut
where any group's shards meet (``ShardLayout.segments``); each piece is summed over its
holders, one per group. The pieces of a bucket with the same holders are summed in one
all-reduce: in place when they are one range of the bucket, else copied into one
buffer and back. Every holder cuts the same rows of the same parameters in the same
order (a bucket is the same parameters on every member: chameleon_runtime.buckets), so
their all-reduces pair.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from chameleon_runtime.shardlayout import ShardLayout

Ranges = list[tuple[int, int]]


@dataclass
class Piece:
    """The ranges of a bucket's buffer that one set of holders sums."""

    holders: tuple[int, ...]
    ranges: Ranges

    @property
    def numel(self) -> int:
        return sum(b - a for a, b in self.ranges)


def pieces(
    layout: ShardLayout,
    rank: int,
    params: Sequence[torch.Tensor],
    spans: Sequence[tuple[int, int]],
) -> list[Piece]:
    """``rank``'s pieces of a bucket holding ``params`` at ``spans`` of its buffer (each
    a local shard of a parameter, dim-0 rows, contiguous), by holders in first-use order,
    adjacent ranges merged; holders of one (``rank`` alone) are left out."""
    by: dict[tuple[int, ...], Ranges] = {}
    for p, (start, end) in zip(params, spans, strict=True):
        n = p.shape[0] if p.dim() else 1
        if end == start or n == 0:
            continue
        per_row = p.numel() // n
        a, _ = layout.rows_of(rank, n)
        for x, y, holders in layout.segments(rank, n):
            if len(holders) == 1:
                continue
            lo, hi = start + (x - a) * per_row, start + (y - a) * per_row
            ranges = by.setdefault(holders, [])
            if ranges and ranges[-1][1] == lo:
                ranges[-1] = (ranges[-1][0], hi)
            else:
                ranges.append((lo, hi))
    return [Piece(h, r) for h, r in by.items()]


Post = Callable[[torch.Tensor, tuple[int, ...]], Any]  # posts a sum over holders
Wait = Callable[[Any, tuple[int, ...]], None]


class PostedSums:
    """The all-reduces of one buffer's pieces, posted; ``finish`` ends them and puts the
    copied pieces back. ``is_completed`` and ``wait`` as a torch Work's (an abandoned
    step's: chameleon_runtime.buckets.renew_in_flight)."""

    def __init__(self, buffer: torch.Tensor, parts: list[Piece], post: Post) -> None:
        self.buffer = buffer
        self.posted: list[tuple[Any, Piece, torch.Tensor | None]] = []
        for part in parts:
            if len(part.ranges) == 1:
                a, b = part.ranges[0]
                self.posted.append((post(buffer[a:b], part.holders), part, None))
                continue
            staged = torch.cat([buffer[a:b] for a, b in part.ranges])
            self.posted.append((post(staged, part.holders), part, staged))

    def finish(self, wait: Wait) -> None:
        for work, part, staged in self.posted:
            wait(work, part.holders)
            if staged is not None:
                offset = 0
                with torch.no_grad():
                    for a, b in part.ranges:
                        self.buffer[a:b].copy_(staged[offset : offset + b - a])
                        offset += b - a
        self.posted = []

    def is_completed(self) -> bool:
        return all(w.is_completed() for w, _, _ in self.posted)

    def wait(self, timeout: Any = None) -> None:
        for work, _, _ in self.posted:
            if not work.is_completed():
                work.wait(timeout)
