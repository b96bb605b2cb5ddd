"""The passes of a set of routes timed level by level: ``simulate_compute`` as array
arithmetic, for the rerouted components a step graph has.

The estimator times a plain pipeline on the phi grid (``timing.simulate_pipeline``), but
a rerouted pipeline and the peers that serve it form one component of the step graph,
which the event-driven walk (``timing.simulate_compute``) visits op by op in Python. At
16k workers such a component can hold every worker of the plan (a plan of 16 pipelines of
127 stages, one stage lost: its 128 micro-batches go through the 15 other pipelines), half
a million passes, about two seconds a visit; a simulated 54-day run asks hundreds.

The graph is the same, so the answer is too (tests/test_wavefront.py holds them equal to
the last bit): every worker runs its passes in increasing (phi, tie rank of the home
pipeline, micro-batch), the order ``planner.plans.program.ops_for`` gives the runtime, and every
dependency between workers raises phi by exactly one (``planner.plans.program``). So the passes
at one phi depend only on passes at lower phi and on the passes before them on their own
worker: visiting phi levels in order, and within a level each worker's k-th pass at that
phi in the k-th sweep, is a topological order, and each sweep is a handful of array
operations over all the workers at once:

    end = max(end of the worker's previous pass, end of the input's pass + its transfer)
          + the pass's duration

the same max-then-add ``simulate_compute`` does, in the same float64.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain

import numpy as np

from planner.job.cost import CostModel
from planner.plans.plan import Route


def time_routes(
    routes: Sequence[Route],
    position: Mapping[int, int],
    rank: Mapping[int, int],
    ranges: Mapping[int, tuple[int, int]],
    costs: CostModel,
    order: Sequence[int],
) -> tuple[list[float], list[int]]:
    """When each worker of ``order`` ends its last pass over ``routes`` (from the step's
    start), and the most micro-batches it has in flight; a worker on no route ends at 0.

    ``routes`` must be closed: every worker they visit is in ``order``; ``position`` and
    ``rank`` are the plan's ``position_in_home`` and ``tie_rank``.
    """
    ops = _Ops(routes, position, rank, ranges, costs)
    if not ops.size:
        return [0.0] * len(order), [0] * len(order)
    end = ops.walk()
    last_end, peak = ops.per_worker(end)
    return (
        [last_end.get(w, 0.0) for w in order],
        [peak.get(w, 0) for w in order],
    )


class _Ops:
    """Every pass of the routes as parallel arrays: its worker, phi, home, micro-batch,
    the pass it receives its input from (-1: none), that transfer and its own duration.

    Built route-free: a rerouted plan has a route per distinct path, over a thousand after
    a few hundred failures, so nothing below loops over routes or passes in Python.
    Forwards come first, hop by hop and micro-batch by micro-batch within each route, so
    the pass a forward needs (same micro-batch, previous hop) is m places back; the
    backwards follow in the same layout and look m places ahead.
    """

    def __init__(
        self,
        routes: Sequence[Route],
        position: Mapping[int, int],
        rank: Mapping[int, int],
        ranges: Mapping[int, tuple[int, int]],
        costs: CostModel,
    ) -> None:
        routes = [r for r in routes if r.micro_batches]
        i64 = np.int64
        n = np.fromiter((len(r.hops) for r in routes), i64, len(routes))
        m = np.fromiter((len(r.micro_batches) for r in routes), i64, len(routes))
        self.size = 2 * int(n @ m)
        if not self.size:
            return
        hops = np.fromiter(chain.from_iterable(r.hops for r in routes), i64, int(n.sum()))
        mbs = np.fromiter(chain.from_iterable(r.micro_batches for r in routes), i64, int(m.sum()))
        q = np.fromiter((position[mb] for mb in mbs.tolist()), i64, len(mbs))
        homes = np.fromiter((rank[r.home] for r in routes), i64, len(routes))

        # Per hop: its route, its index k on it, the micro-batches through it.
        hop_route = np.repeat(np.arange(len(routes)), n)
        k = np.arange(len(hops)) - np.repeat(_starts(n), n)
        n_hop, m_hop = n[hop_route], m[hop_route]
        # Per worker (as the cost model has them): pass times, bytes received.
        by_worker = _PerWorker(ranges, costs)
        w_next = np.where(
            k < n_hop - 1, hops[np.minimum(np.arange(len(hops)) + 1, len(hops) - 1)], hops
        )
        w_prev = np.where(k > 0, hops[np.maximum(np.arange(len(hops)) - 1, 0)], hops)
        fwd_in = np.where(k > 0, costs.transfers_s(w_prev, hops, by_worker.fwd_bytes[hops]), 0.0)
        bwd_in = np.where(
            k < n_hop - 1, costs.transfers_s(w_next, hops, by_worker.bwd_bytes[hops]), 0.0
        )

        # Per forward pass: its hop, and its micro-batch's index among the route's.
        op_hop = np.repeat(np.arange(len(hops)), m_hop)
        j = np.arange(len(op_hop)) - np.repeat(_starts(m_hop), m_hop)
        mb_at = _starts(m)[hop_route[op_hop]] + j
        q2, kk, nn, mm = 2 * q[mb_at], k[op_hop], n_hop[op_hop], m_hop[op_hop]
        half = len(op_hop)
        index = np.arange(half)
        workers = hops[op_hop]
        self.worker = np.concatenate((workers, workers))
        self.phi = np.concatenate((q2 + kk, q2 + 2 * nn - 1 - kk))
        self.dep = np.concatenate(
            (np.where(kk > 0, index - mm, -1), np.where(kk < nn - 1, half + index + mm, -1))
        )
        self.xfer = np.concatenate((fwd_in[op_hop], bwd_in[op_hop]))
        self.dur = np.concatenate((by_worker.fwd_s[workers], by_worker.bwd_s[workers]))
        self.fwd = np.arange(self.size) < half
        home = homes[hop_route[op_hop]]
        mb = mbs[mb_at]
        # Each worker's passes in its program order (planner.plans.program.ops_for). A
        # worker passes a micro-batch once each way, at phis of opposite parity (2q + k
        # forward, 2q + 2n - 1 - k back): the keys are distinct.
        self.seq = _order(self.worker, self.phi, np.tile(home, 2), np.tile(mb, 2), distinct=True)

    def walk(self) -> np.ndarray:
        """Every pass's end time, sweep by sweep (module doc)."""
        seq, worker, phi = self.seq, self.worker[self.seq], self.phi[self.seq]
        size = self.size
        same_worker = np.zeros(size, dtype=bool)
        same_worker[1:] = worker[1:] == worker[:-1]
        # The pass before each on its worker; ``size`` names a pass that ended at 0.
        before = np.full(size, size, dtype=np.int64)
        before[seq[1:][same_worker[1:]]] = seq[:-1][same_worker[1:]]
        # Its rank among its worker's passes at the same phi.
        new_run = ~same_worker
        new_run[1:] |= phi[1:] != phi[:-1]
        at = np.arange(size)
        rank = np.empty(size, dtype=np.int64)
        rank[seq] = at - np.maximum.accumulate(np.where(new_run, at, 0))
        dep = np.where(self.dep < 0, size, self.dep)
        sweep = _order(self.phi, rank)
        keys = self.phi[sweep] * (1 + int(rank.max())) + rank[sweep]
        cuts = np.flatnonzero(keys[1:] != keys[:-1]) + 1
        end = np.zeros(size + 1)
        xfer, dur = self.xfer, self.dur
        for ops in np.split(sweep, cuts):
            end[ops] = np.maximum(end[before[ops]], end[dep[ops]] + xfer[ops]) + dur[ops]
        return end[:size]

    def per_worker(self, end: np.ndarray) -> tuple[dict[int, float], dict[int, int]]:
        """Each worker's last end and its peak of micro-batches in flight (a forward
        stashes one, its backward frees it), read along its program order."""
        seq = self.seq
        worker = self.worker[seq]
        starts = np.flatnonzero(np.r_[True, worker[1:] != worker[:-1]])
        ends_at = np.r_[starts[1:], len(seq)] - 1
        level = np.cumsum(np.where(self.fwd[seq], 1, -1))
        offset = np.where(starts > 0, level[starts - 1], 0)
        peak = np.maximum(np.maximum.reduceat(level, starts) - offset, 0)
        names = worker[starts].tolist()
        return (
            dict(zip(names, end[seq[ends_at]].tolist(), strict=True)),
            dict(zip(names, peak.tolist(), strict=True)),
        )


