"""The layers a worker holds, with one optimizer over all of them.

Why one optimizer for the stage and not one per layer: a step then pays one optimizer
call (and one foreach or fused kernel launch where the user's optimizer uses them), as a
plain loop does. An element-wise optimizer (SGD, Adam, AdamW) steps each parameter
exactly as it would in any grouping, so a layer's state still moves, saves and loads as
one unit whatever the layout: it is read off and written into the stage optimizer's
per-parameter state, and the optimizer is rebuilt over the held layers when they change.

Why per-layer seeding: layer i is always built under seed (seed, i), so every holder of it,
now or after a migration, starts from the same weights; and each layer's forward runs
under a seed of (step, micro-batch, layer), so dropout draws the same mask whichever
worker runs it. The generators are seeded directly (``Seeder``), not through
``torch.manual_seed``: on a machine whose CUDA is not initialised, that queues a lazy
seeding with a captured Python stack for every device type, which cost a fifth of a
tiny model's step. The caller's CPU generator is saved once per pass and given back.

Why gradients are summed in float64: which micro-batches a worker runs, and which holders
add up a layer's gradient, depend on the layout, and float32 sums depend on their order.
Each micro-batch's gradient is the same bits wherever it is computed; added into a float64
sum (exact for all but extreme spreads of magnitude) and rounded to float32 once, after
the holders' sums are added, it gives the same gradient in any layout. Training is then
independent of the layout: a run that recovered from failures ends with the same weights
as one that had none (with float32 sums, AdamW turned the order's last bits into
differences of 1e-4 over a few hundred steps and a few dozen layout changes).
Cost: 8 bytes per held parameter, and gradients travel as float64 between holders.

State crosses the network as raw tensors described by a JSON header (shapes, dtypes,
optimizer-state keys) that travels through the store: nothing received is unpickled.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from chameleon_runtime.scaler import INIT_SCALE, LossScale

LayerFactory = Callable[[int], nn.Module]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

_DTYPES = {
    str(t): t
    for t in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)
}


# fp32: as the layers are written. bf16 and fp16: autocast compute with fp32 master weights
# and optimizer state; fp16's narrow range adds dynamic loss scaling (chameleon_runtime.scaler).
PRECISIONS = ("fp32", "bf16", "fp16")
_WIRE = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def layer_seed(seed: int, layer: int) -> int:
    return (seed * 1_000_003 + layer * 7919) % (2**63)


def op_seed(seed: int, step: int, micro_batch: int, layer: int) -> int:
    return (seed * 1_000_003 + step * 104_729 + micro_batch * 7919 + layer * 31) % (2**63)


RngState = tuple[torch.Tensor, torch.Tensor | None]  # the CPU's, the accelerator's


class Seeder:
    """The generators a forward draws from on ``device``: the CPU's, and the
    accelerator's own where it runs on one (module doc): seeded, read and set. A device
    with an index (``cuda:1``) is that device's generator, else the current device's."""

    def __init__(self, device: str | torch.device) -> None:
        device = torch.device(device)
        self._device = None if device.type == "cpu" else torch.get_device_module(device.type)
        self._index = device.index

    def seed(self, value: int) -> None:
        torch.default_generator.manual_seed(value)
        if self._device is None:
            return
        if self._index is None:
            self._device.manual_seed(value)  # the current device's generator only
        else:
            self._device.default_generators[self._index].manual_seed(value)

    def get(self) -> RngState:
        accel = None
        if self._device is not None:
            accel = self._device.get_rng_state(
                self._device.current_device() if self._index is None else self._index
            )
        return torch.get_rng_state(), accel

    def set(self, state: RngState) -> None:
        torch.set_rng_state(state[0])
        if self._device is not None and state[1] is not None:
            index = self._device.current_device() if self._index is None else self._index
            self._device.set_rng_state(state[1], index)


class Streams:
    """The random numbers a micro-batch's forwards draw (the drop-in API's: the Trainer
    seeds per layer, ``Shard.forward``): a stream of its own, seeded at its first forward
    and carried on by its later ones, drawn with the caller's generators put back after
    each forward, so the script's own random state is its own."""

    def __init__(self, device: str | torch.device) -> None:
        self.seeder = Seeder(device)
        self._current: RngState | None = None

    def new(self) -> None:
        """The next forward begins another micro-batch's stream."""
        self._current = None

    @contextlib.contextmanager
    def drawing(self, seed: int) -> Iterator[None]:
        caller = self.seeder.get()
        if self._current is None:
            self.seeder.seed(seed)
        else:
            self.seeder.set(self._current)
        try:
            yield
        finally:
            self._current = self.seeder.get()
            self.seeder.set(caller)


