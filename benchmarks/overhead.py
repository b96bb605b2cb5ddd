"""The failure-free step: chameleon_runtime.Trainer against plain PyTorch, in one run.

    python benchmarks/overhead.py [--rounds 3] [--steps 12] [--hidden 64,256] [--rows ...]

The example tiny GPT (examples/train_gpt.py: 4 blocks, sequence 64, global batch 32,
micro-batch 2, AdamW, one thread per worker) in each layout, trained failure-free by the
Trainer under ``chameleon run`` and by the PyTorch a user would otherwise write, under
``torchrun``, with the same layers (built by the same seeded factory), the same samples of
every step, the same micro-batches, optimizer and threads:

| row       | workers | the plain PyTorch baseline                                       |
|-----------|---------|------------------------------------------------------------------|
| 1 worker  | 1       | a plain loop, gradients accumulated over the micro-batches       |
| dp 2, 4   | 2, 4    | DistributedDataParallel, ``no_sync`` over all but the last one   |
| pp 2, 4   | 2, 4    | ``torch.distributed.pipelining``, ``Schedule1F1B``               |
| 2 x 2     | 4       | two 1F1B pipelines of 2 stages, each stage under DDP across them |

each at hidden 64 and 256. Every row runs ``--rounds`` times, the baseline and ours
alternating which goes first, so the machine's drift falls on both sides alike. Each run
measures its steps after ``--warmup`` (5): the step time is the time between one step's
end and the next's on rank 0, everything a step costs included (the Trainer's status,
checks and store traffic as much as its passes); a row's figure is the median over all
its measured steps (``--steps`` a run, at least 20 over the rounds).

- peak memory: the largest worker's peak private (anonymous) resident memory over its
  measured steps, above what it held before its model was built (after the same imports
  on both sides: what chameleon run's warm fork server preloads): the kernel's peak
  resident set (VmHWM, reset after the warm-up) less the file-backed and shared pages at
  the end (RssFile, RssShmem: stable once every kernel has run). Code pages of torch's
  libraries that a process has touched count in its resident set but are shared by every
  process and evictable; counted, the runtime's own code paths (the store, gloo's groups,
  the probe) made up two thirds of a 1-worker run's growth (30 of 41 MB) and no tensor.
  What the runtime holds beyond the model and the step (its threads, store connections,
  Python objects) counts: it is memory the user pays;
- bytes sent: what each worker wrote to sockets and files per step (``wchar`` of
  /proc/self/io, gloo's traffic included), the mean over workers of their medians, and
  beside it what the runtime counts it sent (``StepInfo.sent_bytes``); on the data
  parallel rows they are printed beside a ring all-reduce's bytes for the model's
  gradients in their dtype, 2 (n - 1) / n of them.

The goal is 1.05 on every row. The benchmark exits non-zero when a row's step ratio is
over 1.10 or its peak memory ratio over 1.10, and prints the spread between rounds
((max - min) / median of the per-round medians) beside each figure. docs/benchmarks.md
has its table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

STEP_BAR = 1.10
MEMORY_BAR = 1.10
GOAL = 1.05
SEQ_LEN = 64
GLOBAL_BATCH = 32
MICRO_BATCH = 2
BLOCKS = 4
HEADS = 4
LR = 3e-3


@dataclass(frozen=True)
class Row:
    name: str
    workers: int
    stages: int

    @property
    def dp(self) -> int:
        return self.workers // self.stages


ROWS = {
    "1": Row("1 worker", 1, 1),
    "dp2": Row("dp 2", 2, 1),
    "dp4": Row("dp 4", 4, 1),
    "pp2": Row("pp 2", 2, 2),
    "pp4": Row("pp 4", 4, 4),
    "2x2": Row("2 x 2", 4, 2),
}


# -- in a worker -------------------------------------------------------------------------


def _proc(path: str, field: str) -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise KeyError(field)


def _hwm_bytes() -> int:
    return _proc("/proc/self/status", "VmHWM:") * 1024


def _anon_bytes() -> int:
    return _proc("/proc/self/status", "RssAnon:") * 1024


def _anon_peak_bytes() -> int:
    """The peak anonymous resident set since the high-water mark was reset (module doc)."""
    status = "/proc/self/status"
    shared = (_proc(status, "RssFile:") + _proc(status, "RssShmem:")) * 1024
    return _hwm_bytes() - shared


def _written_bytes() -> int:
    return _proc("/proc/self/io", "wchar:")


def _preload() -> None:
    """What chameleon run's warm fork server imported before forking our workers
    (launcher.forkserver.PRELOAD: torch._dynamo, which the optimizers and DDP import
    lazily, is tens of megabytes): imported on both sides before the memory baseline, so
    that neither side's peak counts imports."""
    import importlib

    from launcher.forkserver import PRELOAD

    for name in PRELOAD:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


