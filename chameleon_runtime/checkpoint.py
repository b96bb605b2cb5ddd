"""Atomic checkpoints, one file per layer, written by the layer's first holder.

    <dir>/step_000120/layer_0003.pt   params + optimizer state of layer 3 after step 120
    <dir>/latest                      {"step": 120, "num_layers": 6}, replaced atomically

Every file is written to a temporary name and renamed into place; ``latest`` moves only
after every layer of the step is on disk (a barrier among the workers), so a crash at any
moment leaves the previous checkpoint intact. Files are loaded with weights_only=True.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from chameleon_runtime.shard import Shard

KEEP = 2


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def save_layers(root: Path, step: int, shard: Shard, layers: list[int]) -> None:
    folder = step_dir(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    for i in layers:
        header, tensors = shard.export_layer(i)
        path = folder / f"layer_{i:04d}.pt"
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        torch.save({"header": json.dumps(header), "tensors": tensors}, tmp)
        os.replace(tmp, path)


def publish(root: Path, step: int, num_layers: int) -> None:
    """Point ``latest`` at a complete step and prune older ones (chief only). Never back
    to an older step: a node cut off on etcd may still complete (and save) the step in
    flight at the cut in the moment after the heal, before it learns it was fenced
    (docs/clusters.md), while the others have saved later ones. (A guard, not a fencing
    token: two writers at the same moment can still race.)"""
    current = latest(root)
    if current is not None and current > step:
        return
    _atomic_write_bytes(
        root / "latest", json.dumps({"step": step, "num_layers": num_layers}).encode()
    )
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in steps[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)


def latest(root: Path) -> int | None:
    try:
        return json.loads((root / "latest").read_text())["step"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return None


def load_layers(root: Path, step: int, shard: Shard, layers: list[int]) -> None:
    folder = step_dir(root, step)
    for i in layers:
        blob = torch.load(folder / f"layer_{i:04d}.pt", weights_only=True)
        shard.import_layer(json.loads(blob["header"]), list(blob["tensors"]), restore=True)
