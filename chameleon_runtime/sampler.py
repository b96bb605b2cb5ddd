"""``ElasticSampler``: in place of ``DistributedSampler``, the global batch of every step
dealt to the workers that are members now.

A step covers a fixed global batch, whoever computes it: step ``s`` of epoch ``e`` is the
``G`` samples at positions ``k*G ... (k+1)*G - 1`` of the epoch's permutation (``k`` the
step within the epoch; ``torch.randperm`` seeded with ``seed + e``, as DistributedSampler
draws it). Those ``G`` samples are ``M = G / m`` micro-batches of ``m``: micro-batch ``j``
takes positions ``k*G + i*M + j`` for ``i < m``. Member ``p`` of ``n`` (ranks sorted)
computes the micro-batches ``j`` with ``j % n == p``. With one micro-batch per member
(``G = n * m``) member ``p``'s batch is exactly DistributedSampler's for rank ``p``; with
fewer members each takes more micro-batches of the same size (gradient accumulation,
the rule ReCycle uses), so a step's gradient is the same sum over the same samples.
A plan may deal a step unevenly (a slow member given fewer micro-batches:
planner.choice.stragglers): then each member computes the micro-batches its route in the
plan lists (``shares``), the same global batch dealt otherwise.

Epochs end at the last full global batch (``drop_last``): every step has the same size.
It is a batch sampler: ``DataLoader(dataset, batch_sampler=sampler)``, one micro-batch
per iteration, and ``set_epoch`` as for DistributedSampler.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence, Sized
from dataclasses import dataclass

import torch
from torch.utils.data import IterableDataset

from planner.plans.plan import Plan, turn_counts


@dataclass(frozen=True)
class MicroBatch:
    """What one iteration of the loader is: micro-batch ``index`` of global step ``step``,
    and whether it is this worker's last of that step (the one whose backward syncs)."""

    step: int
    index: int
    last: bool
    deal: int = 0  # the sampler's deal it belongs to (a recovery starts a new one)


