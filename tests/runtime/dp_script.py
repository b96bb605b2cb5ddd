"""A DDP loop and the same loop on chameleon_runtime's drop-in API, for
tests/runtime/test_dataparallel.py: run under torchrun (or alone) with ``--mode ddp`` or
``--mode chameleon``; rank 0 writes the losses of every step and the final weights."""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import chameleon_runtime as cr

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["ddp", "chameleon"], required=True)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--global-batch", type=int, default=16)
p.add_argument("--micro-batch", type=int, default=8)
p.add_argument("--out", required=True)
args = p.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
data = TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))
torch.manual_seed(int(os.environ.get("RANK", "0")))  # replicas start apart: rank 0's wins
world = int(os.environ.get("WORLD_SIZE", "1"))
if args.mode == "ddp":
    dist.init_process_group("gloo")
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.micro_batch, sampler=sampler, drop_last=True)
    model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
else:
    sampler = cr.ElasticSampler(
        data, global_batch_size=args.global_batch, micro_batch_size=args.micro_batch, seed=0
    )
    loader = DataLoader(data, batch_sampler=sampler)
    model = cr.DataParallel(model, sampler)
    optimizer = cr.ElasticOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
losses, step, epoch = {}, 0, 0
while step < args.steps:
    sampler.set_epoch(epoch)
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        # the global batch's loss: ours sums micro-batches, DDP's ranks each have one
        total = loss.detach().clone()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if os.environ.get("DP_DEBUG"):
            print(os.environ.get("RANK"), step, float(norm), flush=True)
        if args.mode == "ddp":
            optimizer.step()
            committed = True
        else:
            committed = optimizer.step()
        optimizer.zero_grad()
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.setdefault(step, 0.0)
        losses[step] += total.item()
        if committed:
            schedule.step()
            step += 1
            if step == args.steps:
                break
    epoch += 1
if int(os.environ.get("RANK", "0")) == 0:
    inner = model.module
    weights = {k: v.double().sum().item() for k, v in inner.state_dict().items()}
    with open(args.out, "w") as f:
        json.dump({"losses": losses, "weights": weights, "world": world}, f)
if args.mode == "ddp":  # DDP holds its group: let go of it before destroying it
    del model, optimizer, schedule
    import gc

    gc.collect()  # (DDP's reducer sits in a reference cycle)
    dist.destroy_process_group()
