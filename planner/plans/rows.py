"""Which rows of a sharded parameter each member of a replica group holds, and which
rows move, and from whom, when a group is re-sharded over other members (HSDP:
chameleon_runtime.sharding, chameleon_runtime.reshard). Pure: the planner prices the
moves, the runtime carries them out, both from these functions.

FSDP2 shards a parameter of ``n`` rows (dim 0) over ``k`` members in chunks of
``ceil(n / k)`` rows, the last chunks short or empty (``rows``). A group re-sharded from
``k`` members to others cuts the rows elsewhere; each member of the new group needs its
new rows (``row_moves``), taken, in this order of preference, from what it holds itself,
from a live member of its old group, from a whole group whose layout did not change
(the same rows of a peer group: the matched migration of the paper, applied to shards),
the peer group chosen per receiver in turn so that the sources share the load, and, if
no group is whole any more, from any live member that holds them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Group = tuple[int, ...]


class LostRows(ValueError):
    """Rows no live member holds: only a checkpoint has them."""


def rows(n: int, k: int) -> list[tuple[int, int]]:
    """FSDP2's ``Shard(0)`` of ``n`` rows over ``k`` members: member ``i`` holds rows
    ``[a, b)`` (chunks of ceil(n / k), the last ones short or empty: torch.chunk)."""
    c = -(-n // k) if n else 0
    return [(min(i * c, n), min((i + 1) * c, n)) for i in range(k)]


def row_moves(
    old_groups: Sequence[Group], new_groups: Sequence[Group], n: int
) -> list[tuple[int, int, int, int]]:
    """``(src, dst, a, b)``: rows ``[a, b)`` of an ``n``-row parameter that ``dst``, a
    member of a new group that is not an old one, takes from ``src`` (``src == dst``: it
    keeps them). The members of the new groups are the live ones (module doc); one that
    held nothing (a replacement) takes no rows here: it is healed whole, from the member
    of a whole group that holds its shard (chameleon_runtime.heal)."""
    live = {r for g in new_groups for r in g}
    held = {r: span for g in old_groups for r, span in zip(g, rows(n, len(g)), strict=True)}
    old_group_of = {r: g for g in old_groups for r in g}
    kept = [g for g in new_groups if g in old_groups]  # whole groups whose shards stay put
    moves: list[tuple[int, int, int, int]] = []
    turn = 0
    for group in new_groups:
        if group in old_groups:
            continue
        for dst, (a, b) in zip(group, rows(n, len(group)), strict=True):
            if a == b or dst not in held:  # (a member that held nothing is healed whole)
                continue
            mates = [m for m in old_group_of.get(dst, ()) if m in live and m != dst]
            peers = list(kept[turn % len(kept)]) if kept else []
            turn += 1
            anyone = [r for g in old_groups for r in g if r in live]  # (no whole group left)
            need = [(a, b)]
            for src in dict.fromkeys([dst, *mates, *peers, *anyone]):
                if src not in held or not need:
                    continue
                c, d = held[src]
                left = []
                for x, y in need:
                    lo, hi = max(x, c), min(y, d)
                    if lo < hi:
                        moves.append((src, dst, lo, hi))
                        left += [s for s in ((x, lo), (hi, y)) if s[0] < s[1]]
                    else:
                        left.append((x, y))
                need = left
            if need:
                raise LostRows(f"rows {need} of a parameter of {n} rows have no live holder")
    return moves


def move_pairs(
    old_groups: Sequence[Group], new_groups: Sequence[Group]
) -> list[tuple[int, int, float]]:
    """``(src, dst, share)`` of a re-shard, each pair once: the share of a parameter
    ``dst`` takes from ``src`` (of a large one, where rounding does not matter), as the
    planner prices and schedules them."""
    n = 1024 * math.lcm(*{len(g) for g in [*old_groups, *new_groups]})
    share: dict[tuple[int, int], float] = {}
    for src, dst, a, b in row_moves(old_groups, new_groups, n):
        if src != dst:
            share[(src, dst)] = share.get((src, dst), 0.0) + (b - a) / n
    return [(s, d, f) for (s, d), f in sorted(share.items())]