def build_layer(factory: LayerFactory, seed: int, index: int, device: str = "cpu") -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, index))
        module = factory(index)
    return module.to(device)


class Shard:
    def __init__(
        self,
        factory: LayerFactory,
        make_optimizer: OptimizerFactory,
        *,
        seed: int,
        device: str = "cpu",
        precision: str = "fp32",
        init_loss_scale: float = INIT_SCALE,
    ) -> None:
        self.factory = factory
        self.make_optimizer = make_optimizer
        self.seed = seed
        self.device = device
        self.device_type = torch.device(device).type  # autocast's "cuda", not "cuda:1"
        # bf16, fp16: compute under autocast, every layer's floating output rounded to the
        # half type (PRECISIONS); the parameters, their gradients and the optimizer stay fp32.
        self.wire_dtype = _WIRE[precision]
        self.scaler = LossScale(scale=init_loss_scale) if precision == "fp16" else None
        self.layers: dict[int, nn.Module] = {}
        self._optimizer: torch.optim.Optimizer | None = None
        self._optimizer_stale = False  # the held layers changed since it was built
        self._seeder = Seeder(device)
        self.grad_sums: dict[int, list[torch.Tensor]] = {}  # float64, per held layer

    # -- holding -----------------------------------------------------------------------

    def ensure(self, first: int, end: int) -> list[int]:
        """Build (fresh, deterministic) every layer of [first, end) not held yet."""
        built = []
        for i in range(first, end):
            if i not in self.layers:
                self.layers[i] = build_layer(self.factory, self.seed, i, self.device)
                self._optimizer_stale = True
                built.append(i)
        return built

    def keep_only(self, first: int, end: int) -> None:
        for i in [i for i in self.layers if not first <= i < end]:
            del self.layers[i]
            self.grad_sums.pop(i, None)
            self._optimizer_stale = True

    def held(self) -> list[int]:
        return sorted(self.layers)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """One optimizer over every held layer's parameters, in layer order (module doc);
        None while nothing is held. Rebuilt when the held layers changed: the state of
        the parameters it had carries over, a new layer's starts empty (or is imported)."""
        if self._optimizer_stale:
            old = self._optimizer
            params = [p for i in sorted(self.layers) for p in self.layers[i].parameters()]
            new = self.make_optimizer(params) if params else None
            if old is not None and new is not None:
                for p in params:
                    if p in old.state:
                        new.state[p] = old.state[p]
            self._optimizer, self._optimizer_stale = new, False
        return self._optimizer

    def optimizer_state(self, i: int) -> list[dict[str, Any]]:
        """Layer ``i``'s optimizer state, one dict per parameter in parameter order."""
        opt = self.optimizer
        assert opt is not None
        return [opt.state.get(p, {}) for p in self.layers[i].parameters()]

    # -- compute -----------------------------------------------------------------------

    def forward(
        self, x: torch.Tensor, first: int, end: int, *, step: int, micro_batch: int
    ) -> torch.Tensor:
        caller = torch.get_rng_state()  # the caller's CPU generator, given back after
        try:
            for i in range(first, end):
                self._seeder.seed(op_seed(self.seed, step, micro_batch, i))
                x = self.run_layer(self.layers[i], x)
        finally:
            torch.set_rng_state(caller)
        return x

    def run_layer(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One layer at this shard's precision. Rounding every layer's output (not only a
        stage's) keeps a step's arithmetic the same however layers are grouped into
        stages, so a recovery that re-partitions does not change training."""
        if self.wire_dtype is None:
            return layer(x)
        with torch.autocast(device_type=self.device_type, dtype=self.wire_dtype):
            y = layer(x)
        return y.to(self.wire_dtype) if y.is_floating_point() else y

    def params(self, first: int, end: int) -> Iterator[nn.Parameter]:
        for i in range(first, end):
            yield from self.layers[i].parameters()

    def _sums(self, i: int) -> list[torch.Tensor]:
        """Layer ``i``'s float64 gradient sums (zeros until a pass adds to them)."""
        if i not in self.grad_sums:
            params = self.layers[i].parameters()
            self.grad_sums[i] = [torch.zeros_like(p, dtype=torch.float64) for p in params]
        return self.grad_sums[i]

    def accumulate(self, first: int, end: int) -> None:
        """Move the gradients of the pass just run (layers [first, end)) into the float64
        sums: exact, so the order of micro-batches does not matter."""
        for i in range(first, end):
            for total, p in zip(self._sums(i), self.layers[i].parameters(), strict=True):
                if p.grad is not None:
                    total.add_(p.grad)
                    p.grad = None

    def flat_sums(self, first: int, end: int) -> torch.Tensor:
        """A flat copy of this worker's float64 gradient sums of layers [first, end)."""
        sums = [t.reshape(-1) for i in range(first, end) for t in self._sums(i)]
        return torch.cat(sums) if sums else torch.zeros(0, dtype=torch.float64, device=self.device)

    def set_flat_sums(self, first: int, end: int, flat: torch.Tensor) -> None:
        """Replace the sums of layers [first, end) with ``flat`` (the holders' total)."""
        offset = 0
        for i in range(first, end):
            for total in self._sums(i):
                total.copy_(flat[offset : offset + total.numel()].view_as(total))
                offset += total.numel()

    def round_grads(self, first: int, end: int) -> None:
        """Each layer's gradient from its total, rounded once to the parameters' dtype."""
        for i in range(first, end):
            for total, p in zip(self._sums(i), self.layers[i].parameters(), strict=True):
                p.grad = total.to(p.dtype)

    def grad_sq_norm(self, layers: Iterable[int]) -> float:
        """The squared norm of ``layers``' (rounded) gradients, summed in float64 in layer
        and parameter order."""
        total = 0.0
        for i in layers:
            for p in self.params(i, i + 1):
                if p.grad is not None:
                    total += float(p.grad.detach().double().pow(2).sum())
        return total

    def scale_grads(self, first: int, end: int, factor: float) -> None:
        for p in self.params(first, end):
            if p.grad is not None:
                p.grad.mul_(factor)

    def zero_grad(self) -> None:
        for layer in self.layers.values():
            for p in layer.parameters():
                p.grad = None
        for sums in self.grad_sums.values():
            for total in sums:
                total.zero_()

    def step(self, lr: float | None = None) -> None:
        opt = self.optimizer
        if opt is None:
            return
        if lr is not None:
            for group in opt.param_groups:
                group["lr"] = lr
        opt.step()

    # -- state as tensors + JSON header ------------------------------------------------

    def export_layer(self, i: int) -> tuple[dict, list[torch.Tensor]]:
        """Header (JSON-able) and tensors: parameters, then optimizer state in a fixed order."""
        params = list(self.layers[i].parameters())
        tensors = [p.detach().cpu().contiguous() for p in params]
        state_items = pack_optimizer_state(enumerate(self.optimizer_state(i)), tensors)
        header = {
            "layer": i,
            "params": [[list(p.shape), str(p.dtype)] for p in params],
            "state": state_items,
        }
        if self.scaler is not None:
            header["loss_scale"] = self.scaler.to_header()
        return header, tensors

    @staticmethod
    def empty_tensors(header: dict) -> list[torch.Tensor]:
        out = [torch.empty(shape, dtype=_DTYPES[dtype]) for shape, dtype in header["params"]]
        out += [
            torch.empty(shape, dtype=_DTYPES[dtype])
            for _i, _k, shape, dtype in header["state"]
            if shape is not None
        ]
        return out

    def import_layer(
        self, header: dict, tensors: list[torch.Tensor], *, restore: bool = False
    ) -> None:
        """Install a layer (from a migration, or a checkpoint: ``restore``)."""
        i = header["layer"]
        if self.scaler is not None:
            self.scaler.adopt(header.get("loss_scale"), restore=restore)
        self.ensure(i, i + 1)
        params = list(self.layers[i].parameters())
        with torch.no_grad():
            for p, t in zip(params, tensors, strict=False):
                p.copy_(t)
        rest = iter(tensors[len(params) :])
        state: dict[int, dict[str, Any]] = {}
        for index, key, shape, value in header["state"]:
            state.setdefault(index, {})[key] = (
                _state_value(params[index], key, next(rest)) if shape is not None else value
            )
        opt = self.optimizer
        assert opt is not None
        for index, p in enumerate(params):
            opt.state.pop(p, None)
            if index in state:
                opt.state[p] = state[index]

    def checksum(self, i: int) -> float:
        """A cheap fingerprint of a layer's weights, for cross-holder consistency checks."""
        with torch.no_grad():
            return float(
                sum(
                    p.double().sum() + (p.double() ** 2).sum() * 1e-3
                    for p in self.layers[i].parameters()
                )
            )


def _state_value(param: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
    """An optimizer state tensor placed as ``Optimizer.load_state_dict`` places it: a
    step count as it came, the rest on the parameter's device, floating ones in its
    dtype."""
    if key == "step":
        return value
    if value.is_floating_point():
        return value.to(dtype=param.dtype, device=param.device)
    return value.to(device=param.device)


def pack_optimizer_state(
    states: Iterable[tuple[int, dict[str, Any]]], tensors: list[torch.Tensor]
) -> list[list[Any]]:
    """Per-parameter optimizer state as header items (``[index, key, shape, dtype]`` for a
    tensor, appended to ``tensors``; ``[index, key, None, value]`` otherwise)."""
    items: list[list[Any]] = []
    for index, state in states:
        for key in sorted(state):
            value = state[key]
            if torch.is_tensor(value):
                items.append([index, key, list(value.shape), str(value.dtype)])
                tensors.append(value.detach().cpu().contiguous())
            else:
                items.append([index, key, None, value])
    return items


def pack_layers(layers: list[tuple[dict, list[torch.Tensor]]]) -> tuple[torch.Tensor, int]:
    """Exported layers as one byte buffer: the headers' JSON, then every tensor's bytes in
    order. A transfer is then two messages (its length, the buffer) whatever the number of
    tensors: on a link with 100 us latency, a block's 50 tensors sent one by one cost more
    than its bytes."""
    header = json.dumps([h for h, _ in layers]).encode()
    parts = [torch.frombuffer(bytearray(header), dtype=torch.uint8)]
    parts += [t.reshape(-1).view(torch.uint8) for _, tensors in layers for t in tensors]
    return (torch.cat(parts) if len(parts) > 1 else parts[0]), len(header)


def unpack_layers(blob: torch.Tensor, header_len: int) -> list[tuple[dict, list[torch.Tensor]]]:
    """The inverse of ``pack_layers`` (tensors are copies, not views of ``blob``)."""
    headers = json.loads(blob[:header_len].numpy().tobytes())
    offset = header_len
    out = []
    for header in headers:
        tensors = Shard.empty_tensors(header)
        for t in tensors:
            n = t.numel() * t.element_size()
            t.reshape(-1).view(torch.uint8).copy_(blob[offset : offset + n])
            offset += n
        out.append((header, tensors))
    if offset != blob.numel():
        raise ValueError(f"migration buffer of {blob.numel()} bytes, {offset} accounted for")
    return out
