"""An HSDP training loop (tests/runtime/test_hsdp.py), float64: replica groups of
``--shards`` workers, FSDP2 (``fully_shard`` per block) within each.

- ``--mode plain``: plain HSDP under torchrun, as torchtitan runs it: a 2-D mesh,
  ``fully_shard`` on it, each rank its share of every step's micro-batches (the samples
  ElasticSampler deals), no gradient sync but on the last (``set_requires_gradient_sync``),
  the loss divided by the accumulation count.
- ``--mode dropin``: the same loop ported to the drop-in (docs/dataparallel.md): the
  mesh and the ``fully_shard`` calls become ``shards=`` and ``blocks=``, the loader draws
  from the ElasticSampler, the optimizer is wrapped. Under torchrun or chameleon run.

Both keep the habits such loops have: ``clip_grad_norm_`` over the sharded gradients (a
DTensor collective of the group), a learning-rate schedule, AdamW with weight decay,
``zero_grad``. Each rank writes its full weights (``full_tensor``) to
``OUT.rank<R>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

MICRO = 2  # samples a micro-batch


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)[:, 0]


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, dtype=torch.float64, generator=g)
        self.y = torch.randn(n, dtype=torch.float64, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["plain", "dropin"], required=True)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8, help="a step's micro-batches")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds after each step")
    ap.add_argument("--check-every", type=int, default=100)
    ap.add_argument(
        "--drift", default=None, help="RANK:STEP: that rank's shard of a weight is changed "
        "once STEP steps are committed (a fault the replicas' consistency check must heal)",
    )  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    import chameleon_runtime as cr

    data = Data(args.micro_batches * MICRO * args.steps)
    sampler = cr.ElasticSampler(
        data, global_batch_size=args.micro_batches * MICRO, micro_batch_size=MICRO
    )
    model = Net().double()
    if args.mode == "plain":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh(
            "cpu", (world // args.shards, args.shards), mesh_dim_names=("replicate", "shard")
        )
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.1 * s))
        share = [j for j in range(args.micro_batches) if j % world == rank]
        for step in range(args.steps):
            for k, j in enumerate(share):
                x, y = data[sampler.indices(step, j)]
                model.set_requires_gradient_sync(k == len(share) - 1)
                (((model(x) - y) ** 2).mean() / len(share)).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
    else:
        model = cr.ElasticDataParallel(
            model, sampler, shards=args.shards, blocks=model.blocks, check_every=args.check_every
        )
        drift = tuple(map(int, args.drift.split(":"))) if args.drift else None
        optimizer = cr.ElasticOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), model
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer.optimizer, lambda s: 1.0 / (1 + 0.1 * s)
        )
        model.heal_with(schedule)
        for x, y in torch.utils.data.DataLoader(data, batch_sampler=sampler):
            ((model(x) - y) ** 2).mean().backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            if optimizer.step():
                schedule.step()
                time.sleep(args.sleep)  # (a slower job, for a test to act mid-run)
                if drift == (int(os.environ["RANK"]), optimizer.global_step):
                    with torch.no_grad():  # a bit flip's worth, in this rank's shard only
                        model.module.embed.weight.to_local().add_(1e-3)
            optimizer.zero_grad()
            if optimizer.global_step >= args.steps:
                break
        rank = int(os.environ["RANK"])
    state = {
        name.removeprefix("module."): p.full_tensor().flatten().tolist()
        for name, p in model.named_parameters()
    }
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump({"state": state, "lr": schedule.get_last_lr()[0]}, f)
    if args.mode == "plain":
        # Every rank past its last collective, then the groups shut down before the
        # interpreter ends: a gloo group destroyed at exit with its threads running aborts
        # the process ("terminate called without an active exception", 1 plain run of
        # ~30 in CI; chameleon_runtime.usergroup does the same for the drop-in)
        dist.barrier()
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
