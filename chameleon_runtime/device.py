"""Which device a worker computes on: ``Trainer(device=...)``, resolved once at start.

- ``cpu``;
- ``cuda``: the GPU of this worker's ``LOCAL_RANK`` (modulo the GPUs visible, so several
  ranks may share one);
- ``npu``: an Ascend NPU through ``torch_npu``, imported only when asked for;
- ``auto``: the device this runtime trains on wherever it runs: cpu, for now.

A device that cannot be had is a ``DeviceError`` whose message is one line naming what is
missing, never a traceback from deep inside a step.

Only cpu trains today. The runtime moves activations, gradients and layers through gloo
as CPU tensors; staging accelerator tensors through host memory, and the native NCCL/HCCL
transport, are not built yet (issue 11, blocked on a machine with a GPU to test them). So
a visible GPU or NPU is refused with a message saying so, rather than accepted and failed
in the first step.
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
    if name in ("auto", "cpu"):
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
    raise DeviceError(
        f"device {name}: {where} is visible, but the runtime trains on cpu only so far "
        "(its transfers go through gloo as CPU tensors); use --device cpu"
    )
