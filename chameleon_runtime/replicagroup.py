"""Who a drop-in model's replicas are and how they sum (chameleon_runtime.dataparallel):
under ``chameleon run`` the members of the current generation (``Membership``, whose
groups a recovery rebuilds: chameleon_runtime.elastic), under torchrun the default
process group, alone nobody.

A sharded model (chameleon_runtime.sharding) sums its gradients over its column (the
members that hold the same shard, one per replica group), everything else over every
member; FSDP2's own collectives run within the group (``shard_collective`` under
chameleon run).

Every sum is exact in one sense the runtime relies on: a broadcast is a sum to which all
but the source add zeros. The small host tensors a step exchanges (chameleon_runtime.
stepmeta, the consistency check) go over the same group as the gradients; a script's
own NCCL-only default group takes them through the model's device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from chameleon_runtime import usergroup
from chameleon_runtime.elastic import Membership, under_chameleon
from chameleon_runtime.rowsums import PostedSums, pieces
from chameleon_runtime.sharding import column_groups
from chameleon_runtime.shardlayout import ShardLayout


class ReplicaGroup:
    def __init__(self, sampler: Any, device: torch.device, shards: int = 1) -> None:
        self.elastic: Membership | None = None
        self.group = False  # the default group (torchrun)
        self.shards = shards
        if under_chameleon():
            if dist.is_available() and dist.is_initialized():
                raise RuntimeError(
                    "under chameleon run the drop-in builds the default process group for "
                    "each generation of workers: remove the script's init_process_group "
                    "(docs/dataparallel.md)"
                )
            self.elastic = Membership(sampler, device.type, shards=shards)
            self.world_size, self.rank = self.elastic.world_size, self.elastic.rank
        else:
            self.group = usergroup.from_torchrun(device)
            self.world_size = dist.get_world_size() if self.group else 1
            self.rank = dist.get_rank() if self.group else 0
        # (checked here, before any group is built: a one-line error, not a hang)
        self.layout = ShardLayout(tuple(self.members()), shards)
        self.column_group: Any = None  # torchrun: the default group's subgroup of the column
        if self.group and self.layout.sharded:
            self.column_group = column_groups(self.layout, self.rank)
        # A default group with no CPU backend (the script's own init_process_group("nccl")):
        # host tensors are summed through the model's device.
        self._host_via: torch.device | None = None
        if self.group and device.type != "cpu" and "gloo" not in str(dist.get_backend()):
            self._host_via = device

    @property
    def distributed(self) -> bool:
        return self.group or self.elastic is not None

    def members(self) -> list[int]:
        """The members now, lowest global rank first."""
        if self.elastic is not None:
            return sorted(self.elastic.members)
        return list(range(self.world_size))

    def layout_now(self) -> ShardLayout:
        """The replica groups of the current members."""
        return self.elastic.layout if self.elastic is not None else self.layout

    @property
    def column(self) -> tuple[int, ...]:
        """The members that hold what this one holds (all of them, unsharded)."""
        return self.layout_now().column_of(self.rank)

    def post(self, bucket: Any, tensor: torch.Tensor) -> Any:
        """Post the sums of a gradient bucket's buffer ``tensor`` (asynchronous): over
        the column, or, with a re-sharded group, each piece over its holders
        (chameleon_runtime.rowsums); ``wait`` for its work."""
        layout = self.layout_now()
        if self.elastic is None or layout.even:
            return self._post_column(tensor)
        if bucket.pieces is None or bucket.pieces[0] != layout:  # (cut once a layout)
            spans = [bucket.spans[p] for p in bucket.params]
            bucket.pieces = (layout, pieces(layout, self.rank, bucket.params, spans))
        return PostedSums(tensor, bucket.pieces[1], self.elastic.allreduce)

    def _post_column(self, tensor: torch.Tensor) -> Any:
        if self.elastic is not None:
            column = self.column
            if len(column) == 1:
                return None  # one replica group: nobody to sum with
            return self.elastic.allreduce(tensor, column)
        if not self.group:
            return None  # alone: nobody to sum with
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.column_group, async_op=True)

    def wait(self, work: Any) -> None:
        if work is None:
            return
        if isinstance(work, PostedSums):
            assert self.elastic is not None
            work.finish(self.elastic.wait)
        elif self.elastic is not None:
            self.elastic.wait(work, self.column)
        else:
            work.wait()

    def shard_collective(self, kind: str, output: torch.Tensor, tensor: torch.Tensor) -> None:
        """FSDP2's all-gather or reduce-scatter within this member's group, on the
        generation's collectives (chameleon run: chameleon_runtime.sharding)."""
        assert self.elastic is not None
        self.elastic.group_collective(kind, output, tensor)

    def group_allreduce(self, tensor: torch.Tensor) -> None:
        """A blocking sum over this member's replica group (chameleon run)."""
        assert self.elastic is not None
        group = self.elastic.layout.group_of(self.rank)
        if len(group) > 1:
            self.elastic.wait(self.elastic.allreduce(tensor, group), group)

    def blocking(self, fn: Any, what: str) -> Any:
        """Run a blocking call among the members (building a group): under chameleon run
        on the generation's helper, which the launcher's abort ends."""
        if self.elastic is not None and self.elastic.gen is not None:
            return self.elastic.gen.call(fn, what)
        return fn()

    def column_allreduce(self, tensor: torch.Tensor) -> None:
        """A blocking sum over the column (what a shard's replicas compare or share)."""
        self.wait(self._post_column(tensor))

    def allreduce(self, tensor: torch.Tensor) -> None:
        """A blocking sum in place (nothing alone)."""
        if self.elastic is not None:
            self.elastic.wait(self.elastic.allreduce(tensor))
        elif self.group:
            if tensor.device.type == "cpu" and self._host_via is not None:
                moved = tensor.to(self._host_via)
                dist.all_reduce(moved, op=dist.ReduceOp.SUM)
                tensor.copy_(moved.cpu())
                return
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    def broadcast_from(
        self, source: int, tensors: list[torch.Tensor], *, column: bool = False
    ) -> None:
        """``source``'s values on every member (``column``: over the column, ``source``
        one of it): the others add zeros to them (exact)."""
        with torch.no_grad():
            for t in tensors:
                if self.rank != source:
                    t.zero_()
                if column:
                    self.column_allreduce(t)
                else:
                    self.allreduce(t)