def _order(*keys: np.ndarray, distinct: bool = False) -> np.ndarray:
    """The permutation sorting by ``keys`` (non-negative ints, most significant first),
    ties kept in place: packed into one int64 where they fit, which sorts several times
    faster than lexsort; into 16 bits where they fit, which numpy sorts by radix, ten
    times faster again. ``distinct``: no two passes have equal keys, so any sort gives
    the same permutation, and the unstable one is twice as fast."""
    widths = [max(1, int(k.max()).bit_length()) for k in keys]
    if sum(widths) > 62:
        return np.lexsort(keys[::-1])
    packed = np.zeros(len(keys[0]), dtype=np.int64)
    for k, width in zip(keys, widths, strict=True):
        packed = (packed << width) | k
    if sum(widths) <= 16:
        return np.argsort(packed.astype(np.uint16), kind="stable")
    return np.argsort(packed, kind="quicksort" if distinct else "stable")


def _starts(counts: np.ndarray) -> np.ndarray:
    """Where each of consecutive blocks of ``counts`` elements starts."""
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)


class _PerWorker:
    """Pass times and received bytes as arrays indexed by worker id, each computed once
    per distinct layer range (a plan has few)."""

    def __init__(self, ranges: Mapping[int, tuple[int, int]], costs: CostModel) -> None:
        top = max(ranges, default=0) + 1
        self.fwd_s, self.bwd_s = np.zeros(top), np.zeros(top)
        self.fwd_bytes = np.zeros(top, dtype=np.int64)
        self.bwd_bytes = np.zeros(top, dtype=np.int64)
        seen: dict[tuple[int, int, float], tuple[float, float, int, int]] = {}
        job = costs.job
        for w, (first, end) in ranges.items():
            key = (first, end, job.slowdown(w))
            row = seen.get(key)
            if row is None:
                row = seen[key] = (
                    costs.forward_s(first, end, w),
                    costs.backward_s(first, end, w),
                    costs.boundary_bytes(first),
                    costs.boundary_bytes(end),
                )
            self.fwd_s[w], self.bwd_s[w], self.fwd_bytes[w], self.bwd_bytes[w] = row
