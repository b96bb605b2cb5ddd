"""Which device a worker computes on: ``Trainer(device=...)``, resolved once at start.

- ``cpu``;
- ``cuda``: the GPU of this worker's ``LOCAL_RANK`` (modulo the GPUs visible, so several
  ranks may share one), bound with ``torch.cuda.set_device``;
- ``npu``: an Ascend NPU through ``torch_npu``, imported only when asked for;
- ``auto``: a visible GPU (as ``cuda``), else an NPU torch_npu sees (as ``npu``), else
  cpu. The accelerator path has run on one: on an H100 with torch 2.11 the GPU tests
  (ranks sharing the GPU through gloo staging, a kill recovered in place with the
  failure-free weights, a single-rank NCCL run) and the README demo passed
  (docs/benchmarks.md).

A device that cannot be had is a ``DeviceError`` whose message is one line naming what is
missing, never a traceback from deep inside a step.
"""

from __future__ import annotations

import importlib.util

import torch

DEVICES = ("auto", "cpu", "cuda", "npu")


class DeviceError(RuntimeError):
    """The asked device cannot be used: one line naming what is missing."""


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _npu_count() -> int | None:
    """NPUs visible through torch_npu; None when torch_npu is not installed."""
    if importlib.util.find_spec("torch_npu") is None:
        return None
    import torch_npu  # noqa: F401  (registers torch.npu)

    npu = getattr(torch, "npu", None)
    return npu.device_count() if npu is not None and npu.is_available() else 0


def resolve_device(name: str, local_rank: int = 0) -> str:
    """The device string this worker computes on, or DeviceError."""
    if name not in DEVICES:
        raise DeviceError(f"unknown device {name!r}: choose one of {', '.join(DEVICES)}")
    if name == "auto":
        name = "cuda" if _cuda_count() else "npu" if _npu_count() else "cpu"
    if name == "cpu":
        return "cpu"
    if name == "cuda":
        count = _cuda_count()
        if not count:
            raise DeviceError(
                "device cuda: no GPU visible (torch.cuda.is_available() is False; "
                f"this torch is {torch.__version__}, CUDA {torch.version.cuda or 'none'})"
            )
        where = f"cuda:{local_rank % count}"
    else:
        count = _npu_count()
        if count is None:
            raise DeviceError("device npu: torch_npu is not installed (pip install torch_npu)")
        if not count:
            raise DeviceError("device npu: torch_npu sees no NPU")
        where = f"npu:{local_rank % count}"
    return where


def bind(device: str) -> None:
    """Make ``device`` this process's current accelerator (kernels and NCCL/HCCL
    communicators land on it, not on device 0)."""
    kind = torch.device(device)
    if kind.type == "cuda":
        torch.cuda.set_device(kind)
    elif kind.type == "npu":
        torch.npu.set_device(kind)  # type: ignore[attr-defined]
