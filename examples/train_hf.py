"""A Hugging Face causal LM trained by an ordinary PyTorch loop on chameleon_runtime's
drop-in data-parallel API (docs/dataparallel.md).

    chameleon run --standalone --nproc-per-node 2 examples/train_hf.py --steps 30
    torchrun --standalone --nproc-per-node 2 examples/train_hf.py --steps 30

The model is built from a config (``--family gpt2`` or ``llama``, a few small layers,
random initial weights: nothing is downloaded); the text is Python's own documentation
as it ships with the interpreter (``pydoc_data.topics``), read as bytes (a 256-token
vocabulary, no tokenizer to fetch). The loop is the one a DDP script has, with three
objects swapped: ``cr.ElasticSampler`` for DistributedSampler, ``cr.ElasticDataParallel``
for DistributedDataParallel, ``cr.ElasticOptimizer`` around AdamW. The saver
(``cr.is_saver()``: rank 0 until it is lost, then the lowest-ranked member) prints
``step N loss X`` (its own micro-batches' mean) once a step commits. ``--checkpoint-dir``
saves model, optimizer, schedule and sampler every ``--checkpoint-every`` steps,
atomically, and resumes from them (what a restart needs under torchrun; a replacement
heals from a live member after it, when its loop starts).

``--shards S`` trains the model as HSDP (chameleon_runtime.sharding): replica groups of S
workers, each transformer block and the root sharded by FSDP2 within a group
(``shards=``/``blocks=`` of ``cr.ElasticDataParallel``, in place of a 2-D mesh and
``fully_shard`` calls), the groups' sums fault tolerant.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from pydoc_data.topics import topics

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import chameleon_runtime as cr


class Text(Dataset):
    """Python's documentation as bytes, cut into samples of ``seq_len`` tokens."""

    def __init__(self, seq_len: int) -> None:
        data = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i * self.seq_len : (i + 1) * self.seq_len]


def build_model(family: str, layers: int, hidden: int, heads: int, seq_len: int):
    torch.manual_seed(0)  # the same initial weights on every rank, as a recipe seeds them
    if family == "gpt2":
        config = GPT2Config(
            vocab_size=256, n_positions=seq_len, n_embd=hidden, n_layer=layers, n_head=heads,
            loss_type="ForCausalLM",
        )  # fmt: skip
        return GPT2LMHeadModel(config)
    config = LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=seq_len, loss_type="ForCausalLM",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def blocks_of(net) -> list:
    """The transformer blocks, each sharded on its own (as torchtitan shards them)."""
    return list(net.transformer.h) if hasattr(net, "transformer") else list(net.model.layers)


def save(path: Path, model, optimizer, schedule, sampler) -> None:
    tmp = path.with_suffix(".tmp")
    state = {
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "sampler": sampler.state_dict(),
    }
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a reader sees the old checkpoint or the new one


