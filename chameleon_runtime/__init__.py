"""chameleon_runtime: the in-worker engine for scripts launched by ``chameleon run``.

    import chameleon_runtime as cr
    trainer = cr.Trainer(layers=build_layer, num_layers=6, loss_fn=..., optimizer=...,
                         dataset=..., global_batch_size=32, micro_batch_size=2,
                         pipeline_stages=4)
    trainer.fit(steps=100, on_step=lambda info: print(info.step, info.loss))

An ordinary DDP loop swaps three objects (docs/dataparallel.md)::

    sampler = cr.ElasticSampler(dataset, global_batch_size=32, micro_batch_size=8)
    model = cr.ElasticDataParallel(model, sampler)
    optimizer = cr.ElasticOptimizer(torch.optim.AdamW(model.parameters()), model)

A plain torchrun script gets hang detection from ``cr.heartbeat()`` once a step and
``with cr.section("checkpoint", timeout=600):`` around long phases (no-ops elsewhere).
``cr.preempted()`` after ``optimizer.step()`` says when a preemption notice asks the job to
save and leave (docs/clusters.md).
See docs/runtime.md for the full API and examples/train_gpt.py for a complete script.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Imported on first use, not here: the launcher imports chameleon_runtime.protocol, and
# importing this package must not import torch for it (a second or more at every start).
_EXPORTS = {
    "DataParallel": "chameleon_runtime.dataparallel",
    "DeviceError": "chameleon_runtime.device",
    "ElasticDataParallel": "chameleon_runtime.dataparallel",
    "ElasticOptimizer": "chameleon_runtime.elastic_optimizer",
    "ElasticSampler": "chameleon_runtime.sampler",
    "FitResult": "chameleon_runtime.trainer",
    "StepInfo": "chameleon_runtime.trainer",
    "Trainer": "chameleon_runtime.trainer",
    "heartbeat": "chameleon_runtime.scriptbeat",
    "is_saver": "chameleon_runtime.usergroup",
    "preempted": "chameleon_runtime.preemption",
    "section": "chameleon_runtime.scriptbeat",
    "state_dict_for_save": "chameleon_runtime.sharding",
}

if TYPE_CHECKING:
    from chameleon_runtime.dataparallel import DataParallel, ElasticDataParallel
    from chameleon_runtime.device import DeviceError
    from chameleon_runtime.elastic_optimizer import ElasticOptimizer
    from chameleon_runtime.preemption import preempted
    from chameleon_runtime.sampler import ElasticSampler
    from chameleon_runtime.scriptbeat import heartbeat, section
    from chameleon_runtime.sharding import state_dict_for_save
    from chameleon_runtime.trainer import FitResult, StepInfo, Trainer
    from chameleon_runtime.usergroup import is_saver

__all__ = [
    "DataParallel",
    "DeviceError",
    "ElasticDataParallel",
    "ElasticOptimizer",
    "ElasticSampler",
    "FitResult",
    "StepInfo",
    "Trainer",
    "heartbeat",
    "is_saver",
    "preempted",
    "section",
    "state_dict_for_save",
]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'chameleon_runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
