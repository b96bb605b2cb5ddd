"""What a worker's tensors occupy during a step, measured from the tensors themselves.

Why not the allocator or the process's RSS: on CPU torch keeps no peak statistics, and the
interpreter, torch's libraries and the allocator's caching are hundreds of megabytes that
move on their own; a tiny model's few megabytes disappear in them. What the planner sizes
is the tensors, so that is what is measured: every distinct storage alive at a sample,
counted once whoever refers to it (a layer's weight that autograd also saves for the
backward is state, not activation).

- state: parameters, their ``.grad`` while one exists, the float64 gradient sums and the
  optimizer's state, read off the shard at every sample (a transient ``.grad`` counts);
- activations: the storages autograd saves for each micro-batch in flight (saved-tensor
  hooks during its forward) and the boundary tensors the step keeps for its backward,
  released when that micro-batch's backward has run;
- buffers: whatever else the step holds at the sample (a bucket's exchange buffers).

The step samples after every pass and inside the exchange; the peak is the largest
sample. ``planner.job.cost.CostModel.memory_bytes`` predicts the same quantity.

Only the first ``METERED_STEPS`` steps of a layout are measured: every step of a layout
runs the same program on same-shaped tensors, so its peak is reached by then (the
optimizer's state exists from the first step's update on), and sampling walks every
tensor the worker holds, after every pass: a tenth of a tiny model's step, paid for
nothing on every later step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from chameleon_runtime.shard import Shard


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _unique(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    return dict(_storage(t) for t in tensors)


# The first step has no optimizer state until its update; the second holds it all step.
METERED_STEPS = 3


class Meter:
    """One worker's tensor bytes through a step, and the peak over the steps so far."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.peak_bytes = 0
        self._saved: dict[int, dict[int, int]] = {}  # micro-batch -> storages it keeps
        self._steps = 0  # steps begun since the layout changed

    def begin_step(self) -> bool:
        """Whether this step is measured (module doc)."""
        self._steps += 1
        return self._steps <= METERED_STEPS

    def _state(self) -> dict[int, int]:
        shard = self.shard
        tensors: list[torch.Tensor] = []
        for i in shard.held():
            for p in shard.layers[i].parameters():
                tensors.append(p)
                if p.grad is not None:
                    tensors.append(p.grad)
            tensors.extend(shard.grad_sums.get(i, ()))
        optimizer = shard.optimizer
        if optimizer is not None:
            for per_param in optimizer.state.values():
                tensors.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
        return _unique(tensors)

    @contextlib.contextmanager
    def saving(self, micro_batch: int) -> Iterator[None]:
        """Count what autograd saves for ``micro_batch`` while the block runs."""
        mine = self._saved.setdefault(micro_batch, {})

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr, nbytes = _storage(t)
            mine[ptr] = nbytes
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def keep(self, micro_batch: int, *tensors: torch.Tensor | None) -> None:
        """Tensors the step itself holds for ``micro_batch`` until its backward."""
        mine = self._saved.setdefault(micro_batch, {})
        mine.update(_unique(t for t in tensors if t is not None))

    def release(self, micro_batch: int) -> None:
        self._saved.pop(micro_batch, None)

    def sample(self, *buffers: torch.Tensor) -> int:
        """Bytes alive now; raises the peak."""
        live = self._state()
        for storages in self._saved.values():
            for ptr, nbytes in storages.items():
                live.setdefault(ptr, nbytes)
        for ptr, nbytes in _unique(buffers).items():
            live.setdefault(ptr, nbytes)
        total = sum(live.values())
        self.peak_bytes = max(self.peak_bytes, total)
        return total

    def reset(self) -> None:
        """A new layout: what was in flight is gone, and the peak starts again."""
        self._saved.clear()
        self.peak_bytes = 0
        self._steps = 0
