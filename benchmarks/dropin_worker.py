"""One worker of benchmarks/dropin_vs_torchft.py: the same Hugging Face GPT-2, batch and
AdamW as examples/train_hf.py, in one of three loops:

- ``ddp``: plain PyTorch, DistributedDataParallel with DistributedSampler (torchrun);
- ``torchft``: TorchFT 0.2's DDP loop as its own train_ddp.py writes it (Manager,
  DistributedDataParallel, Optimizer, ProcessGroupGloo with a 5 s timeout, PGTransport to
  heal), one process per replica group;
- ``chameleon``: chameleon_runtime's drop-in API (chameleon run).

Every worker prints one JSON line per step: its rank (or replica group), pid, the step,
the wall clock, whether the step committed here and how many samples it covered; rank 0
(replica group 0) ends with the final model's loss on a fixed held-out batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import transformers  # noqa: F401 - at module level, as an HF script has it: the fork server preloads it
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_hf import Text, build_model  # noqa: E402 - the example's model and text


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def held_out_loss(model: torch.nn.Module, data: Text) -> float:
    """The loss of the final weights on the dataset's last 16 samples, dropout off."""
    batch = torch.stack([data[len(data) - 1 - i] for i in range(16)])
    model.eval()
    with torch.no_grad():
        return float(model(input_ids=batch, labels=batch).loss)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["ddp", "torchft", "chameleon"], required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--replicas", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    data = Text(64)
    net = build_model("gpt2", 2, 64, 4, 64)
    global_batch = args.micro_batch * args.replicas
    if args.mode == "chameleon":
        run_chameleon(args, data, net, global_batch)
    elif args.mode == "ddp":
        run_ddp(args, data, net, global_batch)
    else:
        run_torchft(args, data, net, global_batch)


def run_chameleon(args, data, net, global_batch) -> None:  # noqa: ANN001
    import chameleon_runtime as cr

    rank = int(os.environ.get("RANK", "0"))
    sampler = cr.ElasticSampler(
        data, global_batch_size=global_batch, micro_batch_size=args.micro_batch, seed=0
    )
    model = cr.ElasticDataParallel(net, sampler)
    optimizer = cr.ElasticOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), model)
    loader = DataLoader(data, batch_sampler=sampler)
    samples = 0
    while optimizer.global_step < args.steps:
        for batch in loader:
            model(input_ids=batch, labels=batch).loss.backward()
            samples += len(batch)
            committed = optimizer.step()
            optimizer.zero_grad()
            if not committed:
                continue
            # the whole global batch, whoever computed it (the sampler's deal)
            say(rank=rank, pid=os.getpid(), step=optimizer.global_step - 1, t=time.time(),
                committed=True, samples=global_batch)  # fmt: skip
            if optimizer.global_step >= args.steps:
                break
    if rank == 0:
        say(final_loss=held_out_loss(model.module, data))
    # the replicas' consistency check (on, every 100 steps by default): what it cost here
    say(rank=rank, checks=model.consistency.checks, check_s=model.consistency.seconds)


def run_ddp(args, data, net, global_batch) -> None:  # noqa: ANN001
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.micro_batch, sampler=sampler, drop_last=True)
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = 0
    while step < args.steps:
        for batch in loader:
            optimizer.zero_grad()
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            say(rank=rank, pid=os.getpid(), step=step, t=time.time(), committed=True,
                samples=global_batch)  # fmt: skip
            step += 1
            if step >= args.steps:
                break
    if rank == 0:
        say(final_loss=held_out_loss(model.module, data))
    # (no destroy_process_group: with one rank still evaluating it hung at exit here,
    # as benchmarks/overhead.py's plain pipelines did; the process's end closes the group)


def run_torchft(args, data, net, global_batch) -> None:  # noqa: ANN001
    from torchft import (
        DistributedDataParallel,
        DistributedSampler,
        Manager,
        Optimizer,
        ProcessGroupGloo,
    )
    from torchft.checkpointing.pg_transport import PGTransport

    group = int(os.environ["REPLICA_GROUP_ID"])
    sampler = DistributedSampler(
        data, replica_rank=group, num_replica_groups=args.replicas, group_rank=0,
        num_replicas=1, shuffle=True, seed=0, drop_last=True,
    )  # fmt: skip
    loader = DataLoader(data, batch_size=args.micro_batch, sampler=sampler, drop_last=True)

    def load_state_dict(state: dict) -> None:
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    def state_dict() -> dict:
        return {"model": net.state_dict(), "optim": optimizer.state_dict()}

    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))  # TorchFT's example setting
    manager = Manager(
        pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"bench_{group}", timeout=timedelta(seconds=30),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device="cpu"),
    )  # fmt: skip
    model = DistributedDataParallel(manager, net)
    optimizer = Optimizer(manager, torch.optim.AdamW(model.parameters(), lr=3e-3))
    done = False
    while not done:
        for batch in loader:
            optimizer.zero_grad()  # starts the quorum
            model(input_ids=batch, labels=batch).loss.backward()
            before = manager.current_step()
            optimizer.step()  # steps only if every participant's allreduce succeeded
            step = manager.current_step()
            committed = step > before
            # a committed step covers the batches of the replica groups in the quorum
            say(rank=group, pid=os.getpid(), step=step - 1, t=time.time(),
                committed=bool(committed),
                samples=args.micro_batch * manager.num_participants() if committed else 0)  # fmt: skip
            if step >= args.steps:
                done = True
                break
    if group == 0:
        say(final_loss=held_out_loss(net, data))
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
