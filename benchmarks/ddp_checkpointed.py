"""A plain torchrun-style DDP script (no chameleon imports) for the launcher benchmark.

    torchrun --nproc-per-node 4 benchmarks/ddp_checkpointed.py 150
    chameleon run --nproc-per-node 4 benchmarks/ddp_checkpointed.py 150

Trains a small MLP on gloo, checkpoints every 10 steps (atomically), resumes from the last
checkpoint after a restart, and prints "STEP <n> <unix time>" from rank 0 per step (and
"PID <rank> <pid>" from every rank at start).
"""

import os
import sys
import time

import torch
import torch.distributed as dist

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"PID {rank} {os.getpid()}", flush=True)  # which process to kill, for the benchmark
total_steps = int(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
start = 0
if os.path.exists("checkpoint.pt"):
    state = torch.load("checkpoint.pt")
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    start = state["step"] + 1
generator = torch.Generator().manual_seed(rank)
for step in range(start, total_steps):
    x = torch.randn(64, 256, generator=generator)
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()
    if rank == 0:
        if step % 10 == 0:
            torch.save(
                {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                },
                "checkpoint.tmp",
            )
            os.replace("checkpoint.tmp", "checkpoint.pt")
        print(f"STEP {step} {time.time():.4f}", flush=True)
dist.destroy_process_group()
# torch 2.13's gloo can abort at interpreter exit ("terminate called without an active
# exception"), under torchrun and chameleon alike; that is not what this benchmark measures.
sys.stdout.flush()
os._exit(0)
