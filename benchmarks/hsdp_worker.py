"""One worker of benchmarks/hsdp.py: examples/train_hf.py's GPT-2 trained as HSDP (replica
groups of ``--shards``, FSDP2 ``fully_shard`` per block and on the root), in one of two
loops over the same samples of every step:

- ``plain``: plain HSDP under torchrun, as torchtitan writes it: a 2-D mesh, each rank its
  share of the step's micro-batches (ElasticSampler's deal), reduce-scattered within the
  group after every micro-batch and all-reduced across groups after the last
  (``set_requires_all_reduce``), the loss divided by the accumulation count;
- ``chameleon``: the drop-in (``cr.ElasticDataParallel(shards=, blocks=)``) under chameleon
  run.

Every worker prints one JSON line per committed step (rank, step, wall clock, the
micro-batches it ran in it) and, at the end, its step intervals and peak memory
(benchmarks/overhead.py's Recorder) and, from the lowest live rank, the final model's
loss on a held-out batch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import transformers  # noqa: F401 - at module level, as an HF script has it: the fork server preloads it

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from dropin_worker import held_out_loss, say  # noqa: E402 - the drop-in benchmark's
from overhead import Recorder, _preload  # noqa: E402 - the overhead benchmark's measures
from train_hf import Text, blocks_of, build_model  # noqa: E402 - the example's model and text

WARMUP = 3


def accumulate(model, data, sampler, step: int, share: list[int]) -> float:  # noqa: ANN001
    """Plain HSDP's micro-batches of one step on this rank: reduce-scattered within the
    group after each, all-reduced across groups after the last (as the drop-in sums);
    returns the last one's loss."""
    for k, j in enumerate(share):
        batch = torch.stack([data[i] for i in sampler.indices(step, j)])
        model.set_requires_all_reduce(k == len(share) - 1)
        loss = model(input_ids=batch, labels=batch).loss / len(share)
        loss.backward()
    return float(loss) * len(share)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["plain", "chameleon", "torchft"], required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8, help="a step's")
    p.add_argument("--out", required=True)
    p.add_argument("--float64", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    _preload()
    import torch.distributed as dist

    import chameleon_runtime as cr

    data = Text(64)
    sampler = cr.ElasticSampler(
        data,
        global_batch_size=args.micro_batch * args.micro_batches,
        micro_batch_size=args.micro_batch,
        seed=0,
    )
    if args.mode in ("plain", "torchft"):
        dist.init_process_group("gloo")  # (torchft: the replica group's own)
    recorder = Recorder(WARMUP)  # after the process group, before the model
    net = build_model("gpt2", args.layers, args.hidden, 4, 64)
    net = net.double() if args.float64 else net
    params = sum(p.numel() for p in net.parameters())
    rank = int(os.environ["RANK"])
    if args.mode == "plain":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = dist.get_world_size()
        mesh = init_device_mesh(
            "cpu", (world // args.shards, args.shards), mesh_dim_names=("replicate", "shard")
        )
        for block in blocks_of(net):
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        model = net
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        share = [j for j in range(sampler.num_micro_batches) if j % world == rank]
        model.train()
        for step in range(args.steps):
            loss = accumulate(model, data, sampler, step, share)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            recorder.step(loss)
            say(rank=rank, pid=os.getpid(), step=step, t=time.time(), micro_batches=len(share))
        saver = rank == 0
    elif args.mode == "torchft":
        run_torchft(args, data, net, sampler, recorder)
        return
    else:
        model = cr.ElasticDataParallel(net, sampler, shards=args.shards, blocks=blocks_of(net))
        optimizer = cr.ElasticOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), model)
        model.train()
        loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
        while optimizer.global_step < args.steps:
            for batch in loader:
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                committed = optimizer.step()
                optimizer.zero_grad()
                if committed:
                    step = optimizer.global_step - 1
                    recorder.step(float(loss))
                    # (the micro-batches the committed deal gave it: a redone step's count)
                    say(
                        rank=rank, pid=os.getpid(), step=step, t=time.time(),
                        micro_batches=len(sampler.mine(step)),
                    )  # fmt: skip
                if optimizer.global_step >= args.steps:
                    break
        saver = cr.is_saver()
    final = held_out_loss(model, data)  # (every member: a forward is the group's)
    if saver:
        say(final_loss=final, params=params)
    recorder.dump(args.out, {"params": params})
    if args.mode == "plain":  # (as tests/runtime/hsdp_script.py: no gloo group at exit)
        import gc

        dist.barrier()
        gc.collect()
        dist.destroy_process_group()


def run_torchft(args, data, net, sampler, recorder) -> None:  # noqa: ANN001
    """TorchFT 0.2's HSDP as torchtitan integrates it: this replica group is a torchrun job
    of its own (REPLICA_GROUP_ID), FSDP2 on the group's 1-D mesh, the groups' sum by the
    rank's Manager in FSDP2's all-reduce hook, its Optimizer committing a step when every
    participant's all-reduce succeeded, a restarted group healed by PGTransport from a
    live one (each rank from the rank of its shard)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torchft import Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    group = int(os.environ["REPLICA_GROUP_ID"])
    groups = int(os.environ["REPLICA_GROUPS"])
    rank, shards = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (shards,))
    for block in blocks_of(net):
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    optimizer_inner = torch.optim.AdamW(net.parameters(), lr=3e-3)

    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    # (DTensor state dicts, as torchtitan moves them: a shard from the same shard)
    def load_state_dict(state: dict) -> None:
        set_model_state_dict(net, state["model"])
        set_optimizer_state_dict(net, optimizer_inner, state["optim"])

    def state_dict() -> dict:
        return {
            "model": get_model_state_dict(net),
            "optim": get_optimizer_state_dict(net, optimizer_inner),
        }

    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    manager = Manager(
        pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"hsdp_{group}", timeout=timedelta(seconds=30),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device="cpu"),
    )  # fmt: skip

    def all_reduce_hook(output: torch.Tensor) -> None:
        manager.allreduce(output).wait()  # the mean over the participating groups

    for m in net.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(all_reduce_hook)
    optimizer = Optimizer(manager, optimizer_inner)
    worker = group * shards + rank
    # this rank's share of a step: its group's turns, as the drop-in deals them
    from chameleon_runtime.sampler import deal

    share = deal(sampler.num_micro_batches, list(range(groups * shards)), worker, shards)
    net.train()
    while manager.current_step() < args.steps:
        step = manager.current_step()
        optimizer.zero_grad()  # starts the quorum
        loss = accumulate(net, data, sampler, step, share)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()  # steps only if every participant's all-reduce succeeded
        if manager.current_step() > step:
            recorder.step(loss)
            participants = manager.num_participants()  # (a step of fewer covers less)
            say(rank=worker, pid=os.getpid(), step=step, t=time.time(), micro_batches=len(share),
                groups=participants)  # fmt: skip
    final = held_out_loss(net, data)
    if worker == 0:
        say(final_loss=final, params=sum(p.numel() for p in net.parameters()))
    recorder.dump(args.out, {})
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
