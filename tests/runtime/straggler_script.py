"""A drop-in training loop whose passes are bound by their compute, for the straggler
tests (tests/runtime/test_stragglers.py): float64, the habits real loops have
(``clip_grad_norm_``, AdamW, a schedule, ``zero_grad``), and each micro-batch's forward
spinning for ``--spin`` seconds of CPU time first (a device's work: a worker slowed from
outside its process takes longer in its passes). Every rank that trained to the end
writes its weights to ``OUT.rank<R>.json``."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn

import chameleon_runtime as cr


class Spin(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        until = time.thread_time() + self.seconds
        while time.thread_time() < until:
            pass
        return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--micro-batches", type=int, default=8, help="a step's micro-batches")
    ap.add_argument("--spin", type=float, default=0.004, help="CPU seconds per forward")
    ap.add_argument("--out", required=True)
    ap.add_argument("--log", default=None, help="each step done: 'step time' to LOG.rank<R>")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    n = 2 * args.micro_batches * args.steps
    data = torch.utils.data.TensorDataset(
        torch.randn(n, 8, dtype=torch.float64, generator=g),
        torch.randn(n, dtype=torch.float64, generator=g),
    )
    sampler = cr.ElasticSampler(
        data, global_batch_size=2 * args.micro_batches, micro_batch_size=2, seed=0
    )
    net = nn.Sequential(Spin(args.spin), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    model = cr.ElasticDataParallel(net, sampler)
    optimizer = cr.ElasticOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), model
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer.optimizer, lambda s: 1.0 / (1 + 0.05 * s)
    )
    model.heal_with(schedule)
    for x, y in torch.utils.data.DataLoader(data, batch_sampler=sampler):
        ((model(x)[:, 0] - y) ** 2).mean().backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if optimizer.step():
            schedule.step()
            if args.log:
                with open(f"{args.log}.rank{os.environ['RANK']}", "a") as f:
                    f.write(f"{optimizer.global_step} {time.time()}\n")
        optimizer.zero_grad()
        if optimizer.global_step >= args.steps:
            break
    state = {k: v.flatten().tolist() for k, v in model.module.state_dict().items()}
    with open(f"{args.out}.rank{os.environ['RANK']}.json", "w") as f:
        json.dump({"state": state}, f)


if __name__ == "__main__":
    main()
