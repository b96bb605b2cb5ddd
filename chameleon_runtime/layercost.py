"""What one layer costs, measured by the worker holding it (``chameleon_runtime.profile``
runs these for the planner's cost table; the Trainer probes at start).

- ``probe``: parameter counts and per-micro-batch output shapes of every layer, so any
  worker can size its receive buffers and the planner its transfers. A worker training
  on an accelerator probes on the meta device (no memory, no compute: it never builds on
  its host the layers it does not hold); one training on the CPU builds each layer there
  in turn and runs it without gradients. A CPU job's model fits its host by definition,
  and the meta device's first use cost a worker 9-13 MB of resident memory for good
  (measured on torch 2.13), a third of what a plain loop of the tiny GPT holds in all,
  where the CPU pass shares its kernels' start-up with training (0.7 MB more).
- ``measure``: forward, backward and optimizer time of layers a worker holds, on a
  micro-batch of the real shape, while the other workers run too (on a shared host that
  contention is part of what a step costs); bytes stashed for backward, counted exactly
  with saved-tensor hooks.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from chameleon_runtime.shard import LayerFactory, Shard, build_layer
from planner.job.costtable import LayerCost


def probe(
    factory: LayerFactory,
    num_layers: int,
    sample: torch.Tensor,
    *,
    seed: int,
    wire_dtype: torch.dtype | None = None,
    device: str = "cpu",
) -> tuple[list[int], list[tuple[torch.Size, torch.dtype]], list[str]]:
    """(parameters per layer, output (shape, dtype) per layer, layer names); a floating
    output is ``wire_dtype`` where the shard rounds every layer's output to it (bf16).
    ``device``: what the worker trains on (module doc)."""
    params = shapes = names = None
    if device != "cpu":
        # An op without a meta kernel falls back to a real pass, without gradients.
        with contextlib.suppress(Exception):
            params, shapes, names = _probe_on("meta", factory, num_layers, sample, seed)
    if params is None:
        params, shapes, names = _probe_on("cpu", factory, num_layers, sample, seed)
    if wire_dtype is not None:
        shapes = [(s, wire_dtype if d.is_floating_point else d) for s, d in shapes]
    return params, shapes, names


def _probe_on(device: str, factory: LayerFactory, num_layers: int, sample: torch.Tensor, seed: int):
    params, shapes, names = [], [], []
    x = sample.to(device)
    with torch.no_grad():
        for i in range(num_layers):
            if device == "meta":
                with torch.device("meta"):
                    layer = factory(i)
            else:
                layer = build_layer(factory, seed, i)
            x = layer(x)
            params.append(sum(p.numel() for p in layer.parameters()))
            shapes.append((x.shape, x.dtype))
            names.append(type(layer).__name__)
    return params, shapes, names


def _timed(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(
    shard: Shard,
    layers: list[int],
    inputs: torch.Tensor,
    names: list[str],
    *,
    reps: int = 3,
) -> list[LayerCost]:
    """Costs of consecutive held ``layers``, starting from ``inputs`` (one micro-batch)."""
    out = []
    x = inputs
    for i in layers:
        layer: nn.Module = shard.layers[i]
        leaf = x.detach().requires_grad_(x.is_floating_point())
        # Distinct storages, the layer's own weights left out (they are state): what the
        # runtime's meter counts as this layer's activations (chameleon_runtime.memory).
        weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        stashed: dict[int, int] = {}

        def pack(
            t: torch.Tensor, saved: dict[int, int] = stashed, weights: set[int] = weights
        ) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        def forward(layer: nn.Module = layer, leaf: torch.Tensor = leaf) -> torch.Tensor:
            return shard.run_layer(layer, leaf)  # at the run's precision

        forward_s = _timed(forward, reps)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = forward()
        grad = torch.randn_like(y) if y.is_floating_point() else None

        def backward(
            layer: nn.Module = layer, leaf: torch.Tensor = leaf, grad: torch.Tensor | None = grad
        ) -> None:
            shard.run_layer(layer, leaf).backward(grad)

        backward_s = max(0.0, _timed(backward, reps) - forward_s)
        ghost = copy.deepcopy(layer)
        optimizer = shard.make_optimizer(list(ghost.parameters()))
        for p in ghost.parameters():
            p.grad = torch.zeros_like(p)
        optimizer_s = _timed(optimizer.step, reps)
        layer.zero_grad(set_to_none=True)
        out.append(
            LayerCost(
                name=f"{names[i]}.{i}",
                num_params=sum(p.numel() for p in layer.parameters()),
                forward_s=forward_s,
                backward_s=backward_s,
                optimizer_s=optimizer_s,
                activation_bytes=y.numel() * y.element_size(),
                stash_bytes=sum(stashed.values()),
            )
        )
        x = y.detach()
    return out
