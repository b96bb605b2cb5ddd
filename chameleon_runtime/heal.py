"""A replica's state and how it travels to a replacement (the drop-in data-parallel API,
chameleon_runtime.dataparallel): the model's state dict, every optimizer's state, the
sampler's position, the random state and the objects the script registered with
``heal_with``, streamed over the generation's transport in chunks.

Why chunks, not one buffer: the state of a model trained with AdamW is about 16 bytes a
parameter (7B parameters: ~112 GB); packed into one host buffer it cost the sender that
much memory again, and twice while the buffer was built. Here a tensor on the host that
is at least a chunk long goes out as slices of itself (no copy); smaller ones, and an
accelerator's tensors, are copied into one reused staging chunk. The sender's memory
grows by a chunk at most (``CHAMELEON_HEAL_CHUNK_BYTES``, default 64 MiB) and its sends
complete before the chunk is reused. Both sides cut the stream the same way, from the
header's list of tensor sizes, so the messages match by order (no tags: the transport's
rule).

What travels besides tensors goes in the header as JSON: the optimizers' param groups
and non-tensor state, the sampler's state, the heal_with objects' states with their
tensors replaced by references (any ``state_dict`` works: tensors, numbers, strings,
lists, dicts; anything else is refused when registered, in one line).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from chameleon_runtime.shard import Seeder
from chameleon_runtime.shardlayout import local, shown_as

CHUNK_ENV = "CHAMELEON_HEAL_CHUNK_BYTES"
DEFAULT_CHUNK_BYTES = 64 << 20
_TENSOR = "__chameleon_tensor__"


def chunk_bytes() -> int:
    value = os.environ.get(CHUNK_ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else DEFAULT_CHUNK_BYTES


# -- states with tensors inside: a JSON skeleton and the tensors -----------------------------


def split_state(state: Any, tensors: list[torch.Tensor], where: str = "state") -> Any:
    """``state`` with every tensor replaced by a reference into ``tensors`` (appended);
    raises TypeError naming the first value that cannot travel."""
    if torch.is_tensor(state):
        tensors.append(local(state).detach())  # a sharded tensor: this member's shard
        return {_TENSOR: len(tensors) - 1}
    if isinstance(state, dict):
        out = {}
        for key, value in state.items():
            if not isinstance(key, str | int):
                raise TypeError(f"{where} has a key of type {type(key).__name__}: {key!r}")
            # (JSON keys are strings: int keys are kept apart to come back as ints)
            name = f"i:{key}" if isinstance(key, int) else f"s:{key}"
            out[name] = split_state(value, tensors, f"{where}[{key!r}]")
        return {"__dict__": out}
    if isinstance(state, list | tuple):
        items = [split_state(v, tensors, f"{where}[{i}]") for i, v in enumerate(state)]
        return {"__tuple__": items} if isinstance(state, tuple) else items
    if state is None or isinstance(state, bool | int | float | str):
        return state
    raise TypeError(f"{where} is a {type(state).__name__}, which cannot travel to a replacement")


def join_state(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton:
            return tensors[skeleton[_TENSOR]]
        if "__tuple__" in skeleton:
            return tuple(join_state(v, tensors) for v in skeleton["__tuple__"])
        return {
            (int(k[2:]) if k.startswith("i:") else k[2:]): join_state(v, tensors)
            for k, v in skeleton["__dict__"].items()
        }
    if isinstance(skeleton, list):
        return [join_state(v, tensors) for v in skeleton]
    return skeleton


@dataclass
class ReplicaState:
    """What makes a replica: read from the live objects by ``export``, written into them by
    ``install``."""

    model: torch.nn.Module
    optimizers: list[torch.optim.Optimizer]
    sampler: Any
    rng: Seeder  # the script's generators: the host's and the model's device's
    kept: list[Any] = field(default_factory=list)  # heal_with's objects

    def export(self) -> tuple[dict, list[torch.Tensor]]:
        tensors: list[torch.Tensor] = []
        header = {
            "model": split_state(dict(self.model.state_dict()), tensors, "the model"),
            "optimizers": [
                split_state(o.state_dict(), tensors, "an optimizer's state")
                for o in self.optimizers
            ],
            "sampler": self.sampler.state_dict(),
            "rng": split_state(self.rng.get(), tensors),
            "kept": [
                split_state(o.state_dict(), tensors, f"{type(o).__name__}.state_dict()")
                for o in self.kept
            ],
        }
        return header, tensors

    def install(self, header: dict, tensors: list[torch.Tensor]) -> list[Any]:
        """Installs the model, the optimizers, the sampler and the random state; returns
        the heal_with objects' states (each is loaded by the caller, in order, as the
        objects are registered)."""
        model = join_state(header["model"], tensors)
        sharded = any(local(p) is not p for p in self.model.parameters())
        if sharded:
            _load_shards(self.model, model)
        else:
            self.model.load_state_dict(model)
        for optimizer, state in zip(self.optimizers, header["optimizers"], strict=True):
            optimizer.load_state_dict(join_state(state, tensors))
            if sharded:
                _shard_states(optimizer)
        self.sampler.load_state_dict(header["sampler"])
        self.rng.set(join_state(header["rng"], tensors))
        return [join_state(s, tensors) for s in header["kept"]]


def _load_shards(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """A sharded model's state from the member that holds the same shards (a peer of
    its column: chameleon_runtime.sharding), copied into this member's shards."""
    with torch.no_grad():
        for name, target in model.state_dict().items():
            local(target).copy_(state[name])


