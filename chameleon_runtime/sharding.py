"""A sharded model in the drop-in API (chameleon_runtime.dataparallel): FSDP2 inside a
replica group, the drop-in's sums across groups. HSDP, as torchtitan runs it, with the
replica dimension made fault tolerant.

The members (sorted global ranks) form ``R`` replica groups of ``S`` consecutive
members: group ``g`` is members ``g*S ... g*S + S - 1``, and the member at index ``i``
of its group holds shard ``i`` of every parameter (FSDP2's ``Shard(0)``). A *column* is
the members that hold the same shard, one per group: what a replica is for one shard.

- Within a group FSDP2 does what it does: all-gathers a block's parameters before its
  forward and backward, reduce-scatters its gradients after. It sums (no division:
  ``set_gradient_divide_factor(1.0)``, sums only), so that the drop-in divides once by
  the step's micro-batch count, as it does for a whole model.
- Across groups the drop-in sums each sharded gradient over its column, in its buckets
  (chameleon_runtime.buckets): FSDP2 calls the sharded parameters' post-accumulate-grad
  hooks once a block's reduce-scatter is in, which is where the drop-in takes a
  gradient anyway. A bucket's all-reduce is posted as soon as the last backward filled
  it, overlapping the rest of the backward.
- Every member computes its own micro-batches (FSDP is data parallel within a group
  too), and the members of a group run their forwards and backwards in lockstep (each
  block's all-gather is a collective of the group), so the sampler deals a step to the
  groups ``S`` micro-batches at a time, one to each member (a group may run a turn more
  than another): a step must be a whole number of turns of ``S``.

Under ``chameleon run`` FSDP2's collectives go through the generation's groups
(``Collectives``: FSDP2's custom all-gather and reduce-scatter hooks), so that a lost
peer or the launcher's abort ends them as it ends the drop-in's own sums, and a failure
never raises in the script: the output is zeros, the failure is kept, and ``step()``
recovers (the step is redone). In such a turn the sharded parameters' ``.grad`` is None
(chameleon_runtime.buckets), so that a norm the loop takes (``clip_grad_norm_``) is no
collective of the broken group. Under torchrun FSDP2 uses its own groups, as plain HSDP.

What a recovery chooses for a sharded job (planner.choice.sharded): drop every replica
group that lost a member (its survivors wait as spares), take whole groups back (each
member healed shard by shard from its column: chameleon_runtime.heal sends local shards;
a replacement shards its model only once taken in), or restart.

The mesh FSDP2 shards on is a 1-D ``DeviceMesh`` over this member's group, built on the
script's default process group (chameleon_runtime.usergroup under chameleon run), so
that DTensor's own collectives (``clip_grad_norm_`` over sharded gradients) run among
the group's members.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from chameleon_runtime.comm import Aborted, CommError
from chameleon_runtime.shardlayout import ShardLayout, local


def check_even_deal(num_micro_batches: int, shards: int) -> None:
    """A sharded model's members step in lockstep within their group: the sampler deals a
    step ``shards`` micro-batches at a time, one to each member of a group
    (chameleon_runtime.sampler.deal), so a step must be whole turns."""
    if shards > 1 and num_micro_batches % shards:
        raise ValueError(
            f"a step of {num_micro_batches} micro-batches is not a whole number of turns of "
            f"{shards}: with shards={shards} every worker of a replica group must run as many "
            "as the others (FSDP's collectives are the group's): make the global batch a "
            "multiple of micro_batch_size * shards"
        )


Blocking = Callable[[Callable[[], Any], str], Any]  # runs a blocking call (abortably)


def group_mesh(
    layout: ShardLayout, me: int, device_type: str, blocking: Blocking | None = None
) -> Any:
    """A 1-D DeviceMesh over ``me``'s replica group, on the default process group
    (whose ranks are the members' places in ``layout.members``). Every member builds
    every group, in one order (``new_group`` is a collective of the default group), on
    ``blocking`` (chameleon run: the generation's helper, so that a member lost while
    they are built ends the wait at the launcher's abort, as chameleon_runtime.usergroup
    builds the default group)."""
    from torch.distributed.device_mesh import DeviceMesh

    def build() -> Any:
        return _subgroups(layout, layout.groups, me)

    mine = blocking(build, "groups") if blocking is not None else build()
    assert mine is not None
    places = (device_type, *(layout.members.index(r) for r in layout.group_of(me)))
    mesh = _meshes.get(places)
    if mesh is None:
        mesh = _meshes[places] = DeviceMesh.from_group(mine, device_type)
    else:
        _bind(mesh, mine)
    return mesh


# One mesh object per group of places in the default group, bound to the latest group
# over them: DeviceMesh equality ignores the group a mesh is bound to, and DTensor's
# sharding propagation caches specs by equality, so a DTensor made on a new mesh equal to
# an old one (a group grown back to the size it had) can come back holding the old one.
_meshes: dict[tuple, Any] = {}


def _bind(mesh: Any, group: Any) -> None:
    mesh._dim_group_names = [group.group_name]
    if isinstance(getattr(mesh, "_pg_registry", None), dict):  # (torch.compile's lookup)
        mesh._pg_registry = {group.group_name: group}


def rebind_mesh(module: nn.Module, fresh: Any, me: int) -> None:
    """A recovery rebuilt the default process group (chameleon_runtime.usergroup): the
    mesh FSDP2 shards on is pointed at ``fresh``, this generation's group over ``me``'s
    replica group, whose members and their places are the same (a plan that changes a
    group re-shards it: chameleon_runtime.reshard). The mesh resolves its group by name
    at each use, and FSDP2 keeps the group object it was given: both are pointed at the
    new one (torch has no public way to rebind a mesh to a rebuilt group)."""
    from torch.distributed.fsdp import FSDPModule

    mesh = None
    for m in module.modules():
        if isinstance(m, FSDPModule):
            for param_group in m._get_fsdp_state()._fsdp_param_groups:
                mesh = param_group.mesh_info.mesh
                break
        if mesh is not None:
            break
    if mesh is None:
        return
    if fresh.size() != mesh.size():
        raise RuntimeError(
            f"chameleon: replica group of rank {me} has {fresh.size()} members now, "
            f"{mesh.size()} when the model was sharded"
        )
    _bind(mesh, fresh)
    # (the mesh's rank map keeps the default group's ranks of the launch: the group's own
    # ranks, its coordinate and size, which FSDP2 and DTensor use, are the same)
    for m in module.modules():
        if isinstance(m, FSDPModule):
            for param_group in m._get_fsdp_state()._fsdp_param_groups:
                infos = {id(param_group.mesh_info): param_group.mesh_info}
                infos.update({id(p.mesh_info): p.mesh_info for p in param_group.fsdp_params})
                for info in infos.values():
                    info.shard_process_group = fresh


def column_groups(layout: ShardLayout, me: int) -> Any:
    """Under torchrun: the default group's subgroup of ``me``'s column (every member
    builds every column, in one order)."""
    return _subgroups(layout, layout.columns, me)


def _subgroups(layout: ShardLayout, sets: list[tuple[int, ...]], me: int) -> Any:
    """A subgroup of the default group per set of members (every member builds every
    one, in one order: ``new_group`` is a collective of the default group); ``me``'s."""
    mine = None
    for members in sets:
        made = dist.new_group([layout.members.index(r) for r in members])
        if me in members:
            mine = made
    return mine


def row_counts(module: nn.Module) -> tuple[int, ...]:
    """The parameters' rows (dim 0, what FSDP2 shards): where a re-sharded group's sums
    cut them. The same before and after ``fully_shard`` (a DTensor's shape is whole)."""
    return tuple(sorted({p.shape[0] for p in module.parameters() if p.dim()}))


def unit_params(module: nn.Module, blocks: Iterable[nn.Module]) -> int:
    """The parameters of the largest FSDP unit: a block, or what the root holds beside
    them (all-gathered whole while it computes: planner.job.fsdp)."""
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    total = sum(p.numel() for p in module.parameters())
    return max([*sizes, total - sum(sizes)])


# -- FSDP2's collectives through the generation's groups ---------------------------------

Run = Callable[[str, torch.Tensor, torch.Tensor], None]  # (kind, output, input)


def _comms(run: Run) -> tuple[Any, Any]:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class GroupAllGather(AllGather):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> Any:
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(
            self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False
        ) -> None:
            # Synchronous: the wait is the generation's, which an abort ends (the module
            # doc); FSDP2 takes None as a finished all-gather.
            run("allgather", output_tensor, input_tensor)

    class GroupReduceScatter(ReduceScatter):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> Any:
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(
            self,
            output_tensor: Any,
            input_tensor: Any,
            group: Any,
            op: Any,
            async_op: bool = False,
        ) -> None:
            run("reducescatter", output_tensor, input_tensor)  # a sum (module doc)

    return GroupAllGather(), GroupReduceScatter()


def shard_model(
    module: nn.Module,
    mesh: Any,
    blocks: Iterable[nn.Module],
    run: Run | None,
    fsdp_options: dict[str, Any],
) -> None:
    """``fully_shard`` each block, then the root, on ``mesh``; gradients summed, not
    averaged; ``run`` (under chameleon run) carries FSDP2's collectives."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    reshard = fsdp_options.get("reshard_after_forward", True)
    if not isinstance(reshard, bool):
        raise ValueError(
            f"fsdp_options: reshard_after_forward={reshard!r}: the drop-in shards over whole "
            "replica groups (True or False)"
        )
    for block in blocks:
        fully_shard(block, mesh=mesh, **fsdp_options)
    fully_shard(module, mesh=mesh, **fsdp_options)
    comms = _comms(run) if run is not None else None
    for m in module.modules():
        if not isinstance(m, FSDPModule) or not m._get_fsdp_state()._fsdp_param_groups:
            continue
        m.set_force_sum_reduction_for_comms(True)
        m.set_gradient_divide_factor(1.0)
        if comms is not None:
            m.set_custom_all_gather(comms[0])
            m.set_custom_reduce_scatter(comms[1])


class Replicas(Protocol):
    """What ``Sharding`` uses of the model's replicas (chameleon_runtime.replicagroup)."""

    rank: int
    elastic: Any  # the generation's membership under chameleon run, else None

    def layout_now(self) -> ShardLayout: ...

    def blocking(self, fn: Callable[[], Any], what: str) -> Any: ...

    def group_allreduce(self, tensor: torch.Tensor) -> None: ...


# A re-shard's rows: the sharded tensors (chameleon_runtime.reshard.row_tensors), this
# member's rows of each under a layout, and that layout.
Rows = tuple[list[Any], list[torch.Tensor], ShardLayout]


class Sharding:
    """The FSDP2 side of one drop-in model (``ElasticDataParallel(shards=S)``): what is
    sharded and how (``blocks``, ``options``), whether it is yet (a replacement's only
    once a plan takes it in), its mesh kept on the current generation's group, and the
    group's agreement on a failed step. ``run`` carries FSDP2's collectives under
    chameleon run (None: FSDP2's own, under torchrun)."""

    def __init__(
        self,
        module: nn.Module,
        replicas: Replicas,
        blocks: Iterable[nn.Module],
        options: dict[str, Any],
        *,
        find_unused: bool,
        run: Run | None,
    ) -> None:
        self.module = module
        self.replicas = replicas
        self.blocks = list(blocks)
        self.options = options
        self.find_unused = find_unused
        self.run = run
        self.applied = False  # fully_shard applied
        # (ElasticDataParallel sets these: the inner optimizers, and what follows a
        # rebuild of the parameters: its hooks and buckets on the new ones)
        self.optimizers: Callable[[], list[torch.optim.Optimizer]] = list
        self.rebuilt: Callable[[], None] = lambda: None
        # rows moved by the plan being applied, and held but not yet set up in the model
        self._moving: Rows | None = None
        self._pending: Rows | None = None
        self._mesh: Any = None  # the mesh of the plan applied last (``regroup``)
        if replicas.elastic is not None:  # (a replacement's too, before it is sharded)
            replicas.elastic.row_counts = row_counts(module)
        if "shard_placement_fn" in options:
            raise ValueError(
                "fsdp_options: shard_placement_fn: the drop-in shards every parameter by "
                "rows (Shard(0)), which its sums across groups and a re-shard rely on"
            )

    def apply(self) -> None:
        """FSDP2 within this member's replica group (on the mesh ``regroup`` built, once a
        plan took a replacement in)."""
        replicas = self.replicas
        mesh = self._mesh
        if mesh is None:
            mesh = group_mesh(
                replicas.layout_now(), replicas.rank, self._device_type(), replicas.blocking
            )
        shard_model(self.module, mesh, self.blocks, self.run, self.options)
        if self.find_unused:  # members that used different parameters scatter alike
            for m in self.module.modules():
                if hasattr(m, "set_reduce_scatter_unused_params"):
                    m.set_reduce_scatter_unused_params(True, recurse=False)
        self.applied = True
        if replicas.elastic is not None:  # what one unit gathers whole, for the planner
            replicas.elastic.unit_params = unit_params(self.module, self.blocks)

    def apply_to_replacement(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """A replacement taken in shards its model on the group the plan puts it in (the
        generation's default group is built by now); its optimizers, made by the script
        over the whole parameters, are pointed at the shards that replaced them (they
        hold no state yet: the heal brings it)."""
        before = dict(self.module.named_parameters())
        self.apply()
        after = dict(self.module.named_parameters())
        moved = {id(p): after[name] for name, p in before.items()}
        for inner in optimizers:
            if inner.state:
                raise RuntimeError(
                    "chameleon: a replacement of a sharded model has optimizer state before "
                    "its heal (a checkpoint loaded into it?): it takes its shards' state from "
                    "a live member (model.replacement: skip the load)"
                )
            for group in inner.param_groups:
                group["params"] = [moved.get(id(p), p) for p in group["params"]]

    def move(
        self,
        old: ShardLayout,
        new: ShardLayout,
        me: int,
        pairs: list[tuple[int, int]],
        send: Callable[[torch.Tensor, int], None],
        recv: Callable[[torch.Tensor, int], Any],
        flush: Callable[[], None],
    ) -> None:
        """A plan re-shards groups (chameleon_runtime.reshard): the rows move now, in the
        migration, from what this member holds (rows an earlier re-shard moved and no
        mesh has taken yet, or the model's shards); ``commit`` makes them held once the
        plan is agreed, ``regroup`` sets the model up on them."""
        from chameleon_runtime.reshard import move_rows, row_tensors

        if not self.applied:  # a replacement holds nothing: it is healed whole
            self._moving = None
            return
        if self._pending is not None:
            tensors, rows, layout = self._pending
            if layout.groups != old.groups:
                raise RuntimeError(
                    f"chameleon: rank {me} holds rows laid out as {layout.groups}, the plan "
                    f"re-shards from {old.groups}"
                )
        else:
            tensors = row_tensors(self.module, self.optimizers())
            rows = [local(t) for t in tensors]
        fresh = move_rows(old, new, me, tensors, send, recv, flush, pairs, rows)
        self._moving = None if fresh is None else (tensors, fresh, new)

    def commit(self) -> None:
        """The plan is agreed (its layout is what the launcher plans from now): the rows
        moved for it are this member's."""
        if self._moving is not None:
            self._pending, self._moving = self._moving, None

    def forget(self) -> None:
        """A new plan: rows an aborted one moved are dropped (never agreed)."""
        self._moving = None

    @property
    def holds_unset_rows(self) -> bool:
        """Rows held (agreed) that the model does not have yet: its shards are stale."""
        return self._pending is not None

    def regroup(self, layout: ShardLayout) -> None:
        """The plan's groups are built (chameleon_runtime.elastic): the mesh of this
        member's group under ``layout``, on the new default group (abortable; every
        member builds once a generation, ``new_group`` being a collective of the default
        group; a replacement too, which shards on it when healed). Then, local: held rows
        set up on it (``rebuild``: chameleon_runtime.reshard), or the model's mesh
        pointed at the new group (``rebind_mesh``)."""
        replicas = self.replicas
        self._mesh = group_mesh(layout, replicas.rank, self._device_type(), replicas.blocking)
        if not self.applied:
            return  # a replacement: it shards on the mesh when healed (apply_to_replacement)
        pending, self._pending = self._pending, None
        if pending is None:
            rebind_mesh(self.module, self._mesh.get_group(), replicas.rank)
            return
        from chameleon_runtime.reshard import rebuild

        tensors, rows, held = pending
        if held.group_of(replicas.rank) != layout.group_of(replicas.rank):
            raise RuntimeError(
                f"chameleon: rank {replicas.rank}'s rows are laid out for group "
                f"{held.group_of(replicas.rank)}, the plan puts it in {layout.group_of(replicas.rank)}"
            )
        rebuild(self.module, self.optimizers(), tensors, rows, self._mesh, layout, replicas.rank)
        self.rebuilt()

    def agree(self, failure: tuple[str, bool] | None) -> tuple[str, bool] | None:
        """The group agrees whether its step's sums are whole before any member shows
        them: a member whose column's sum failed while its group-mate's succeeded would
        otherwise show DTensor gradients to a loop whose norm (``clip_grad_norm_``) is a
        collective of the group its mate has left. One flag, summed over the group on
        the generation's (abortable) collectives; returns the step's failure, if any."""
        flag = torch.tensor([0.0 if failure is None else 1.0])
        try:
            self.replicas.group_allreduce(flag)
        except (Aborted, CommError) as exc:
            return failure or (str(exc), False)
        if flag.item() and failure is None:
            return ("a member of this replica group failed its step's sums", False)
        return failure

    def writes(self) -> bool:
        """Whether this member's shards go into a torch.distributed.checkpoint save
        (``state_dict_for_save``): DCP keeps one copy of chunks that are the same on
        several members (a shard's replicas) and refuses chunks that overlap otherwise,
        which a group re-sharded over fewer members has with the whole ones. The whole
        groups write (or, none being whole, the groups the size of the first)."""
        layout = self.replicas.layout_now()
        if layout.even:
            return True
        whole = [g for g in layout.groups if len(g) == layout.shards] or layout.groups[:1]
        return len(layout.group_of(self.replicas.rank)) == len(whole[0])

    def _device_type(self) -> str:
        first = next(self.module.parameters(), None)
        return first.device.type if first is not None else "cpu"


def state_dict_for_save(model: nn.Module, *optimizers: Any) -> tuple[dict, dict]:
    """What this member passes to ``torch.distributed.checkpoint.save``: the drop-in
    model's (``ElasticDataParallel``) and its optimizers' state dicts, as
    ``get_state_dict(model.module, optimizers)`` gives them, or two empty ones on a
    member of a replica group re-sharded over its survivors (its rows are in the whole
    groups' shards: ``Sharding.writes``). Loading needs nothing of the kind: DCP reads
    each member's rows, however its group is cut."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    sharding = getattr(model, "sharding", None)
    if sharding is not None and not sharding.writes():
        return {}, {}
    inner = [getattr(o, "optimizer", o) for o in optimizers]
    return get_state_dict(getattr(model, "module", model), inner[0] if len(inner) == 1 else inner)