class Recorder:
    """Per step: the time since the previous step ended, and the bytes written since;
    the peak resident set of the steps after the warm-up."""

    def __init__(self, warmup: int) -> None:
        # After the imports and the process group: what the model and training add.
        self.anon_before = _anon_bytes()
        self.warmup = warmup
        self.intervals: list[float] = []
        self.written: list[int] = []
        self.counted: list[int] = []  # what the runtime itself counts it sent (ours)
        self.losses: list[float] = []
        self._t = time.perf_counter()
        self._w = _written_bytes()

    def step(self, loss: float, counted: int | None = None) -> None:
        t, w = time.perf_counter(), _written_bytes()
        self.intervals.append(t - self._t)
        self.written.append(w - self._w)
        if counted is not None:
            self.counted.append(counted)
        self.losses.append(loss)
        if len(self.losses) == self.warmup:
            # The high-water mark from here on: the steady steps' peak (Linux >= 4.0).
            Path("/proc/self/clear_refs").write_text("5")
        self._t, self._w = t, w

    def dump(self, out: str, extra: dict) -> None:
        rank = int(os.environ.get("RANK", "0"))
        record = {
            "intervals": self.intervals,
            "written": self.written,
            "counted": self.counted,
            "losses": self.losses,
            "peak_bytes": _anon_peak_bytes() - self.anon_before,
            **extra,
        }
        Path(f"{out}.rank{rank}.json").write_text(json.dumps(record))


def _model(hidden: int):
    """(layer factory, number of layers, loss, dataset, gradient parameters of the whole
    model): examples/train_gpt.py's."""
    import torch
    from torch.nn import functional as F
    from train_gpt import Block, CharDataset, Embedding, Head, corpus

    data = CharDataset(corpus(), SEQ_LEN)
    vocab = len(data.vocab)
    num_layers = BLOCKS + 2

    def layer(i: int) -> torch.nn.Module:
        if i == 0:
            return Embedding(vocab, hidden, SEQ_LEN)
        if i == num_layers - 1:
            return Head(hidden, vocab)
        return Block(hidden, HEADS)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))

    return layer, num_layers, loss_fn, data


def _adamw(params):
    import torch

    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def worker_ours(args: argparse.Namespace) -> None:
    import torch

    import chameleon_runtime as cr

    torch.set_num_threads(1)
    layer, num_layers, loss_fn, data = _model(int(args.hidden))
    _preload()
    recorder = Recorder(args.warmup)
    trainer = cr.Trainer(
        layers=layer,
        num_layers=num_layers,
        loss_fn=loss_fn,
        optimizer=_adamw,
        dataset=data,
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=MICRO_BATCH,
        pipeline_stages=args.stages,
    )
    trainer.fit(
        args.steps,
        on_step=lambda info: recorder.step(info.loss, getattr(info, "sent_bytes", None)),
    )
    recorder.dump(args.out, {"global_loss": True})


def _batch(data, step: int, first_mb: int, num_mb: int):
    """Micro-batches first_mb .. first_mb + num_mb - 1 of ``step``, as one tensor pair:
    the Trainer's samples (chameleon_runtime.data: by global sample index)."""
    import torch

    start = step * GLOBAL_BATCH + first_mb * MICRO_BATCH
    idx = [(start + j) % len(data) for j in range(num_mb * MICRO_BATCH)]
    samples = [data[i] for i in idx]
    return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])


