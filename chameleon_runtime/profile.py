"""What the planner needs to know about a model, measured.

- ``probe``: parameter counts and per-micro-batch output shapes of every layer, from one
  pass on the meta device (no memory, no compute), so any worker can size its receive
  buffers and the planner its transfers without building layers it does not hold.
- ``measure``: forward, backward and optimizer time of layers a worker holds, on a
  micro-batch of the real shape, while the other workers run too (on a shared host that
  contention is part of what a step costs); bytes stashed for backward, counted exactly
  with saved-tensor hooks.
- ``link_cost``: latency and bandwidth between two workers, by ping-pong.

``chameleon profile`` runs a training script with CHAMELEON_PROFILE set: the Trainer then
measures instead of training (``Trainer.profile``) and writes a cost table.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from chameleon_runtime.shard import LayerFactory, Shard, build_layer
from planner.wire import LayerCostWire


def probe(
    factory: LayerFactory, num_layers: int, sample: torch.Tensor, *, seed: int
) -> tuple[list[int], list[tuple[torch.Size, torch.dtype]], list[str]]:
    """(parameters per layer, output (shape, dtype) per layer, layer names)."""
    try:
        return _probe_on("meta", factory, num_layers, sample, seed)
    except Exception:  # an op without a meta kernel: pay for a real pass, no grads
        return _probe_on("cpu", factory, num_layers, sample, seed)


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
) -> list[LayerCostWire]:
    """Costs of consecutive held ``layers``, starting from ``inputs`` (one micro-batch)."""
    out = []
    x = inputs
    for i in layers:
        layer: nn.Module = shard.layers[i]
        leaf = x.detach().requires_grad_(x.is_floating_point())
        stashed = [0]

        def pack(t: torch.Tensor, counter: list[int] = stashed) -> torch.Tensor:
            counter[0] += t.numel() * t.element_size()
            return t

        def forward(layer: nn.Module = layer, leaf: torch.Tensor = leaf) -> torch.Tensor:
            return layer(leaf)

        forward_s = _timed(forward, reps)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(leaf)
        grad = torch.randn_like(y) if y.is_floating_point() else None

        def backward(
            layer: nn.Module = layer, leaf: torch.Tensor = leaf, grad: torch.Tensor | None = grad
        ) -> None:
            layer(leaf).backward(grad)

        backward_s = max(0.0, _timed(backward, reps) - forward_s)
        ghost = copy.deepcopy(layer)
        optimizer = shard.make_optimizer(list(ghost.parameters()))
        for p in ghost.parameters():
            p.grad = torch.zeros_like(p)
        optimizer_s = _timed(optimizer.step, reps)
        layer.zero_grad(set_to_none=True)
        out.append(
            LayerCostWire(
                name=f"{names[i]}.{i}",
                num_params=sum(p.numel() for p in layer.parameters()),
                forward_s=forward_s,
                backward_s=backward_s,
                optimizer_s=optimizer_s,
                activation_bytes=y.numel() * y.element_size(),
                stash_bytes=stashed[0],
            )
        )
        x = y.detach()
    return out


def link_cost(
    gen: Any, me: int, peer: int, *, sizes: tuple[int, ...] = (256, 1 << 22), reps: int = 5
) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) between two workers, from ping-pongs of a small and a
    large float32 message: latency from the small, bandwidth from the large."""
    times = {}
    for size in sizes:
        buf = torch.zeros(size // 4)
        samples = []
        for rep in range(reps + 1):
            tag = 3_000_000 + size % 1000 * 10 + rep
            t0 = time.perf_counter()
            if me < peer:
                gen.send(buf, peer, tag)
                gen.flush_sends()
                gen.recv(buf, peer, tag)
            else:
                gen.recv(buf, peer, tag)
                gen.send(buf, peer, tag)
                gen.flush_sends()
            if rep:
                samples.append((time.perf_counter() - t0) / 2)
        times[size] = statistics.median(samples)
    small, large = sizes[0], sizes[-1]
    latency = times[small]
    bandwidth = (large - small) / max(times[large] - times[small], 1e-9)
    return latency, bandwidth