def deal(
    num_micro_batches: int,
    members: list[int],
    rank: int,
    shards: int = 1,
    sizes: Sequence[int] = (),
) -> list[int]:
    """The micro-batches of a step that ``rank`` computes among ``members``. A sharded
    model's replica groups (``shards`` consecutive members, or ``sizes`` when a group was
    re-sharded over its survivors: chameleon_runtime.sharding) take them a turn at a
    time, one micro-batch to each member, the groups in turn, each group as many turns as
    ``turn_counts`` gives it: every member of a group runs as many as the others (their
    collectives are the group's). With one group of one this is ``j % n == p``, and with
    whole turns for every group too."""
    ranks = sorted(members)
    p, n = ranks.index(rank), len(ranks)
    if shards == 1:
        return [j for j in range(num_micro_batches) if j % n == p]
    sizes = list(sizes) or [shards] * (n // shards)
    turns = turn_counts(num_micro_batches, sizes)
    if turns is None:
        raise ValueError(f"{num_micro_batches} micro-batches are no whole turns of groups {sizes}")
    starts = [sum(sizes[:g]) for g in range(len(sizes))]
    group = max(g for g in range(len(sizes)) if starts[g] <= p)
    place = p - starts[group]
    out, j = [], 0
    for turn in range(max(turns)):
        for g, k in enumerate(sizes):
            if turns[g] > turn:
                if g == group:
                    out.append(j + place)
                j += k
    return out


def uneven_shares(plan: Plan, shards: int = 1) -> dict[int, tuple[int, ...]] | None:
    """A data-parallel plan's micro-batches per member, where they are not ``deal``'s
    even ones (a plan that deals a slow member fewer); None where they are, so that an
    even plan computes exactly what it always has. Every member of such a plan has at
    least one (a member with none would never run the script's loop body, whose
    backward joins the step's sums; the planner leaves such a worker out instead)."""
    if shards > 1:
        return None  # (replica groups run whole turns: chameleon_runtime.sharding)
    workers = sorted(plan.workers)
    total, n = plan.num_micro_batches, len(workers)
    even = {w: total // n + (p < total % n) for p, w in enumerate(workers)}  # deal()'s counts
    if plan.load() == even:
        return None
    shares: dict[int, list[int]] = {w: [] for w in workers}
    for route in plan.routes:
        for w in route.hops:
            shares[w].extend(route.micro_batches)
    if not all(shares.values()):
        return None  # (a member given none would never join the step's sums: dealt evenly)
    return {w: tuple(sorted(mbs)) for w, mbs in shares.items()}


class ElasticSampler:
    """A batch sampler over a map-style dataset (anything with ``len``)."""

    def __init__(
        self,
        dataset: Sized,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if isinstance(dataset, IterableDataset):
            raise TypeError(
                "ElasticSampler deals samples by index, so it needs a map-style dataset "
                "(len() and [i]); an IterableDataset cannot be dealt again after a recovery: "
                "wrap the data in a map-style Dataset"
            )
        if global_batch_size % micro_batch_size:
            raise ValueError(
                f"global_batch_size {global_batch_size} is not a multiple of "
                f"micro_batch_size {micro_batch_size}"
            )
        self.size = len(dataset)
        if self.size < global_batch_size:
            raise ValueError(
                f"the dataset has {self.size} samples, fewer than one global batch "
                f"({global_batch_size})"
            )
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        self.members = list(range(world))  # who computes steps now (DataParallel updates it)
        self.shards = 1  # a sharded model's replica groups (ElasticDataParallel sets it)
        self.sizes: tuple[int, ...] = ()  # their sizes, when a group was re-sharded
        # An uneven deal (``uneven_shares``): each member's micro-batches; None: dealt evenly
        self.shares: dict[int, tuple[int, ...]] | None = None
        self.epoch = 0
        self.step = 0  # the next step to run, global (counted over epochs)
        self._order: tuple[int, torch.Tensor] | None = None  # an epoch's permutation
        self.issued: list[MicroBatch] = []  # yielded, not yet run (DataParallel pops them)
        self.deal_id = 0  # which deal (membership) the micro-batches issued now belong to
        self._rewound: int | None = None
        self.iterating = False  # a loader draws from it (else the script deals its own)
        # Called when a loop starts drawing (ElasticDataParallel: a replacement is taken
        # in there, after the script's set-up and checkpoint loading).
        self.before_loop: Callable[[], None] | None = None

    # -- what a step is ----------------------------------------------------------------

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    @property
    def steps_per_epoch(self) -> int:
        return self.size // self.global_batch_size

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + epoch)
                order = torch.randperm(self.size, generator=g)
            else:
                order = torch.arange(self.size)
            self._order = (epoch, order)
        return self._order[1]

    def indices(self, step: int, micro_batch: int) -> list[int]:
        """The samples of micro-batch ``micro_batch`` of global step ``step``."""
        epoch, k = divmod(step, self.steps_per_epoch)
        order = self._permutation(epoch)
        base, m = k * self.global_batch_size, self.num_micro_batches
        return [int(order[base + i * m + micro_batch]) for i in range(self.micro_batch_size)]

    def mine(self, step: int) -> list[int]:
        """The micro-batches of ``step`` this worker computes."""
        del step  # every step is dealt alike among the same members
        if self.shares is not None:
            return list(self.shares.get(self.rank, ()))
        return deal(self.num_micro_batches, self.members, self.rank, self.shards, self.sizes)

    # -- DistributedSampler's interface ----------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at ``epoch``'s first step (or where training is, if
        that is further: a resumed run goes on mid-epoch)."""
        self.epoch = epoch
        self.step = max(self.step, epoch * self.steps_per_epoch)

    def __iter__(self) -> Iterator[list[int]]:
        self.iterating = True
        if self.before_loop is not None:
            self.before_loop()
        return self._iterate()

    def _iterate(self) -> Iterator[list[int]]:
        if self.step >= (self.epoch + 1) * self.steps_per_epoch:
            # A pass without set_epoch goes on with the next epoch (DistributedSampler
            # would repeat the last one's order).
            self.epoch = self.step // self.steps_per_epoch
        end = (self.epoch + 1) * self.steps_per_epoch
        step = max(self.step, self.epoch * self.steps_per_epoch)
        self.issued.clear()
        self._rewound = None
        while step < end:
            share = self.mine(step)
            for n, j in enumerate(share):
                if self._rewound is not None:
                    break
                self.issued.append(MicroBatch(step, j, last=n == len(share) - 1, deal=self.deal_id))
                yield self.indices(step, j)
            if self._rewound is not None:  # a recovery: the step again, dealt anew
                step, self._rewound = self._rewound, None
                continue
            step += 1

    def rewind(self, step: int, members: list[int]) -> None:
        """A recovery: the next micro-batches are ``step``'s, dealt among ``members``.
        Micro-batches already issued under the old deal (a DataLoader's prefetched
        batches) are stale: DataParallel discards what they compute."""
        self.members = sorted(members)
        self.step = step
        self.deal_id += 1
        self._rewound = step

    def __len__(self) -> int:
        steps = (self.epoch + 1) * self.steps_per_epoch - max(
            self.step, self.epoch * self.steps_per_epoch
        )
        return max(0, steps) * len(self.mine(self.step))

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.step, self.seed = state["epoch"], state["step"], state["seed"]
        self._order = None
