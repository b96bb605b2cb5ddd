"""A DDP training loop with one habit of real scripts switched on (``--habit``), written
once for plain DDP (``--mode ddp``: torchrun, DistributedDataParallel,
DistributedSampler) and for the drop-in API (``--mode chameleon``: ElasticSampler,
ElasticDataParallel, ElasticOptimizer), ported as docs/dataparallel.md says and nothing
more. tests/runtime/test_habits.py runs it under torchrun and under chameleon run with a
kill -9, and compares the final weights. Every rank that reaches the end writes its
state dict (float64, as lists) to ``OUT.rank<R>.json``; with several habits (each trained
in turn, in the same process group), to ``OUT-<habit>.rank<R>.json``.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import chameleon_runtime as cr

HABITS = (
    "plain",  # zero_grad from the wrapper, clipping, a schedule: the baseline
    "model_zero_grad",  # model.zero_grad() instead of optimizer.zero_grad()
    "inner_zero_grad",  # the inner optimizer's zero_grad()
    "keep_grads",  # optimizer.zero_grad(set_to_none=False)
    "zero_grad_first",  # zero_grad at the top of the turn, before the forward
    "zero_grad_middle",  # zero_grad between the forward and the backward
    "eval_forward",  # an eval-mode, no_grad forward in every turn (a metric)
    "no_grad_forward",  # a train-mode forward under no_grad
    "extra_forward",  # a second train-mode forward with grad, not backpropagated
    "two_forwards",  # two forwards, one backward of both (R-Drop style)
    "two_backwards",  # loss.backward(retain_graph=True), then an auxiliary loss's
    "l2_penalty",  # a penalty on the parameters added to the loss, outside the forward
    "checkpointing",  # torch.utils.checkpoint around the body, use_reentrant=True
    "unused",  # a parameter the forward never uses (find_unused_parameters=True)
    "batchnorm",  # BatchNorm buffers (DDP's broadcast_buffers)
    "two_optimizers",  # one optimizer for the body, another for the head
    "param_groups",  # two parameter groups, their own learning rates
    "clip_value",  # clip_grad_value_ instead of the norm
    "loader_workers",  # DataLoader(num_workers=2, persistent_workers=True)
    "compile",  # a torch.compile'd inner module (backend aot_eager)
    "bf16_autocast",  # torch.autocast(bfloat16) (float32 weights)
    "fp16_scaler",  # torch.autocast(float16) and torch.amp.GradScaler (float32 weights)
    # the script's own torch.distributed: a metrics all-reduce every step, a barrier every
    # third step, a torch.distributed.checkpoint save at the end, cr.is_saver()'s marker
    "user_collectives",
)
# Autocast leaves float64 alone: these habits train in float32 (test_habits compares
# them at float32's tolerance).
FLOAT32 = {"bf16_autocast", "fp16_scaler"}


class Net(nn.Module):
    def __init__(self, habit: str) -> None:
        super().__init__()
        self.reentrant = habit == "checkpointing"
        self.body = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16) if habit == "batchnorm" else nn.Identity()
        self.head = nn.Linear(16, 4)
        self.spare = nn.Linear(4, 4) if habit == "unused" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant:  # recomputed in the backward, in a backward of its own
            x = x.requires_grad_()
            hidden = torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=True)
        else:
            hidden = self.body(x)
        return self.head(torch.tanh(self.norm(hidden)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["ddp", "chameleon"], required=True)
    p.add_argument(
        "--habit",
        default="plain",
        help="one habit, or several comma-separated (or 'all'), each trained in turn from "
        "the same seed in one process group: OUT-<habit>.rank<R>.json each",
    )
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--out", required=True)
    p.add_argument("--no-find-unused", action="store_true", help="leave DDP's flag off")
    p.add_argument("--raise-at", type=int, default=None, help="rank 0 raises at this step")
    p.add_argument(
        "--own-count",
        action="store_true",
        help="end the loop on the script's own count of steps, not optimizer.global_step "
        "(a replacement's starts at 0)",
    )
    p.add_argument("--check-every", type=int, default=100, help="the consistency check's period")
    p.add_argument(
        "--perturb", default=None, help="RANK,STEP: that rank's weights move after that step"
    )
    args = p.parse_args()
    habits = list(HABITS) if args.habit == "all" else args.habit.split(",")
    unknown = [h for h in habits if h not in HABITS]
    if unknown:
        p.error(f"unknown habit(s) {unknown}")
    torch.set_num_threads(1)
    if args.mode == "ddp":
        dist.init_process_group("gloo")
    for habit in habits:
        train(args, habit, args.out if len(habits) == 1 else f"{args.out}-{habit}")
    if args.mode == "ddp":
        dist.destroy_process_group()


def train(args: argparse.Namespace, habit: str, path: str) -> None:
    dtype = torch.float32 if habit in FLOAT32 else torch.float64
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 8, dtype=dtype), torch.randint(0, 4, (512,)))
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(100 + rank)  # replicas start apart: rank 0's weights win
    net = Net(habit).to(dtype)
    inner = net
    if habit == "compile":
        inner = torch.compile(net, backend="aot_eager")
    workers = 2 if habit == "loader_workers" else 0
    extra = {"num_workers": workers, "persistent_workers": workers > 0}
    find_unused = habit == "unused" and not args.no_find_unused
    if args.mode == "ddp":
        sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
        loader = DataLoader(data, batch_size=args.micro_batch, sampler=sampler, **extra)
        model = nn.parallel.DistributedDataParallel(inner, find_unused_parameters=find_unused)
    else:
        sampler = cr.ElasticSampler(
            data, global_batch_size=args.global_batch, micro_batch_size=args.micro_batch, seed=0
        )
        loader = DataLoader(data, batch_sampler=sampler, **extra)
        model = cr.ElasticDataParallel(
            inner, sampler, find_unused_parameters=find_unused, check_every=args.check_every
        )

    def wrap(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer if args.mode == "ddp" else cr.ElasticOptimizer(optimizer, model)

    if habit == "two_optimizers":
        inners = [
            torch.optim.AdamW(net.body.parameters(), lr=1e-2, weight_decay=0.1),
            torch.optim.SGD(net.head.parameters(), lr=5e-2, momentum=0.9),
        ]
    elif habit == "param_groups":
        inners = [
            torch.optim.AdamW(
                [{"params": net.body.parameters(), "lr": 2e-2}, {"params": net.head.parameters()}],
                lr=5e-3,
                weight_decay=0.1,
            )
        ]
    else:
        inners = [torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)]
    optimizers = [wrap(o) for o in inners]
    schedules = [
        torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + 0.1 * s)) for o in optimizers
    ]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if habit == "fp16_scaler" else None
    if args.mode == "chameleon":
        model.heal_with(*schedules, *([scaler] if scaler else []))
    autocast = {"bf16_autocast": torch.bfloat16, "fp16_scaler": torch.float16}.get(habit)
    loss_fn = nn.functional.cross_entropy

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if args.raise_at == step and rank == 0:
                raise ValueError(f"a bug at step {step}")
            if habit == "zero_grad_first":
                for o in optimizers:
                    o.zero_grad()
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                out = model(x)
                loss = loss_fn(out, y)
                if habit == "two_forwards":
                    again = model(x)
                    loss = loss + 0.5 * loss_fn(again, y) + 0.1 * (out - again).square().mean()
            if habit == "eval_forward":
                model.eval()
                with torch.no_grad():
                    model(x)
                model.train()
            elif habit == "no_grad_forward":
                with torch.no_grad():
                    model(x)
            elif habit == "extra_forward":
                model(x).sum()  # a metric's pass, never backpropagated
            if habit == "l2_penalty":
                loss = loss + 1e-3 * sum(p.square().sum() for p in net.parameters())
            elif habit == "zero_grad_middle":
                for o in optimizers:
                    o.zero_grad()
            if scaler is not None:
                scaler.scale(loss).backward()
                for o in optimizers:
                    scaler.unscale_(o)
            elif habit == "two_backwards":
                loss.backward(retain_graph=True)
                (0.3 * out.square().mean()).backward()
            else:
                loss.backward()
            if habit == "clip_value":
                nn.utils.clip_grad_value_(model.parameters(), 0.05)
            else:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if scaler is not None:
                results = [scaler.step(o) for o in optimizers]
                scaler.update()
            else:
                results = [o.step() for o in optimizers]
            committed = args.mode == "ddp" or all(results)
            if habit == "model_zero_grad":
                model.zero_grad()
            elif habit == "inner_zero_grad":
                for o in inners:
                    o.zero_grad()
            elif habit == "keep_grads":
                for o in optimizers:
                    o.zero_grad(set_to_none=False)
            elif habit not in ("zero_grad_first", "zero_grad_middle"):
                for o in optimizers:
                    o.zero_grad()
            if habit == "user_collectives" and committed and step % 2 == 0:
                # once a step, as a loop logs (every other step): every member takes as
                # many steps, not as many turns (a member dealt two micro-batches takes
                # two a step). ``step`` counts the steps before this one, and the test's
                # kill (step=5) pauses rank 0 at step 6's start: step 5, the one before
                # it, has none. A peer killed just after a collective of the script's own
                # can take its last bytes with it (the survivor's read fails, "Connection
                # closed by peer"), and the survivor is lost too, as under torchrun
                # (docs/dataparallel.md); with two workers none is left (seen in CI).
                metric = loss.detach().clone()
                dist.all_reduce(metric)
                if step % 4 == 2:
                    dist.barrier()
            if committed:
                for s in schedules:
                    s.step()
                own = args.mode == "ddp" or args.own_count
                step = step + 1 if own else optimizers[0].global_step
                if args.perturb and [rank, step] == [int(v) for v in args.perturb.split(",")]:
                    with torch.no_grad():  # a bit flip, a bug: one replica moves alone
                        net.head.bias[0] += 1e-3
                if step == args.steps:
                    break
        epoch += 1
    if habit == "user_collectives":
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": net.state_dict()}, checkpoint_id=f"{path}.dcp")
        if cr.is_saver():
            with open(f"{path}.saver{rank}", "w") as f:
                f.write(f"{dist.get_rank()} of {dist.get_world_size()}")
    state = {k: v.double().flatten().tolist() for k, v in net.state_dict().items()}
    with open(f"{path}.rank{rank}.json", "w") as f:
        json.dump({"state": state, "step": step}, f)
    if args.mode == "ddp":  # DDP holds its group: let go of it before the next or the end
        del model, optimizers, schedules
        import gc

        gc.collect()


if __name__ == "__main__":
    main()
