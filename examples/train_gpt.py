"""Train a tiny character-level GPT with chameleon_runtime, on 8 CPU workers, and kill one.

    chameleon run --nproc-per-node 8 --inject-fault kill:rank=5,step=15 examples/train_gpt.py --steps 40

8 workers = 2 pipelines of 4 stages (embedding + 4 blocks + head = 6 layers). Rank 5 dies
at step 15; the launcher picks a recovery policy, the 7 survivors carry on in place from
the step they were at, and the loss curve continues as if nothing happened. Add
``--policy reroute`` (or reparallelize, restart) to the launcher to force one, and
``--max-grad-norm 1.0`` or ``--precision bf16`` (or fp16) to the script for a clipped or
mixed-precision run, ``--exact`` for one whose weights are the same bits in any layout.
Without chameleon run (plain python) it trains on one worker.

The corpus is generated here (a few hundred pseudo-English sentences from a fixed seed), so
the example needs no download.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys

import torch
from torch import nn
from torch.nn import functional as F

import chameleon_runtime as cr

WORDS = [
    "the",
    "a",
    "one",
    "every",
    "some",
    "chameleon",
    "model",
    "worker",
    "pipeline",
    "gradient",
    "layer",
    "node",
    "cluster",
    "trains",
    "learns",
    "fails",
    "recovers",
    "waits",
    "sends",
    "keeps",
    "moves",
    "quickly",
    "slowly",
    "again",
    "today",
    "in",
    "on",
    "with",
    "after",
    "before",
    "while",
    "and",
    "but",
    "so",
    "because",
]


def corpus(num_sentences: int = 600, seed: int = 0) -> str:
    rng = random.Random(seed)
    sentences = []
    for _ in range(num_sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 9))]
        sentences.append(" ".join(words).capitalize() + ".")
    return " ".join(sentences)


class CharDataset:
    """Sample i: a window of ``seq_len`` characters and the same window shifted by one."""

    def __init__(self, text: str, seq_len: int) -> None:
        self.vocab = sorted(set(text))
        index = {c: i for i, c in enumerate(self.vocab)}
        self.data = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.seq_len
        chunk = self.data[start : start + self.seq_len + 1]
        return chunk[:-1], chunk[1:]  # (seq,), (seq,)


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, seq_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seq_len, hidden)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (b, s) -> (b, s, h)
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tokens(idx) + self.positions(positions)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, h) -> (b, s, h)
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        q, k, v = (
            t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v)
        )  # (b, nh, s, hd)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, nh, s, hd)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, h) -> (b, s, vocab)
        return self.out(self.ln(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument(
        "--pipeline-stages",
        type=lambda v: v if v == "auto" else int(v),
        default="auto",
        help='stages per pipeline at the start, or "auto" (default): the planner picks the '
        "starting layout as it picks one after a failure",
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--checkpoint-dir",
        # chameleon run gives each launch its own folder, kept across its restarts: a
        # restart resumes from these checkpoints, a new launch starts afresh.
        default=os.path.join(os.environ.get("CHAMELEON_RUN_DIR", "."), "checkpoints"),
    )
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("auto", "cpu", "cuda", "npu"),
        help="what each worker computes on: its LOCAL_RANK's GPU or NPU, or cpu (default; auto "
        "is cpu until the accelerator path has run on one)",
    )
    parser.add_argument(
        "--transport",
        default="gloo",
        choices=("gloo", "native"),
        help="gloo (default; accelerator tensors staged through host memory) or native "
        "(NCCL on cuda, HCCL on npu)",
    )
    parser.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "bf16", "fp16"),
        help="bf16, fp16: autocast compute, fp32 master weights; fp16 with dynamic loss scaling",
    )
    parser.add_argument(
        "--max-grad-norm",
        type=float,
        default=None,
        help="clip gradients to this global norm across stages and replicas (default: off)",
    )
    parser.add_argument(
        "--exact",
        action="store_true",
        help="float64 gradient sums exchanged between holders: every layout, and so every "
        "recovery, trains the same bits (default: DDP's all-reduce in the gradients' dtype, "
        "a recovered run within float tolerance of a failure-free one)",
    )
    parser.add_argument(
        "--dump", default=None, help="write final per-layer checksums and losses here (tests)"
    )
    args = parser.parse_args()

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    stages = args.pipeline_stages
    if stages != "auto" and world % stages:
        stages = 1
    data = CharDataset(corpus(), args.seq_len)
    vocab = len(data.vocab)
    num_layers = args.blocks + 2

    def layer(i: int) -> nn.Module:
        if i == 0:
            return Embedding(vocab, args.hidden, args.seq_len)
        if i == num_layers - 1:
            return Head(args.hidden, vocab)
        return Block(args.hidden, args.heads)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits.reshape(-1, vocab), targets.reshape(-1)
        )  # (b*s, vocab), (b*s,)

    def lr_at(step: int) -> float:  # short warm-up, then cosine decay
        warm = 5
        if step < warm:
            return args.lr * (step + 1) / warm
        return (
            args.lr
            * 0.5
            * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, args.steps - warm))))
        )

    try:
        trainer = cr.Trainer(
            layers=layer,
            num_layers=num_layers,
            loss_fn=loss_fn,
            optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0),
            dataset=data,
            global_batch_size=args.global_batch,
            micro_batch_size=args.micro_batch,
            pipeline_stages=stages,
            lr_schedule=lr_at,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            device=args.device,
            transport=args.transport,
            max_grad_norm=args.max_grad_norm,
            precision=args.precision,
            exact=args.exact,
        )
    except (cr.DeviceError, ValueError) as exc:  # one line, not a traceback
        sys.exit(f"train_gpt.py: error: {exc}")

    def log(info: cr.StepInfo) -> None:
        if info.is_chief:
            print(
                f"step {info.step:4d}  loss {info.loss:.4f}  {info.seconds * 1e3:6.1f} ms  gen {info.generation}",
                flush=True,
            )

    result = trainer.fit(args.steps, on_step=log)
    if result.preempted and int(os.environ.get("RANK", "0")) == 0:
        # (chameleon run --signals-to-handle: the launcher exits 75, "requeue me")
        print(f"preempted: saved at step {result.steps} in {args.checkpoint_dir}", flush=True)
    if args.dump:
        rank = int(os.environ.get("RANK", "0"))
        with open(f"{args.dump}.rank{rank}.json", "w") as f:
            json.dump(
                {
                    "checksums": trainer.checksums(),
                    "losses": result.losses,
                    "recoveries": result.recoveries,
                },
                f,
            )


if __name__ == "__main__":
    main()
