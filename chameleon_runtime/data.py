"""Micro-batches by global sample index: micro-batch k of step s is samples
s*B + k*b ... s*B + (k+1)*b - 1 (modulo the dataset), whichever worker runs it. Every
layout therefore computes the same global batch of every step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class Batches:
    def __init__(self, dataset: Any, *, global_batch_size: int, micro_batch_size: int) -> None:
        if global_batch_size % micro_batch_size:
            raise ValueError("global_batch_size must be a multiple of micro_batch_size")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    def indices(self, step: int, micro_batch: int) -> list[int]:
        start = step * self.global_batch_size + micro_batch * self.micro_batch_size
        n = len(self.dataset)
        return [(start + j) % n for j in range(self.micro_batch_size)]

    def _collate(self, step: int, micro_batch: int, part: int) -> torch.Tensor:
        samples: Sequence[Any] = [self.dataset[i] for i in self.indices(step, micro_batch)]
        return torch.stack([s[part] for s in samples])

    def inputs(self, step: int, micro_batch: int) -> torch.Tensor:
        return self._collate(step, micro_batch, 0)

    def targets(self, step: int, micro_batch: int) -> torch.Tensor:
        return self._collate(step, micro_batch, 1)
