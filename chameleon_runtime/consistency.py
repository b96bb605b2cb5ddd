"""Replica consistency: data-parallel replicas hold the same weights to the bit (the same
sums, all-reduced, then the same deterministic optimizer step). Whatever breaks that (a
bit flip in a device's memory, a bug, a step applied on one replica and not another) is
silent under DDP: nothing compares replicas. Here every ``check_every`` steps (default
100) the members compare a fingerprint of their weights:

- each computes, per parameter, its 2-norm and its sum (two reductions per tensor on
  its own device), and from them four numbers (the plain sums and sums weighted by fixed
  pseudo-random weights, so that swapped or sign-flipped values also show);
- the four numbers travel in one all-reduce of four per member (each fills its own
  slots; the rest are zeros, so the sums are exact copies): every member sees all.

When they differ, a second all-reduce of the per-parameter values names the first
parameter that differs. A replica outvoted by a strict majority (at least two agreeing)
is healed: every parameter, buffer and optimizer state is sent from the lowest-ranked
member of the majority (a sum with zeros from the others), and a line on stderr says
so. Without a majority (two replicas that disagree, or a tie) nobody can tell which is
right: the job stops with a one-line error.

A sharded model (chameleon_runtime.sharding) is compared shard by shard: the members of
a column (one per replica group) must agree with each other, by the same rule; a heal
sends each shard over its column and the buffers over every member.
Cost: the fingerprint reads every weight once (about what an optimizer step's memory
traffic costs once per 100 steps) and one small all-reduce; measured in
benchmarks/dropin_vs_torchft.py (docs/dataparallel.md).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol

import torch
from torch import nn

from chameleon_runtime.replicagroup import ReplicaGroup
from chameleon_runtime.shardlayout import local
from chameleon_runtime.stepmeta import StepMeta


class Replica(Protocol):
    """What the check reads of the model it watches (chameleon_runtime.dataparallel)."""

    replicas: ReplicaGroup
    module: nn.Module
    sharded: bool  # compared shard by shard
    meta: StepMeta
    optimizers: list[Any]  # each with .optimizer, the inner one


DEFAULT_CHECK_EVERY = 100
_WIDTH = 4  # numbers per member in the first round


class ReplicasDiverged(RuntimeError):
    """Replicas hold different weights and no majority says which are right."""


class Consistency:
    def __init__(self, model: Replica, every: int) -> None:
        if every < 0:
            raise ValueError(f"check_every must be 0 (off) or a number of steps, not {every}")
        self.model = model
        self.every = every
        self.last_checked = -1
        self.checks = 0
        self.seconds = 0.0  # spent checking (benchmarks/dropin_vs_torchft.py reports it)

    def maybe_check(self, step: int) -> None:
        if (
            not self.every
            or step <= 0
            or step % self.every
            or step == self.last_checked
            or not self.model.replicas.distributed
            # a group re-sharded over its survivors cuts its rows elsewhere than its
            # column peers: no fingerprint compares them (every member sees the same
            # layout, so every member skips alike) until the group is whole again
            or not self.model.replicas.layout_now().even
        ):
            return
        start = time.perf_counter()
        self.check(step)
        self.seconds += time.perf_counter() - start
        self.last_checked = step

    def _values(self) -> torch.Tensor:
        """Per parameter: its 2-norm and its sum, in float64 on the host."""
        out = []
        with torch.no_grad():
            for p in self.model.module.parameters():
                p = local(p)  # (a shard: chameleon_runtime.sharding)
                out.append(torch.linalg.vector_norm(p).to(torch.float64))
                out.append(p.sum().to(torch.float64))
        return torch.stack(out).cpu() if out else torch.zeros(0, dtype=torch.float64)

    def fingerprint(self) -> torch.Tensor:
        values = self._values()
        g = torch.Generator().manual_seed(0x5EED)
        weights = torch.rand(len(values), generator=g, dtype=torch.float64) + 0.5
        norms, sums = values[0::2], values[1::2]
        return torch.stack(
            [norms.sum(), sums.sum(), (norms * weights[0::2]).sum(), (sums * weights[1::2]).sum()]
        )

    def _gather(self, mine: torch.Tensor, members: list[int], me: int) -> torch.Tensor:
        width = mine.numel()
        slots = torch.zeros(len(members) * width, dtype=torch.float64)
        slots[me * width : (me + 1) * width] = mine
        self.model.replicas.allreduce(slots)
        return slots.view(len(members), width)

    def check(self, step: int) -> None:
        group = self.model.replicas
        members = group.members()
        me = members.index(group.rank)
        self.checks += 1
        rows = self._gather(self.fingerprint(), members, me)
        bits = rows.contiguous().view(torch.int64).tolist()
        # the members that must agree: all, or each column of a sharded model (a group
        # re-sharded over its survivors is in none: its shards cut the rows elsewhere)
        if self.model.sharded:
            columns = [[members.index(r) for r in c] for c in group.layout_now().columns]
        else:
            columns = [list(range(len(members)))]
        verdicts = [_verdict(bits, column) for column in columns]
        if all(len(classes) == 1 for classes, _ in verdicts):
            return
        values: torch.Tensor | None = None  # per-parameter values: only now (rare)
        sources: dict[int, int] = {}
        said: list[str] = []
        for column, (classes, majority) in zip(columns, verdicts, strict=True):
            if len(classes) == 1:
                sources.update({i: column[0] for i in column})
                continue
            if values is None:
                values = self._gather(self._values(), members, me)
            drifted = sorted(i for i in column if i not in majority)
            names = [n for n, _ in self.model.module.named_parameters()]
            vbits = values.contiguous().view(torch.int64)
            differ = (vbits[drifted[0]] != vbits[majority[0]]).nonzero().flatten().tolist()
            where = repr(names[differ[0] // 2]) if differ else "a parameter"
            if len(majority) < 2 or len(majority) * 2 <= len(column):
                raise ReplicasDiverged(
                    f"chameleon: replicas hold different weights at step {step} (ranks "
                    f"{[members[i] for i in column]} fall into {len(classes)} "
                    f"groups; first difference in {where}) and no majority says which are "
                    "right: stopped"
                )
            sources.update({i: majority[0] for i in column})
            said.append(
                f"rank(s) {[members[i] for i in drifted]} held weights different from the "
                f"others' (first in {where}); healed from rank {members[majority[0]]}"
            )
        source = members[sources[me]]
        self._heal_from(source, members[sources[0]], sharded=self.model.sharded)
        if me == min(sources.values()):
            print(
                f"chameleon_runtime: replica consistency check at step {step}: " + "; ".join(said),
                file=sys.stderr,
                flush=True,
            )

    def _heal_from(self, source: int, buffers_from: int, *, sharded: bool = False) -> None:
        """Every parameter and optimizer state as ``source`` holds it, the buffers as
        ``buffers_from`` does (sharded: ``source`` is this member's column's)."""
        model = self.model
        tensors: list[torch.Tensor] = [local(p.data) for p in model.module.parameters()]
        if not sharded:
            tensors += model.meta.buffers
        for optimizer in model.optimizers:  # in parameter order: the same on every member
            inner = optimizer.optimizer
            for group in inner.param_groups:
                for p in group["params"]:
                    state = inner.state.get(p, {})
                    tensors += [local(state[k]) for k in sorted(state) if torch.is_tensor(state[k])]
        tensors = [t for t in tensors if t.dtype != torch.bool]
        model.replicas.broadcast_from(source, tensors, column=sharded)
        if sharded:
            model.replicas.broadcast_from(buffers_from, list(model.meta.buffers))
        model.meta.committed = model.meta.flat_buffers()


def _verdict(
    bits: list[list[int]], column: list[int]
) -> tuple[dict[tuple[int, ...], list[int]], list[int]]:
    """The classes of identical fingerprints among ``column``'s members (by their bits:
    replicas that all hold NaN agree, though NaN != NaN as floats) and the largest."""
    classes: dict[tuple[int, ...], list[int]] = {}
    for i in column:
        classes.setdefault(tuple(bits[i]), []).append(i)
    return classes, max(classes.values(), key=len)