class Sharded:
    """A sharded model's checkpoint (``--shards``), as torchtitan writes one: each member
    writes its shards with torch.distributed.checkpoint (one copy of each: DCP keeps one
    of a shard's replicas), the saver the schedule and sampler beside them, then points
    ``latest`` at the step's folder (an atomic rename); the previous one is kept."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def save(self, model, optimizer, schedule, sampler) -> None:
        import torch.distributed.checkpoint as dcp

        folder = self.root / f"step_{sampler.step:06d}"
        # (a member of a group re-sharded over its survivors writes nothing: its rows
        # are the whole groups', which DCP would find overlapping its own)
        weights, moments = cr.state_dict_for_save(model, optimizer)
        dcp.save({"model": weights, "optimizer": moments}, checkpoint_id=folder)
        if cr.is_saver():
            extra = {"schedule": schedule.state_dict(), "sampler": sampler.state_dict()}
            torch.save(extra, folder / "extra.pt.tmp")
            os.replace(folder / "extra.pt.tmp", folder / "extra.pt")
            (self.root / "latest.tmp").write_text(folder.name)
            os.replace(self.root / "latest.tmp", self.root / "latest")
            for old in sorted(self.root.glob("step_*"))[:-2]:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, model, optimizer, schedule, sampler) -> bool:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        if not (self.root / "latest").exists():
            return False
        folder = self.root / (self.root / "latest").read_text()
        weights, moments = get_state_dict(model.module, optimizer.optimizer)
        state = {"model": weights, "optimizer": moments}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(
            model.module,
            optimizer.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        extra = torch.load(folder / "extra.pt", weights_only=True)
        schedule.load_state_dict(extra["schedule"])
        sampler.load_state_dict(extra["sampler"])
        return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--family", choices=["gpt2", "llama"], default="gpt2")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--dump", default=None, help="write rank 0's losses and weights' sums here")
    p.add_argument(
        "--float64",
        action="store_true",
        help="train in float64: rounding noise too small to hide a real difference between "
        "a run with failures and one without (the tests' check)",
    )
    p.add_argument(
        "--shards",
        type=int,
        default=1,
        help="HSDP: replica groups of this many workers, the model sharded within each",
    )
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank = int(os.environ.get("RANK", "0"))

    data = Text(args.seq_len)
    sampler = cr.ElasticSampler(
        data, global_batch_size=args.global_batch, micro_batch_size=args.micro_batch, seed=0
    )
    loader = DataLoader(data, batch_sampler=sampler)
    net = build_model(args.family, args.layers, args.hidden, args.heads, args.seq_len)
    net = net.double() if args.float64 else net
    model = cr.ElasticDataParallel(net, sampler, shards=args.shards, blocks=blocks_of(net))
    optimizer = cr.ElasticOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr), model)
    warmup = 5
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    optimizer.heal_with(schedule)  # a replacement takes the schedule's position too

    losses = {}
    ckpt = Path(args.checkpoint_dir) / "last.pt" if args.checkpoint_dir else None
    sharded = (
        Sharded(Path(args.checkpoint_dir)) if args.checkpoint_dir and args.shards > 1 else None
    )
    if sharded is not None:
        ckpt = None  # (torch.distributed.checkpoint's, below)
        # A replacement takes its shards from a live member when a plan takes it in, and
        # until then belongs to no group to load them with.
        resumed = not model.replacement and sharded.load(model, optimizer, schedule, sampler)
        if resumed and cr.is_saver():
            print(f"resumed from step {sampler.step}", flush=True)
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        sampler.load_state_dict(state["sampler"])
        if rank == 0:
            print(f"resumed from step {sampler.step}", flush=True)

    model.train()
    mine = []
    # optimizer.global_step: the job's committed steps (a replacement joins mid-run)
    while optimizer.global_step < args.steps:
        for batch in loader:
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            mine.append(loss.item())
            committed = optimizer.step()
            optimizer.zero_grad()
            if not committed:
                continue
            schedule.step()
            step = optimizer.global_step - 1
            losses[step] = sum(mine) / len(mine)
            mine = []
            if cr.is_saver():
                print(f"step {step} loss {losses[step]:.4f}", flush=True)
            # cr.is_saver(): the lowest-ranked member now (rank 0 under torchrun), so the
            # saves go on when rank 0 is lost
            if ckpt is not None and (step + 1) % args.checkpoint_every == 0 and cr.is_saver():
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                save(ckpt, model, optimizer, schedule, sampler)
            if sharded is not None and (step + 1) % args.checkpoint_every == 0:
                sharded.save(model, optimizer, schedule, sampler)  # every member its shards
            if optimizer.global_step >= args.steps:
                break
    if args.dump:
        # every tensor's sum of squares: a fingerprint whose relative differences do not
        # cancel (a sum near zero makes noise look large)
        state = model.module.state_dict()
        squares = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).double().square().sum().item()
            for k, v in state.items()
        }
        out = Path(f"{args.dump}.rank{rank}.json")
        out.write_text(json.dumps({"losses": losses, "weights": squares}))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
