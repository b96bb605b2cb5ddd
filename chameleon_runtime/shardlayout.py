"""Where a sharded model's rows are (HSDP: chameleon_runtime.sharding): the replica groups
and columns over the members, the rows of a parameter each member holds (FSDP2's
``Shard(0)``), and a sharded tensor's local part. Below the modules that move or sum
rows (chameleon_runtime.reshard, chameleon_runtime.rowsums, chameleon_runtime.buckets),
which the FSDP2 side (chameleon_runtime.sharding) drives.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from planner.plans.rows import rows


@dataclass(frozen=True)
class ShardLayout:
    """Replica groups and columns over ``members`` (sorted global ranks), ``shards``
    members a group; ``sizes``, when given, the size of each group in member order (a
    group re-sharded over its survivors has fewer: chameleon_runtime.reshard)."""

    members: tuple[int, ...]
    shards: int
    sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"shards must be 1 or more, not {self.shards}")
        if self.sizes:
            if sum(self.sizes) != len(self.members) or min(self.sizes) < 1:
                raise ValueError(
                    f"groups of {list(self.sizes)} do not split {len(self.members)} workers"
                )
        elif len(self.members) % self.shards:
            raise ValueError(
                f"{len(self.members)} workers do not make whole replica groups of "
                f"{self.shards} shards"
            )

    @property
    def sharded(self) -> bool:
        return self.shards > 1

    @property
    def even(self) -> bool:
        """Every group whole (S members): the columns hold the same rows."""
        return all(k == self.shards for k in self.group_sizes)

    @property
    def group_sizes(self) -> tuple[int, ...]:
        return self.sizes or (self.shards,) * (len(self.members) // self.shards)

    @property
    def groups(self) -> list[tuple[int, ...]]:
        out, i = [], 0
        for k in self.group_sizes:
            out.append(self.members[i : i + k])
            i += k
        return out

    @property
    def columns(self) -> list[tuple[int, ...]]:
        """The members holding shard ``i``, one per whole group (a group re-sharded
        over fewer members is in no column: its rows are summed by ``segments``)."""
        whole = [g for g in self.groups if len(g) == self.shards]
        return [tuple(g[i] for g in whole) for i in range(self.shards)] if whole else []

    def group_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.groups if rank in g)

    def column_of(self, rank: int) -> tuple[int, ...]:
        group = self.group_of(rank)
        if len(group) != self.shards:
            raise ValueError(f"rank {rank} is in a re-sharded group, in no column")
        return self.columns[group.index(rank)]

    def rows_of(self, rank: int, n: int) -> tuple[int, int]:
        """The rows of an ``n``-row parameter that ``rank`` holds."""
        group = self.group_of(rank)
        return rows(n, len(group))[group.index(rank)]

    def segments(self, rank: int, n: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """``rank``'s rows of an ``n``-row parameter cut where any group's shards meet:
        ``(a, b, holders)``, the holders of rows ``[a, b)`` one per group (sorted). What
        a gradient is summed over: an even layout's is the column, one segment."""
        a, b = self.rows_of(rank, n)
        cuts = {a, b}
        per_group = [rows(n, len(g)) for g in self.groups]
        for spans in per_group:
            cuts.update(x for x, _ in spans if a < x < b)
        edges = sorted(cuts)
        out = []
        for x, y in zip(edges, edges[1:], strict=False):
            holders = tuple(
                sorted(
                    g[next(i for i, (c, d) in enumerate(spans) if c <= x < d)]
                    for g, spans in zip(self.groups, per_group, strict=True)
                )
            )
            out.append((x, y, holders))
        return out

    def collectives(self, row_counts: Iterable[int] = ()) -> list[tuple[int, ...]]:
        """The holder sets a generation builds collective groups for: every member (the
        step's metadata and commit), and, sharded, each group and each column (or, with
        a re-sharded group, each set of holders of a segment of the parameters'
        ``row_counts``)."""
        out = [self.members]
        if self.sharded:
            if self.even:
                sums = self.columns
            else:
                sums = [
                    h
                    for n in set(row_counts)
                    for r in self.members
                    for _, _, h in self.segments(r, n)
                ]
            out += [t for t in [*self.groups, *sums] if len(t) > 1 and t != self.members]
        return sorted(set(out))


def local(t: torch.Tensor) -> torch.Tensor:
    """This member's part of a sharded tensor (a DTensor's local shard), or ``t``."""
    inner = getattr(t, "_local_tensor", None)
    return inner if inner is not None else t


def shown_as(param: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """``view`` (a local gradient) as ``param``'s ``.grad``: a DTensor with the
    parameter's placement for a sharded parameter."""
    if getattr(param, "_local_tensor", None) is None:
        return view
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        view,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