def worker_plain(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from chameleon_runtime.shard import build_layer
    from planner.plans.partition import balanced_split

    torch.set_num_threads(1)
    layer, num_layers, loss_fn, data = _model(int(args.hidden))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    stages = args.stages
    dp = world // stages
    num_mb = GLOBAL_BATCH // MICRO_BATCH
    mine = num_mb // dp  # this replica's micro-batches, as the Trainer splits them
    replica, stage = divmod(rank, stages)
    if world > 1:
        dist.init_process_group("gloo")
    if stages > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    _preload()
    recorder = Recorder(args.warmup)
    # The Trainer's layers: the same seeded factory, split by parameter count.
    params = [
        sum(p.numel() for p in build_layer(layer, 0, i).parameters()) for i in range(num_layers)
    ]
    bounds = balanced_split([max(1, n) for n in params], stages)
    first, end = bounds[stage], bounds[stage + 1]
    module = nn.Sequential(*(build_layer(layer, 0, i) for i in range(first, end)))
    if dp > 1:
        replicas = [dist.new_group([r * stages + s for r in range(dp)]) for s in range(stages)]
        module = nn.parallel.DistributedDataParallel(module, process_group=replicas[stage])
    optimizer = _adamw(module.parameters())
    schedule = None
    if stages > 1:
        pipelines = [dist.new_group(list(range(r * stages, (r + 1) * stages))) for r in range(dp)]
        pipe = PipelineStage(module, stage, stages, torch.device("cpu"), group=pipelines[replica])
        schedule = Schedule1F1B(pipe, mine, loss_fn=loss_fn)
    for step in range(args.steps):
        x, y = _batch(data, step, replica * mine, mine)
        loss_value = 0.0
        if schedule is not None:
            losses: list = []
            if stage == 0:
                schedule.step(x)
            elif stage == stages - 1:
                schedule.step(target=y, losses=losses)
                loss_value = float(sum(t.item() for t in losses)) / mine
            else:
                schedule.step()
        else:
            for k in range(mine):
                xs, ys = (
                    x[k * MICRO_BATCH : (k + 1) * MICRO_BATCH],
                    y[k * MICRO_BATCH : (k + 1) * MICRO_BATCH],
                )
                sync = k == mine - 1 or dp == 1
                with contextlib.nullcontext() if sync else module.no_sync():
                    loss = loss_fn(module(xs), ys) / mine
                    loss.backward()
                loss_value += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        recorder.step(loss_value)
    # This rank's loss is its replica's share of the step's (a last stage's, or a data
    # parallel replica's): the step's loss is their mean.
    recorder.dump(args.out, {"global_loss": False, "reports_loss": stage == stages - 1})
    # Not destroy_process_group: after pipelining's point-to-point traffic under DDP it
    # hung at exit once in a few dozen runs (torch 2.13). Everything is written.
    sys.stdout.flush()
    os._exit(0)


# -- the orchestrator --------------------------------------------------------------------


def _launch(
    side: str, row: Row, hidden: int, steps: int, warmup: int, out: Path, work: Path
) -> None:
    script = [
        str(Path(__file__).resolve()), "--worker", side, "--hidden", str(hidden),
        "--stages", str(row.stages), "--steps", str(steps + warmup), "--warmup", str(warmup),
        "--out", str(out),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CHAMELEON_JOB_TOKEN", None)
    if side == "ours":
        cmd = [
            sys.executable, "-m", "chameleon_cli", "run", "--standalone",
            "--nproc-per-node", str(row.workers), "--log-dir", str(work / "logs"), *script,
        ]  # fmt: skip
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(row.workers), *script,
        ]  # fmt: skip
    result = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(
            f"overhead.py: {side} {row.name} hidden {hidden} failed ({result.returncode}):\n"
            + result.stderr[-3000:]
        )


@dataclass
class Measured:
    intervals: list[float]  # rank 0's, measured steps only
    written: list[float]  # per worker: median bytes a step
    counted: list[float]  # per worker: median bytes a step the runtime counted (ours)
    peak_bytes: int  # the largest worker's
    final_loss: float


def _collect(out: Path, workers: int, warmup: int) -> Measured:
    records = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(workers)]
    if records[0]["global_loss"]:
        final_loss = records[0]["losses"][-1]
    else:
        final_loss = statistics.mean(r["losses"][-1] for r in records if r["reports_loss"])
    return Measured(
        intervals=records[0]["intervals"][warmup:],
        written=[statistics.median(r["written"][warmup:]) for r in records],
        counted=[statistics.median(r["counted"][warmup:]) for r in records if r.get("counted")],
        peak_bytes=max(r["peak_bytes"] for r in records),
        final_loss=final_loss,
    )


def _gradient_bytes(hidden: int) -> int:
    import torch

    layer, num_layers, _loss, _data = _model(hidden)
    with torch.device("meta"):
        params = sum(p.numel() for i in range(num_layers) for p in layer(i).parameters())
    return params * 4  # fp32 gradients


