"""Weight migration as bipartite matching (PAPER.md, restorer).

``assign_slots`` puts surviving workers into the new plan's slots (a slot is a stage: a
layer range in a pipeline) so that the bytes they must receive, parameters and optimizer
state they do not already hold, are minimal: a minimum-cost bipartite matching.

Two exact reductions keep it small at 16k workers before the matching runs:
1. an old pipeline that survived whole and has the same stage boundaries as a new one is
   kept whole (cost 0, and its hops stay where they were);
2. a worker that holds exactly a slot's range takes it. This never hurts: with cost
   c(w, s) = bytes of s that w lacks, c(e, t) <= c(d, t) + c(e, s) whenever d holds exactly
   s, so swapping d onto s in any optimal matching does not raise its cost.
The rest is matched exactly (Hungarian algorithm) up to ``EXACT_LIMIT`` slots, and greedily
by largest overlap beyond that, where the exact algorithm's cubic time would not fit the
planner's budget.

``choose_sources`` then picks, for every missing piece of a worker's new range, one
surviving holder to send it, the least loaded one first, so that no worker sends much more
than the others.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planner.job.cost import CostModel

EXACT_LIMIT = 64

Range = tuple[int, int]


def _overlap(a: Range, b: Range) -> Range | None:
    first, end = max(a[0], b[0]), min(a[1], b[1])
    return (first, end) if first < end else None


def missing_bytes(costs: CostModel, held: Range | None, want: Range) -> int:
    total = costs.moved_bytes(*want)
    if held is not None and (common := _overlap(held, want)) is not None:
        total -= costs.moved_bytes(*common)
    return total


def assign_slots(
    costs: CostModel,
    *,
    holdings: Mapping[int, Range],
    old_pipelines: Sequence[Sequence[int]],
    new_pipelines: Sequence[Sequence[Range]],
    workers: Sequence[int],
) -> list[list[int]]:
    """Workers for every slot of every new pipeline, minimising the bytes to receive.

    ``holdings`` maps each surviving worker to the layer range it holds now; workers with
    no state (spares, replacements) may be missing from it. ``workers`` are the ones to
    place; there must be at least as many as slots.
    """
    num_slots = sum(len(p) for p in new_pipelines)
    if num_slots > len(workers):
        raise ValueError(f"{num_slots} slots but only {len(workers)} workers")
    free = set(workers)
    result: list[list[int | None]] = [[None] * len(p) for p in new_pipelines]

    # 1. Whole surviving pipelines with the same boundaries.
    by_ranges: dict[tuple[Range, ...], list[Sequence[int]]] = {}
    for old in old_pipelines:
        if all(w in free and w in holdings for w in old):
            by_ranges.setdefault(tuple(holdings[w] for w in old), []).append(old)
    for j, ranges in enumerate(new_pipelines):
        candidates = by_ranges.get(tuple(ranges))
        if candidates:
            old = candidates.pop(0)
            result[j] = list(old)
            free.difference_update(old)

    # 2. Workers that hold exactly a slot's range.
    exact: dict[Range, list[int]] = {}
    for w in sorted(free):
        if w in holdings:
            exact.setdefault(holdings[w], []).append(w)
    for j, ranges in enumerate(new_pipelines):
        for i, want in enumerate(ranges):
            if result[j][i] is None and exact.get(want):
                w = exact[want].pop(0)
                result[j][i] = w
                free.discard(w)

    # 3. The rest: exact matching when small, greedy overlap when large.
    open_slots = [(j, i) for j, p in enumerate(result) for i, w in enumerate(p) if w is None]
    if open_slots:
        chosen = (_match_exact if len(open_slots) <= EXACT_LIMIT else _match_greedy)(
            costs, holdings, new_pipelines, open_slots, sorted(free)
        )
        for (j, i), w in zip(open_slots, chosen, strict=True):
            result[j][i] = w
    return [[w for w in p if w is not None] for p in result]


def _match_exact(
    costs: CostModel,
    holdings: Mapping[int, Range],
    new_pipelines: Sequence[Sequence[Range]],
    slots: list[tuple[int, int]],
    workers: list[int],
) -> list[int]:
    matrix = [
        [missing_bytes(costs, holdings.get(w), new_pipelines[j][i]) for w in workers]
        for j, i in slots
    ]
    return [workers[col] for col in hungarian(matrix)]


def hungarian(cost: Sequence[Sequence[float]]) -> list[int]:
    """Minimum-cost assignment of every row to a distinct column (rows <= columns).

    The Hungarian algorithm with potentials (Kuhn 1955; Munkres 1957), O(rows^2 * cols):
    each row is added by a shortest augmenting path over reduced costs.
    """
    n = len(cost)
    m = len(cost[0]) if n else 0
    if n > m:
        raise ValueError("more rows than columns")
    inf = float("inf")
    u = [0.0] * (n + 1)  # row potentials (1-based; 0 is the virtual root)
    v = [0.0] * (m + 1)
    owner = [0] * (m + 1)  # row assigned to each column, 0 = free
    way = [0] * (m + 1)
    for row in range(1, n + 1):
        owner[0] = row
        col0 = 0
        min_reduced = [inf] * (m + 1)
        used = [False] * (m + 1)
        while True:
            used[col0] = True
            r0 = owner[col0]
            delta, col1 = inf, 0
            costs_r0 = cost[r0 - 1]
            u_r0 = u[r0]
            for col in range(1, m + 1):
                if not used[col]:
                    reduced = costs_r0[col - 1] - u_r0 - v[col]
                    if reduced < min_reduced[col]:
                        min_reduced[col] = reduced
                        way[col] = col0
                    if min_reduced[col] < delta:
                        delta, col1 = min_reduced[col], col
            for col in range(m + 1):
                if used[col]:
                    u[owner[col]] += delta
                    v[col] -= delta
                else:
                    min_reduced[col] -= delta
            col0 = col1
            if owner[col0] == 0:
                break
        while col0:  # flip the augmenting path
            col1 = way[col0]
            owner[col0] = owner[col1]
            col0 = col1
    assignment = [0] * n
    for col in range(1, m + 1):
        if owner[col]:
            assignment[owner[col] - 1] = col - 1
    return assignment


def _match_greedy(
    costs: CostModel,
    holdings: Mapping[int, Range],
    new_pipelines: Sequence[Sequence[Range]],
    slots: list[tuple[int, int]],
    workers: list[int],
) -> list[int]:
    groups: dict[Range | None, deque[int]] = {}
    for w in workers:
        groups.setdefault(holdings.get(w), deque()).append(w)
    # Slots repeat the same few ranges: rank the holdings once per range wanted, then
    # take the best one with a worker left (what a min over the non-empty ones gives).
    # A group only empties, so each ranking keeps how far its emptied head reaches.
    ranked: dict[Range, tuple[list[Range | None], list[int]]] = {}
    chosen = []
    for j, i in slots:
        want = new_pipelines[j][i]
        found = ranked.get(want)
        if found is None:
            order = sorted(
                groups, key=lambda g: (missing_bytes(costs, g, want), g is None, g or (0, 0))
            )
            found = ranked[want] = (order, [0])
        order, head = found
        while not groups[order[head[0]]]:
            head[0] += 1
        chosen.append(groups[order[head[0]]].popleft())
    return chosen


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    first_layer: int
    end_layer: int
    num_bytes: int


class LostLayers(ValueError):
    """Some layers have no surviving holder: only a checkpoint has them."""


def every_layer_held(holdings: Mapping[int, Range], num_layers: int) -> bool:
    """Whether every layer has a holder: exactly when ``choose_sources`` can serve any
    target that covers the model (it raises ``LostLayers`` otherwise). A missing piece
    never straddles a holding's boundary, so a holder of any of its layers holds it all;
    and a layer nobody holds is missing from whichever worker a target gives it to. So
    whether layers can move at all is known before any target is placed."""
    reach = 0
    for first, end in sorted(holdings.values()):
        if first > reach:
            return False
        reach = max(reach, end)
    return reach >= num_layers


def _missing_pieces(held: Range | None, want: Range, cuts: Sequence[int]) -> list[Range]:
    """Parts of ``want`` not in ``held``, split at old stage boundaries ``cuts``."""
    parts = [want]
    if held is not None:
        parts = [
            p
            for p in ((want[0], min(want[1], held[0])), (max(want[0], held[1]), want[1]))
            if p[0] < p[1]
        ]
    pieces: list[Range] = []
    for first, end in parts:
        inner = [c for c in cuts if first < c < end]
        bounds = [first, *inner, end]
        pieces.extend(zip(bounds, bounds[1:], strict=False))
    return pieces


def choose_sources(
    costs: CostModel,
    *,
    holdings: Mapping[int, Range],
    targets: Mapping[int, Range],
    balanced: bool = True,
) -> list[Transfer]:
    """One transfer per missing piece. ``balanced`` picks the least-loaded surviving
    holder (largest pieces first); otherwise the first holder, as Oobleck does."""
    cuts = sorted({b for r in holdings.values() for b in r})
    # Holders grouped by the range they hold (a plan has few ranges, thousands of holders).
    by_range: dict[Range, list[int]] = {}
    for w, r in holdings.items():
        by_range.setdefault(r, []).append(w)
    holders_of: dict[Range, list[int]] = {}
    needs: list[tuple[int, Range]] = []
    for dst, want in sorted(targets.items()):
        held = holdings.get(dst)
        if held is not None and held[0] <= want[0] and want[1] <= held[1]:
            continue  # (most workers keep their layers: nothing to fetch)
        for piece in _missing_pieces(held, want, cuts):
            needs.append((dst, piece))
            if piece not in holders_of:
                holders_of[piece] = sorted(
                    w
                    for r, ws in by_range.items()
                    if r[0] <= piece[0] and piece[1] <= r[1]
                    for w in ws
                )
                if not holders_of[piece]:
                    raise LostLayers(f"layers {piece[0]}..{piece[1] - 1} lost every replica")
    sent = dict.fromkeys(holdings, 0.0)
    order = sorted(range(len(needs)), key=lambda k: (-costs.moved_bytes(*needs[k][1]), k))
    transfers: list[Transfer | None] = [None] * len(needs)
    job = costs.job
    node = {w: job.node_of(w) for w in holdings}  # (a transfer's link: within dst's node or not)
    on_node: dict[int, list[int]] = {}
    for w in sorted(holdings):
        on_node.setdefault(node[w], []).append(w)
    # Per piece, its holders by load over the far link (a heap whose entries go stale as
    # their senders' loads grow: refreshed when they surface).
    far_heaps: dict[Range, tuple[list[tuple[float, int]], set[int]]] = {}
    for k in order if balanced else range(len(needs)):
        dst, piece = needs[k]
        num_bytes = costs.moved_bytes(*piece)
        candidates = holders_of[piece]
        if balanced:
            # The least loaded holder counting its link to dst, min over the candidates of
            # (sent + near or far, w): the far ones' best off the heap, the few on dst's
            # node looked at each (thousands of candidates, two links).
            near, far = job.intra_link.transfer_s(num_bytes), job.inter_link.transfer_s(num_bytes)
            home = job.node_of(dst)
            if piece not in far_heaps:
                heap = [(sent[w] + far, w) for w in candidates]
                heapq.heapify(heap)
                far_heaps[piece] = (heap, set(candidates))
            heap, held = far_heaps[piece]
            best = _least_loaded_far(heap, sent, far, node, home)
            for w in on_node.get(home, ()):
                if w in held and (best is None or (sent[w] + near, w) < best):
                    best = (sent[w] + near, w)
            assert best is not None
            src = best[1]
        else:
            src = candidates[0]
        sent[src] += costs.transfer_s(src, dst, num_bytes)
        transfers[k] = Transfer(src, dst, piece[0], piece[1], num_bytes)
    return [t for t in transfers if t is not None]


def _least_loaded_far(
    heap: list[tuple[float, int]],
    sent: Mapping[int, float],
    far: float,
    node: Mapping[int, int],
    home: int,
) -> tuple[float, int] | None:
    """The least (sent + far, w) on ``heap`` among workers off node ``home``: stale
    entries (their worker has sent more since) are refreshed in place until a fresh one
    tops the heap; those on ``home`` (near, not far) are set aside and put back."""
    aside = []
    best = None
    while heap:
        value, w = heap[0]
        fresh = sent[w] + far
        if value != fresh:
            heapq.heapreplace(heap, (fresh, w))
        elif node[w] == home:
            aside.append(heapq.heappop(heap))
        else:
            best = (value, w)
            break
    for entry in aside:
        heapq.heappush(heap, entry)
    return best
