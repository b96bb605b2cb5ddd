"""A process group whose waits end at the launcher's abort: the groups a sharded model's
mesh is built on under ``chameleon run`` (chameleon_runtime.usergroup hands one out for
every ``new_group`` of a generation).

Why: the script's own operations on DTensors are collectives of the replica group that
the drop-in never sees (``clip_grad_norm_`` reduces each gradient's norm over the group,
``full_tensor()`` gathers the shards). Two members may leave a step at different points
when the launcher aborts it: one sees the abort while its step's sums are still in flight
and goes to recover, its mate sees the same sums complete and takes the norm, a gloo
all-reduce that the first never joins. On plain gloo that member waits for the group's
timeout (30 minutes), and the launcher for its answer; on NCCL the same, with a watchdog
kill at the end. Here a wait on such a collective ends when the generation it belongs to
is aborted, and reports success: the tensors hold whatever the collective left in them,
which is never used, as an aborted generation's step is done again after the recovery.
A collective posted after the abort is not posted at all.

The collective itself still runs on the group it wraps (gloo's own threads): one left
posted by a mate that went away ends with an error when that mate leaves the
generation's groups (its end of every pair is closed), and the error is dropped here.

How torch is told: a ``torch.distributed.ProcessGroup`` subclass handed to
``new_group`` by a registered backend's constructor, which torch installs as the group
itself (its "PythonProcessGroup" path), so that ``torch.distributed`` calls, the
functional collectives DTensor uses and DeviceMesh all reach these methods. TorchFT's
ManagedProcessGroup wraps a group the same way for the same reason.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

Aborted = Callable[[], bool]  # whether the group's generation is aborted
Watch = Callable[[threading.Event], Any]  # a context in which the abort sets the event


class AbortableWork(dist.Work):
    """The wrapped collective's work: ``wait`` ends at its end or at the abort."""

    def __init__(self, inner: Any, outputs: list[torch.Tensor], watch: Watch) -> None:
        super().__init__()
        self._inner = inner
        self._outputs = outputs
        self._watch = watch
        self._done = threading.Event()
        self._error: BaseException | None = None
        if inner is None:  # never posted (the generation was aborted already)
            self._done.set()
        else:
            inner.get_future().add_done_callback(self._ended)

    def _ended(self, future: Any) -> None:
        try:
            future.wait()
        except Exception as exc:  # noqa: BLE001 - a peer gone: the generation's abort follows
            self._error = exc
        self._done.set()

    def wait(self, timeout: Any = None) -> bool:
        if not self._done.is_set():
            with self._watch(self._done):
                self._done.wait()
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._error is None

    def exception(self) -> BaseException | None:
        return None  # (dropped: module doc)

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        self.wait()
        future.set_result(self._outputs)
        return future


def gloo_group(store: Any, rank: int, size: int, timeout: Any) -> dist.ProcessGroup:
    """A process group on gloo for CPU and CUDA tensors, as ``new_group`` makes one (the
    backend alone has not every method a group has)."""
    group = dist.ProcessGroup(store, rank, size)
    gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
    kind = dist.ProcessGroup.BackendType.GLOO
    group._set_default_backend(kind)
    for device in ("cpu", "cuda"):
        group._register_backend(torch.device(device), kind, gloo)
    return group


class AbortableGroup(dist.ProcessGroup):
    """``inner`` (a gloo group of a generation), its waits ended by the abort of that
    generation (``aborted``/``watch``: chameleon_runtime.liveness.Interrupts)."""

    def __init__(self, inner: Any, aborted: Aborted, watch: Watch) -> None:
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self._aborted = aborted
        self._watch = watch
        self._name: str | None = None

    # (new_group names the group through these; the C++ name is not set on a Python group)
    def _set_group_name(self, name: str) -> None:
        self._name = name
        super()._set_group_name(name)

    @property
    def group_name(self) -> str:  # type: ignore[override]
        if self._name is None:
            raise RuntimeError("ProcessGroup name not set")
        return self._name

    def _post(self, outputs: list[torch.Tensor], post: Callable[[], Any]) -> AbortableWork:
        inner = None if self._aborted() else post()
        return AbortableWork(inner, outputs, self._watch)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "chameleon-abortable"

    def size(self) -> int:
        return self.inner.size()

    def rank(self) -> int:
        return self.inner.rank()

    def barrier(self, opts: Any = None) -> AbortableWork:
        return self._post(
            [], lambda: self.inner.barrier(opts) if opts is not None else self.inner.barrier()
        )


def _delegated(name: str, outputs: Callable[..., list[torch.Tensor]]) -> Callable[..., Any]:
    """The method ``name`` of AbortableGroup: posted on the inner group as it is, its
    outputs (what ``outputs`` picks from the arguments) what the work's future returns."""

    def method(self: AbortableGroup, *args: Any) -> AbortableWork:
        return self._post(outputs(*args), lambda: getattr(self.inner, name)(*args))

    method.__name__ = method.__qualname__ = name
    return method


def _first(tensors: list[torch.Tensor], *_: Any) -> list[torch.Tensor]:
    return tensors


def _one(output: torch.Tensor, *_: Any) -> list[torch.Tensor]:
    return [output]


def _nested(outputs: list[list[torch.Tensor]], *_: Any) -> list[torch.Tensor]:
    return [t for ts in outputs for t in ts]


# torch calls these by name on a Python group (pybind's override lookup): each collective
# a DTensor, DeviceMesh or torch.distributed call may issue, with where its outputs are.
for _name, _outputs in {
    "allreduce": _first,
    "allreduce_coalesced": _first,
    "broadcast": _first,
    "reduce": _first,
    "allgather": _nested,
    "gather": _nested,
    "_allgather_base": _one,
    "allgather_into_tensor_coalesced": _first,
    "reduce_scatter": _first,
    "_reduce_scatter_base": _one,
    "reduce_scatter_tensor_coalesced": _first,
    "scatter": _first,
    "alltoall_base": _one,
}.items():
    setattr(AbortableGroup, _name, _delegated(_name, _outputs))
del _name, _outputs