def _spread(per_round: list[float]) -> float:
    return (max(per_round) - min(per_round)) / statistics.median(per_round)


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--hidden", default="64,256")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    parser.add_argument("--json", default=None, help="also write the table here")
    # a worker's side of one run
    parser.add_argument("--worker", choices=("ours", "plain"), default=None)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.worker == "ours":
        worker_ours(args)
        return 0
    if args.worker == "plain":
        worker_plain(args)
        return 0

    hiddens = [int(h) for h in args.hidden.split(",")]
    rows = [ROWS[r] for r in args.rows.split(",")]
    if args.rounds * args.steps < 20:
        print("overhead.py: fewer than 20 measured steps per row; raise --rounds or --steps")
    results: dict[tuple[str, int, str], list[Measured]] = {}
    with tempfile.TemporaryDirectory(prefix="chameleon-overhead-") as tmp:
        work = Path(tmp)
        for k in range(args.rounds):
            for hidden in hiddens:
                for row in rows:
                    sides = ("plain", "ours") if k % 2 == 0 else ("ours", "plain")
                    for side in sides:
                        out = work / f"{side}-{row.workers}x{row.stages}-{hidden}-{k}"
                        t0 = time.perf_counter()
                        _launch(side, row, hidden, args.steps, args.warmup, out, work)
                        m = _collect(out, row.workers, args.warmup)
                        results.setdefault((row.name, hidden, side), []).append(m)
                        print(
                            f"round {k + 1}/{args.rounds}  {row.name:8s} hidden {hidden:3d}  "
                            f"{side:5s}  {statistics.median(m.intervals) * 1e3:7.1f} ms  "
                            f"({time.perf_counter() - t0:.0f} s)",
                            file=sys.stderr,
                            flush=True,
                        )
    table = []
    failed = []
    header = (
        f"{'row':8s} {'hidden':>6s} | {'plain ms':>9s} {'ours ms':>9s} {'ratio':>6s} "
        f"{'spread p/o':>11s} | {'plain mem':>10s} {'ours mem':>10s} {'ratio':>6s} | "
        f"{'plain sent':>10s} {'ours sent':>10s} {'counted':>10s} {'ring':>10s} {'ours/ring':>9s}"
        " | loss p/o"
    )
    print(header)
    print("-" * len(header))
    for hidden in hiddens:
        ring_total = _gradient_bytes(hidden)
        for row in rows:
            plain = results[(row.name, hidden, "plain")]
            ours = results[(row.name, hidden, "ours")]
            p_ms = statistics.median(t for m in plain for t in m.intervals) * 1e3
            o_ms = statistics.median(t for m in ours for t in m.intervals) * 1e3
            p_spread = _spread([statistics.median(m.intervals) for m in plain])
            o_spread = _spread([statistics.median(m.intervals) for m in ours])
            p_mem = statistics.median(m.peak_bytes for m in plain)
            o_mem = statistics.median(m.peak_bytes for m in ours)
            p_sent = statistics.median(statistics.mean(m.written) for m in plain)
            o_sent = statistics.median(statistics.mean(m.written) for m in ours)
            counts = [statistics.mean(m.counted) for m in ours if m.counted]
            o_counted = statistics.median(counts) if counts else None
            ring = 2 * (row.dp - 1) / row.dp * ring_total if row.stages == 1 else None
            step_ratio, mem_ratio = o_ms / p_ms, o_mem / max(p_mem, 1)
            ring_text = _fmt_bytes(ring) if ring else "-"
            ring_ratio = f"{o_sent / ring:.3f}" if ring else "-"
            print(
                f"{row.name:8s} {hidden:6d} | {p_ms:9.1f} {o_ms:9.1f} {step_ratio:6.3f} "
                f"{p_spread:5.0%}/{o_spread:<5.0%} | {_fmt_bytes(p_mem):>10s} "
                f"{_fmt_bytes(o_mem):>10s} {mem_ratio:6.3f} | {_fmt_bytes(p_sent):>10s} "
                f"{_fmt_bytes(o_sent):>10s} "
                f"{_fmt_bytes(o_counted) if o_counted is not None else '-':>10s} "
                f"{ring_text:>10s} {ring_ratio:>9s} | "
                f"{plain[-1].final_loss:.4f}/{ours[-1].final_loss:.4f}"
            )
            table.append(
                {
                    "row": row.name,
                    "hidden": hidden,
                    "plain_ms": p_ms,
                    "ours_ms": o_ms,
                    "step_ratio": step_ratio,
                    "plain_spread": p_spread,
                    "ours_spread": o_spread,
                    "plain_peak_bytes": p_mem,
                    "ours_peak_bytes": o_mem,
                    "memory_ratio": mem_ratio,
                    "plain_sent_bytes": p_sent,
                    "ours_sent_bytes": o_sent,
                    "ours_counted_bytes": o_counted,
                    "ring_bytes": ring,
                }  # fmt: skip
            )
            if step_ratio > STEP_BAR or mem_ratio > MEMORY_BAR:
                failed.append(f"{row.name} hidden {hidden}")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    worst = max(table, key=lambda r: r["step_ratio"])
    print(
        f"\nworst step ratio {worst['step_ratio']:.3f} ({worst['row']}, hidden {worst['hidden']}); "
        f"goal {GOAL}, bar {STEP_BAR} (step) and {MEMORY_BAR} (peak memory)"
    )
    if failed:
        print(f"over the bar: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