def _shard_states(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer's per-parameter state came as local shards: each tensor shaped like
    its parameter's shard is that shard of a state sharded as the parameter (AdamW's
    moments), a DTensor again; the rest (a step count) stays as it came."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if local(p) is p:
                continue
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                plain = torch.is_tensor(value) and local(value) is value
                if plain and value.dim() > 0 and value.shape == local(p).shape:
                    state[key] = shown_as(p, value)


def check_travels(obj: Any) -> None:
    """A heal_with object whose state cannot travel: said when it is registered."""
    split_state(obj.state_dict(), [], f"{type(obj).__name__}.state_dict()")


# -- the stream ------------------------------------------------------------------------------


def _layout(sizes: list[int], chunk: int) -> Iterator[tuple[str, list[tuple[int, int, int]]]]:
    """The messages of a stream: ("slice", [(tensor, start, end)]) for a slice of one large
    tensor, ("staged", [(tensor, start, end), ...]) for small ones copied into a chunk."""
    staged: list[tuple[int, int, int]] = []
    fill = 0
    for i, n in enumerate(sizes):
        if n == 0:
            continue
        if n >= chunk:
            if staged:
                yield "staged", staged
                staged, fill = [], 0
            for start in range(0, n, chunk):
                yield "slice", [(i, start, min(n, start + chunk))]
            continue
        if fill + n > chunk:
            yield "staged", staged
            staged, fill = [], 0
        staged.append((i, 0, n))
        fill += n
    if staged:
        yield "staged", staged


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def send_state(
    send: Callable[[torch.Tensor], None],
    flush: Callable[[], None],
    header: dict,
    tensors: list[torch.Tensor],
    chunk: int | None = None,
) -> None:
    """Stream ``header`` and ``tensors`` (module doc). ``send`` posts a message, ``flush``
    waits for every posted one."""
    chunk = chunk or chunk_bytes()
    tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    meta = {
        "header": header,
        "tensors": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in tensors],
        "chunk": chunk,
    }
    encoded = json.dumps(meta).encode()
    send(torch.tensor([len(encoded)], dtype=torch.int64))
    send(torch.frombuffer(bytearray(encoded), dtype=torch.uint8))
    sizes = [t.numel() * t.element_size() for t in tensors]
    staging: torch.Tensor | None = None
    staged_posted = False  # a send from the staging chunk may still read it
    for kind, parts in _layout(sizes, chunk):
        if kind == "slice" and tensors[parts[0][0]].device.type == "cpu":
            i, start, end = parts[0]
            send(_bytes(tensors[i])[start:end])  # a view: nothing copied, nothing to wait for
            continue
        if staging is None:
            staging = torch.empty(chunk, dtype=torch.uint8)
        elif staged_posted:
            flush()  # the staging chunk is about to be reused
        fill = 0
        for i, start, end in parts:
            staging[fill : fill + end - start].copy_(_bytes(tensors[i])[start:end])
            fill += end - start
        send(staging[:fill])
        staged_posted = True
    flush()


def receive_state(
    recv: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[dict, list[torch.Tensor]]:
    """The other end of ``send_state``: the header and the tensors, on the host."""
    length = int(recv(torch.zeros(1, dtype=torch.int64))[0])
    meta = json.loads(recv(torch.empty(length, dtype=torch.uint8)).numpy().tobytes())
    tensors = [torch.empty(shape, dtype=getattr(torch, dtype)) for shape, dtype in meta["tensors"]]
    chunk = int(meta["chunk"])
    sizes = [t.numel() * t.element_size() for t in tensors]
    staging: torch.Tensor | None = None
    for kind, parts in _layout(sizes, chunk):
        if kind == "slice":
            i, start, end = parts[0]
            recv(_bytes(tensors[i])[start:end])  # straight into place
            continue
        if staging is None:
            staging = torch.empty(chunk, dtype=torch.uint8)
        total = sum(end - start for _, start, end in parts)
        recv(staging[:total])
        fill = 0
        for i, start, end in parts:
            _bytes(tensors[i])[start:end].copy_(staging[fill : fill + end - start])
            fill += end - start
    return meta["header"], tensors
