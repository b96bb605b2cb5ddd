"""Trainer(device=..., transport=...): cpu trains; an accelerator that is missing is one
line naming what is missing; the transports (chameleon_runtime.transport) by name."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import chameleon_runtime as cr
from chameleon_runtime.device import DeviceError, resolve_device
from tests.launcher.helpers import free_port, run

ROOT = Path(__file__).resolve().parent.parent
NO_GPU = not torch.cuda.is_available()
NO_TORCH_NPU = importlib.util.find_spec("torch_npu") is None


def test_cpu_trains_on_cpu_and_auto_on_what_is_visible(monkeypatch):
    import chameleon_runtime.device as device

    assert resolve_device("cpu") == "cpu"
    monkeypatch.setattr(device, "_cuda_count", lambda: 0)
    monkeypatch.setattr(device, "_npu_count", lambda: None)
    assert resolve_device("auto", local_rank=3) == "cpu"
    monkeypatch.setattr(device, "_npu_count", lambda: 2)
    assert resolve_device("auto", local_rank=3) == "npu:1"
    monkeypatch.setattr(device, "_cuda_count", lambda: 1)  # ranks share the one GPU
    assert resolve_device("auto", local_rank=3) == "cuda:0"


def test_the_transport_is_gloo_on_cpu_and_named_otherwise():
    from chameleon_runtime.transport import GlooTransport, NativeTransport, transport_for

    assert isinstance(transport_for("cpu", "native"), GlooTransport)  # the CPU's native
    assert isinstance(transport_for("cuda:0", "gloo"), GlooTransport)
    native = transport_for("cuda:1", "native")
    assert isinstance(native, NativeTransport) and native.name == "nccl"
    assert not native.drains and not native.carries_over  # aborted, never carried over
    with pytest.raises(ValueError, match="unknown transport backend 'mpi'"):
        transport_for("cuda:0", "mpi")


def test_an_unknown_device_names_the_choices():
    with pytest.raises(DeviceError, match="unknown device 'tpu': choose one of auto, cpu"):
        resolve_device("tpu")


@pytest.mark.skipif(not NO_GPU, reason="a GPU is visible")
def test_cuda_without_a_gpu_says_so_in_one_line():
    with pytest.raises(DeviceError) as info:
        resolve_device("cuda")
    assert "no GPU visible" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.skipif(not NO_TORCH_NPU, reason="torch_npu is installed")
def test_npu_without_torch_npu_names_the_package():
    with pytest.raises(DeviceError, match="torch_npu is not installed"):
        resolve_device("npu")


@pytest.mark.skipif(not NO_GPU, reason="a GPU is visible")
def test_the_trainer_refuses_before_building_anything():
    with pytest.raises(DeviceError, match="device cuda"):
        cr.Trainer(
            layers=lambda i: nn.Linear(2, 2), num_layers=1, loss_fn=F.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1), dataset=[], global_batch_size=2,
            micro_batch_size=1, device="cuda",
        )  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not NO_GPU, reason="a GPU is visible")
@pytest.mark.timeout(60)  # 4 s measured
def test_the_example_asked_for_a_missing_gpu_fails_in_one_line(tmp_path):
    result = run(
        "run", "--nproc-per-node", "2", "--plain", "--max-restarts", "0", "--master-port",
        str(free_port()), str(ROOT / "examples" / "train_gpt.py"), "--device", "cuda",
        "--steps", "2", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert "train_gpt.py: error: device cuda: no GPU visible" in out
    assert "Traceback" not in out


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"precision": "int8"}, "precision 'int8' is not supported: use fp32, bf16, fp16"),
        ({"precision": "fp16", "init_loss_scale": 1000.0}, "must be a power of two, not 1000"),
    ],
)
def test_an_unsupported_precision_is_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        cr.Trainer(
            layers=lambda i: nn.Linear(2, 2), num_layers=1, loss_fn=F.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1), dataset=[], global_batch_size=2,
            micro_batch_size=1, **kwargs,
        )  # fmt: skip


def test_bf16_rounds_every_layer_and_keeps_fp32_weights():
    from chameleon_runtime.shard import Shard

    shard = Shard(
        lambda i: nn.Sequential(nn.Linear(4, 4), nn.Tanh()),
        lambda p: torch.optim.SGD(p, lr=0.1), seed=0, precision="bf16",
    )  # fmt: skip
    shard.ensure(0, 3)
    y = shard.forward(torch.randn(2, 4), 0, 3, step=0, micro_batch=0)
    assert y.dtype is torch.bfloat16
    y.float().sum().backward()
    assert all(p.dtype is torch.float32 and p.grad.dtype is torch.float32
               for p in shard.params(0, 3))  # fmt: skip
