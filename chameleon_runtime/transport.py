"""How a generation's tensors travel between two workers: one interface, two transports.

Messages carry no tags. Between two workers they are matched by the order they are
posted in, on each side (``planner.plans.program.WorkerProgram.messages`` for a step; rounds,
then transfers, for a migration), which is all NCCL and HCCL offer, and the gloo
transport runs the same discipline so that CI exercises the ordering the accelerator
backends depend on. gloo needs tags no more than NCCL does: its pairs deliver one
(peer, tag) slot in order.

- ``GlooTransport``: a gloo group. CPU tensors go as they are; an accelerator's tensors
  are staged through pinned host memory (a copy to host before the send, from host after
  the receive), so several ranks can share one GPU: gloo neither needs one communicator
  per device nor takes the GPU's memory for its buffers. An aborted step is drained
  (chameleon_runtime.step): gloo cannot cancel a posted message, so each side posts what
  it still owed and the pair's stream ends matched.
- ``NativeTransport``: NCCL (``cuda``) or HCCL (``npu``) on device tensors. A posted
  NCCL operation cannot be matched by a drain that its dead peer never joins, so an
  aborted generation's communicator is aborted instead (``ProcessGroupNCCL.abort``), and
  a communicator is never carried over to the next generation.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

TAG = 0  # every message: matching is by order (module doc)

Finish = Callable[[], None] | None  # what completes a receive once its wait returns


class GlooTransport:
    name = "gloo"
    drains = True  # an aborted step posts what it still owes (module doc)
    carries_over = True  # a settled group may serve the next generation

    def make_group(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    def post_send(self, group: Any, tensor: torch.Tensor, peer: int) -> tuple[Any, torch.Tensor]:
        """Post ``tensor``; returns the work and what must stay alive until it completes."""
        return _post_send(group, tensor, peer, _HOST, pin=True)

    def post_recv(
        self, group: Any, buffer: torch.Tensor, peer: int
    ) -> tuple[Any, torch.Tensor, Finish]:
        """Post a receive into ``buffer``; returns the work, what it writes into, and what
        completes it once waited for (the copy from host for an accelerator's buffer)."""
        return _post_recv(group, buffer, peer, _HOST, pin=True)

    def post_allreduce(self, group: Any, tensor: torch.Tensor) -> Any:
        """Sum ``tensor`` in place over the group (gloo's ring; an accelerator's tensor
        is copied to host and back by gloo itself)."""
        return group.allreduce([tensor])

    def post_allgather(self, group: Any, output: torch.Tensor, tensor: torch.Tensor) -> Any:
        """Every member's ``tensor``, in member order, into ``output`` (a sharded model's
        parameters before a forward: chameleon_runtime.sharding)."""
        return group._allgather_base(output, tensor)

    def post_reducescatter(self, group: Any, output: torch.Tensor, tensor: torch.Tensor) -> Any:
        """The sum of every member's ``tensor``, member ``i`` keeping its ``i``-th slice in
        ``output`` (a sharded model's gradients)."""
        return group._reduce_scatter_base(output, tensor, _sum())

    def abort(self, group: Any) -> None:
        """Nothing to do: gloo waits end when their messages are drained or the peer's
        connection closes."""


class NativeTransport:
    drains = False
    carries_over = False

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.name = "nccl" if self.device.type == "cuda" else "hccl"

    def make_group(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return dist.ProcessGroupNCCL(store, rank, size, options)
        import torch_npu  # noqa: F401  (registers ProcessGroupHCCL; only when asked for)

        return torch.distributed.ProcessGroupHCCL(store, rank, size, timeout)  # type: ignore[attr-defined]

    def post_send(self, group: Any, tensor: torch.Tensor, peer: int) -> tuple[Any, torch.Tensor]:
        """Host tensors (a migration's packed layers) go through the device."""
        return _post_send(group, tensor, peer, self.device, pin=False)

    def post_recv(
        self, group: Any, buffer: torch.Tensor, peer: int
    ) -> tuple[Any, torch.Tensor, Finish]:
        return _post_recv(group, buffer, peer, self.device, pin=False)

    def post_allreduce(self, group: Any, tensor: torch.Tensor) -> Any:
        return group.allreduce([tensor])

    def post_allgather(self, group: Any, output: torch.Tensor, tensor: torch.Tensor) -> Any:
        return group._allgather_base(output, tensor)

    def post_reducescatter(self, group: Any, output: torch.Tensor, tensor: torch.Tensor) -> Any:
        return group._reduce_scatter_base(output, tensor, _sum())

    def abort(self, group: Any) -> None:
        """End every operation posted on the communicator, so that no survivor blocks
        on a dead peer (the drain's job on gloo)."""
        abort = getattr(group, "abort", None)
        if abort is not None:
            abort()


Transport = GlooTransport | NativeTransport


def transport_for(device: str, backend: str = "gloo") -> Transport:
    """``backend``: "gloo" (any device; accelerator tensors staged through host memory)
    or "native" (NCCL on cuda, HCCL on npu)."""
    if backend == "gloo" or device == "cpu":
        return GlooTransport()
    if backend == "native":
        return NativeTransport(device)
    raise ValueError(f"unknown transport backend {backend!r} (gloo, native)")


_HOST = torch.device("cpu")


def _sum() -> Any:
    options = dist.ReduceScatterOptions()
    options.reduceOp = dist.ReduceOp.SUM
    return options


def _post_send(
    group: Any, tensor: torch.Tensor, peer: int, wire: torch.device, *, pin: bool
) -> tuple[Any, torch.Tensor]:
    """Send ``tensor`` from the transport's ``wire`` device, staged there if it lives
    elsewhere (``pin``: into pinned host memory)."""
    tensor = tensor.contiguous()
    if tensor.device != wire:
        staged = torch.empty(tensor.shape, dtype=tensor.dtype, device=wire, pin_memory=pin)
        tensor = staged.copy_(tensor)  # synchronous: the send must not read a buffer being filled
    return group.send([tensor], peer, TAG), tensor


def _post_recv(
    group: Any, buffer: torch.Tensor, peer: int, wire: torch.device, *, pin: bool
) -> tuple[Any, torch.Tensor, Finish]:
    """Receive into ``buffer`` on the ``wire`` device, staged there and copied into
    ``buffer`` once waited for if it lives elsewhere."""
    if buffer.device == wire:
        return group.recv([buffer], peer, TAG), buffer, None
    into = torch.empty(buffer.shape, dtype=buffer.dtype, device=wire, pin_memory=pin)
    return group.recv([into], peer, TAG), into, lambda: buffer.copy_(into)
