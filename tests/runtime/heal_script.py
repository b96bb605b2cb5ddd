"""A drop-in loop over a model whose state (weights and AdamW's two moments) is far larger
than a heal's chunk, for tests/runtime/test_heal_memory.py: every rank that reaches the end
writes its peak resident memory since step 5 and its weights' sums. The peak is the
kernel's high-water mark (VmHWM), reset once the first steps have allocated what a step
allocates (``/proc/self/clear_refs``), so what it measures is the training, then the heal
and not the start-up."""

import argparse
import json
import os
import re
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import chameleon_runtime as cr

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
p.add_argument("--width", type=int, default=2048)
p.add_argument("--micro-batch", type=int, default=64)
p.add_argument("--out", required=True)
p.add_argument("--reset-at", type=int, default=5)
args = p.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
data = TensorDataset(torch.randn(1024, 16), torch.randn(1024, 16))
net = nn.Sequential(
    nn.Linear(16, args.width), nn.Tanh(), nn.Linear(args.width, args.width), nn.Tanh(),
    nn.Linear(args.width, 16),
)  # fmt: skip
mb = args.micro_batch
sampler = cr.ElasticSampler(data, global_batch_size=2 * mb, micro_batch_size=mb, seed=0)
model = cr.ElasticDataParallel(net, sampler)
optimizer = cr.ElasticOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-4), model)
loader = DataLoader(data, batch_sampler=sampler)
while optimizer.global_step < args.steps:
    for x, y in loader:
        nn.functional.mse_loss(model(x), y).backward()
        if optimizer.step() and optimizer.global_step == args.reset_at:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM starts again from what is resident now
        optimizer.zero_grad()
        if optimizer.global_step >= args.steps:
            break
rank = int(os.environ["RANK"])
with open(f"{args.out}.rank{rank}.json", "w") as f:
    json.dump(
        {
            "peak_bytes": 1024
            * int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text())[1]),
            "state_bytes": sum(
                t.numel() * t.element_size()
                for t in [*net.state_dict().values()]
                + [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
            ),
            "sums": {k: v.double().sum().item() for k, v in net.state_dict().items()},
        },
        f,
    )
