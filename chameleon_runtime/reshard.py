"""A replica group re-sharded over other members in place (HSDP: chameleon_runtime.
sharding): its survivors after a member was lost, each taking a larger shard of every
parameter and of its optimizer state, the rows it lacks from a live group-mate or, for
the lost member's rows, from the peer group that holds them (planner.plans.rows: the
same moves the planner priced, in the rounds it scheduled).

FSDP2 has no re-shard of a module in place. Each FSDP parameter is set up again on the
group's new mesh (``FSDPParam._init_sharded_param``, what ``fully_shard`` runs, on a
parameter of the full shape on the meta device, then this member's new rows put in as
FSDP2 takes a swapped-in parameter: ``reset_sharded_param``), which puts a new sharded
parameter on the module; the optimizers' parameters and states are pointed at the new
ones (a state shaped like its parameter is re-sharded as the parameter; one sharded
otherwise, a factored optimizer's, is refused in one line).

Memory: a member holds its old and its new shards while the rows move (its state grows
from ``1/S`` of the model's to ``1/(S-1)`` anyway); nothing is staged whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from chameleon_runtime.shardlayout import ShardLayout, local
from planner.plans.rows import row_moves

Send = Callable[[torch.Tensor, int], None]
Recv = Callable[[torch.Tensor, int], Any]


def row_tensors(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> list[Any]:
    """What a re-shard moves, in one order on every member: the sharded parameters (the
    module's order), then each optimizer's states shaped like their parameter (its
    parameters' order, keys sorted)."""
    resharded(module)
    params = [p for p in module.parameters() if local(p) is not p]
    out: list[Any] = list(params)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                for key in sorted(state, key=str):
                    v = state[key]
                    if torch.is_tensor(v) and local(v) is not v:
                        if v.shape != p.shape:  # (a factored state: rows of something else)
                            raise RuntimeError(
                                f"chameleon: optimizer state {key!r} is sharded unlike its "
                                "parameter (a factored optimizer?): a re-shard moves states "
                                "shaped like their parameter only"
                            )
                        out.append(v)
    return out


def resharded(module: nn.Module) -> None:
    """Every FSDP unit back to its shards: a forward with no backward after it (an
    evaluation) leaves the root's parameters whole, which are then not the shards a
    re-shard moves and sets up."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def move_rows(
    old: ShardLayout,
    new: ShardLayout,
    me: int,
    tensors: Sequence[Any],
    send: Send,
    recv: Recv,
    flush: Callable[[], None],
    pairs: Sequence[tuple[int, int]] = (),
    held: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor] | None:
    """Move the rows of ``tensors`` (sharded as ``old`` lays them out) so that every
    member of a changed group holds its rows under ``new``; returns this member's new
    local tensors, or None if its group did not change. ``pairs``: (src, dst) in the
    plan's order (its rounds); a pair of ours it lacks goes after (module doc).
    ``held``: this member's rows of each under ``old`` (default: the tensors' own)."""
    mine_old = list(held) if held is not None else [local(t) for t in tensors]
    old_groups, new_groups = [tuple(g) for g in old.groups], [tuple(g) for g in new.groups]
    moves = [row_moves(old_groups, new_groups, t.shape[0]) for t in tensors]
    mine = new.group_of(me) if me in new.members else None
    changed = mine is not None and mine not in old_groups
    out: list[torch.Tensor] = []
    if changed:
        for t, ms in zip(tensors, moves, strict=True):
            a, b = new.rows_of(me, t.shape[0])
            fresh = mine_old[len(out)].new_empty((b - a, *t.shape[1:]))
            oa = old.rows_of(me, t.shape[0])[0] if me in old.members else 0
            for src, dst, x, y in ms:
                if src == dst == me:
                    fresh[x - a : y - a].copy_(mine_old[len(out)][x - oa : y - oa])
            out.append(fresh)
    order = list(
        dict.fromkeys([*pairs, *sorted({(s, d) for ms in moves for s, d, _, _ in ms if s != d})])
    )
    for src, dst in order:
        if me not in (src, dst):
            continue
        for i, (t, ms) in enumerate(zip(tensors, moves, strict=True)):
            n = t.shape[0]
            for s, d, x, y in ms:
                if (s, d) != (src, dst):
                    continue
                if s == me:
                    oa = old.rows_of(me, n)[0]
                    piece = mine_old[i][x - oa : y - oa]
                    send(piece if piece.device.type == "cpu" else piece.cpu(), dst)
                else:
                    a = new.rows_of(me, n)[0]
                    into = out[i][x - a : y - a]
                    if into.device.type == "cpu":
                        recv(into, src)
                    else:
                        into.copy_(recv(torch.empty(into.shape, dtype=into.dtype), src))
        flush()
    return out if changed else None


def rebuild(
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    tensors: Sequence[Any],
    fresh: Sequence[torch.Tensor],
    mesh: Any,
    layout: ShardLayout,
    me: int,
) -> dict[int, nn.Parameter]:
    """Set the module's FSDP parameters up again on ``mesh`` with this member's new rows
    (``fresh``, in ``row_tensors``' order, the old ``tensors``), and the optimizers on
    the new parameters. Returns {id(old parameter): new parameter}."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    resharded(module)
    new_local = {id(t): f for t, f in zip(tensors, fresh, strict=True)}
    moved: dict[int, nn.Parameter] = {}
    info = FSDPMeshInfo(mesh, shard_mesh_dim=0)
    with torch.no_grad():
        for m in module.modules():
            if not isinstance(m, FSDPModule):
                continue
            for group in m._get_fsdp_state()._fsdp_param_groups:
                post = info if group.post_forward_mesh_info is not None else None
                group.mesh_info, group.post_forward_mesh_info = info, post
                for fp in group.fsdp_params:
                    old = fp.sharded_param
                    # What fully_shard does, on a parameter of the whole shape on the meta
                    # device (nothing allocated), then this member's rows put in as FSDP2
                    # takes a parameter swapped in (to_empty, load_state_dict(assign=True)):
                    # padded into its own storage.
                    whole = nn.Parameter(
                        torch.empty(old.shape, dtype=old.dtype, device="meta"),
                        requires_grad=old.requires_grad,
                    )
                    fp.post_forward_mesh_info = post
                    fp._init_sharded_param(whole, fp.device, None, info)
                    if post is not None:
                        fp._init_sharded_post_forward_param_metadata(whole)
                    rows = nn.Parameter(
                        fp.to_sharded_dtensor(new_local[id(old)]), requires_grad=old.requires_grad
                    )
                    fp._setattr_on_modules(rows)
                    fp.reset_sharded_param()
                    if fp.sharded_param.device_mesh is not mesh:
                        # (nn.Parameter detaches the DTensor, and the spec DTensor's cache
                        # gives back may hold an equal mesh bound to another group)
                        spec = fp._sharding_spec
                        fp._sharding_spec = fp.sharded_param._spec = DTensorSpec(
                            mesh, spec.placements, tensor_meta=spec.tensor_meta
                        )
                    fp.all_gather_outputs = []  # (sized for the old mesh: made again)
                    if hasattr(fp, "_unsharded_param"):
                        del fp._unsharded_param
                    moved[id(old)] = fp.sharded_param
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                q = moved.get(id(p))
                if q is None:
                    params.append(p)
                    continue
                state = optimizer.state.pop(p, {})
                for key, value in list(state.items()):
                    if id(value) in new_local:
                        state[key] = DTensor.from_local(
                            new_local[id(value)], q.device_mesh, q.placements,
                            run_check=False, shape=q.shape, stride=q.stride(),
                        )  # fmt: skip
                if state:
                    optimizer.state[q] = state
                params.append(q)
            group["params"] = params
    return moved
