"""fp16's dynamic loss scale (chameleon_runtime.scaler): the rules of torch.amp.GradScaler,
and the state carried by layers (newer from a migration, always from a checkpoint)."""

from __future__ import annotations

import math

import torch
from torch import nn

from chameleon_runtime.scaler import LossScale
from chameleon_runtime.shard import Shard


def test_the_scale_follows_torch_grad_scaler_step_for_step():
    pattern = [True, False, True, True, True, True, False, False, True, True, True, True, True]
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    param = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.1)
    ours = LossScale(scale=2.0**10, growth_interval=3)
    for step, finite in enumerate(pattern):
        torch_scaler.scale(torch.ones(1))  # (GradScaler starts its state here)
        param.grad = torch.tensor([1.0, 2.0 if finite else math.inf])
        torch_scaler.step(opt)
        torch_scaler.update()
        ours.update(step, finite)
        assert ours.scale == torch_scaler.get_scale(), step
    assert ours.skipped == pattern.count(False)
    assert ours.next_step == len(pattern)


def _shard(scale: float) -> Shard:
    return Shard(
        lambda i: nn.Linear(3, 3), lambda p: torch.optim.SGD(p, lr=0.1), seed=0,
        precision="fp16", init_loss_scale=scale,
    )  # fmt: skip


def test_a_migrated_layer_brings_a_newer_scale_and_a_checkpoint_restores_its_own():
    source = _shard(2.0**16)
    source.ensure(0, 2)
    for step in range(5):  # trained through: overflowed at step 1
        source.scaler.update(step, finite=step != 1)
    header, tensors = source.export_layer(0)
    joiner = _shard(2.0**16)  # a fresh process: its state is of step 0
    joiner.import_layer(header, tensors)
    assert (joiner.scaler.scale, joiner.scaler.next_step) == (2.0**15, 5)
    stale = dict(header, loss_scale=dict(header["loss_scale"], scale=8.0, next_step=2))
    joiner.import_layer(stale, tensors)  # an older state from a migration: ignored
    assert joiner.scaler.scale == 2.0**15
    joiner.import_layer(stale, tensors, restore=True)  # a checkpoint's: the run goes back
    assert (joiner.scaler.scale, joiner.scaler.next_step) == (8.0, 2)


def test_other_precisions_carry_no_scale():
    shard = Shard(lambda i: nn.Linear(3, 3), lambda p: torch.optim.SGD(p, lr=0.1), seed=0)
    shard.ensure(0, 1)
    assert shard.scaler is None
    assert "loss_scale" not in shard.export_layer(0)[0]
