"""A drop-in data-parallel loop that saves and leaves on a preemption notice, and resumes
from what it saved, as docs/clusters.md tells a user to write it (test_preemption.py).

    --mode chameleon   the drop-in under chameleon run (cr.preempted() after each step)
    --mode plain       a plain DDP script under chameleon run, the notice forwarded to it
                       as a signal (cr.preempted() took it over; the ranks agree on the
                       step with an all-reduce of the flag, as torchrun scripts do)
    --mode alone       one process, the whole global batch: the failure-free weights

float64 throughout; the checkpoint is one file, written by the saver, atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import chameleon_runtime as cr

GLOBAL_BATCH, MICRO_BATCH = 16, 8


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["chameleon", "plain", "alone"], required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-s", type=float, default=0.05, help="a pause per step (a real step)")
    p.add_argument("--ignore-notice", action="store_true", help="never look at cr.preempted()")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 8, dtype=torch.float64), torch.randint(0, 4, (512,)))
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    rank = int(os.environ.get("RANK", "0"))
    if args.mode == "plain":
        cr.preempted()  # takes the preemption signals over, before the loop
        dist.init_process_group("gloo")
        sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
        loader = DataLoader(data, batch_size=GLOBAL_BATCH // dist.get_world_size(), sampler=sampler)
        model: nn.Module = nn.parallel.DistributedDataParallel(net)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        micro = GLOBAL_BATCH if args.mode == "alone" else MICRO_BATCH
        sampler = cr.ElasticSampler(
            data, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro, seed=0
        )
        loader = DataLoader(data, batch_sampler=sampler)
        model = cr.ElasticDataParallel(net, sampler)
        optimizer = cr.ElasticOptimizer(
            torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1), model
        )
    step, epoch = 0, 0
    if os.path.exists(args.ckpt):  # the requeued job: resume from what was saved
        saved = torch.load(args.ckpt, weights_only=True)
        net.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step, epoch = saved["step"], saved["epoch"]
        if args.mode != "plain":
            sampler.load_state_dict(saved["sampler"])
    stopped = None
    while step < args.steps and stopped is None:
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            step = step + 1 if args.mode == "plain" else optimizer.global_step
            with open(f"{args.out}.progress{rank}", "w") as f:
                f.write(str(step))
            time.sleep(args.step_s)
            if not args.ignore_notice and _stop_now(args.mode):
                stopped = step
                _save(args.ckpt, net, optimizer, sampler, step, epoch, args.mode)
                break
            if step == args.steps:
                break
        else:
            epoch += 1
    state = {k: v.flatten().tolist() for k, v in net.state_dict().items()}
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump({"state": state, "step": step, "stopped": stopped}, f)
    if args.mode == "plain":  # DDP holds its group: let go of it before destroying it
        del model  # (freed after the group, DDP's reducer joined gloo's thread while that
        import gc  # thread waited for the GIL: a hang at exit, 1 run in 8 here)

        gc.collect()
        dist.destroy_process_group()


def _stop_now(mode: str) -> bool:
    if mode != "plain":
        return cr.preempted()  # the same step on every member
    flag = torch.tensor([float(cr.preempted())])
    dist.all_reduce(flag)  # the script's own agreement on the step
    return flag.item() > 0


def _save(path, net, optimizer, sampler, step, epoch, mode) -> None:  # noqa: ANN001
    saver = dist.get_rank() == 0 if mode == "plain" else cr.is_saver()
    if not saver:
        return
    state = {"model": net.state_dict(), "optimizer": optimizer.state_dict()}
    state |= {"step": step, "epoch": epoch}
    if mode != "plain":
        state["sampler"] = sampler.state_dict()
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
