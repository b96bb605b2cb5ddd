"""A tiny MLP on chameleon_runtime for the liveness, bounded-state and multi-node tests:

    chameleon run --nproc-per-node 2 tests/runtime/mlp.py --steps 50 [--dump PREFIX]

Behaviour the tests need, from the environment (nothing of it is a product feature):
    MLP_STEP_SLEEP_S      every step sleeps this long first (a slow, healthy step)
    MLP_PASS_SPIN_S       every forward of layer 0 first computes for this much CPU time
                          (passes bound by their device: a worker slowed from outside
                          takes longer in its passes, its peers in their waits)
    MLP_STALL_RANK/STEP   that rank blocks forever before that step (a stalled worker)
    MLP_JOIN_SLEEP_S      a replacement (CHAMELEON_JOIN set) sleeps this long before
                          importing the runtime (a slow start-up)
    MLP_IN_ALLREDUCE      KIND:RANK:STEP: that rank sends itself SIGKILL (kill) or SIGSTOP
                          (hang) just after launching its first all-reduce of that step,
                          while its peers are in it (not a replacement of it)
    MLP_STEP_LOG          PREFIX: every step done, this process appends "pid step time" to
                          PREFIX.rank<R> (what a script writes as it trains: the
                          partition tests read when each side last wrote)
    MLP_HOLD              STEP:PATH: every rank waits before that step until PATH exists
                          (the test lets the job go on once what it waits for happened,
                          instead of betting on how many steps that takes)
    MLP_IN_COMMIT         RANK:STEP: that rank sends itself SIGKILL once it has passed its
                          commit decision of that step to its first child (delivered), so
                          that its other children never learn it
"""

import argparse
import json
import os
import signal
import time

if os.environ.get("CHAMELEON_JOIN") and os.environ.get("MLP_JOIN_SLEEP_S"):
    time.sleep(float(os.environ["MLP_JOIN_SLEEP_S"]))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import chameleon_runtime as cr  # noqa: E402

SLEEP_S = float(os.environ.get("MLP_STEP_SLEEP_S", "0"))
SPIN_S = float(os.environ.get("MLP_PASS_SPIN_S", "0"))
STALL = (int(os.environ.get("MLP_STALL_RANK", "-1")), int(os.environ.get("MLP_STALL_STEP", "-1")))
RANK = int(os.environ.get("RANK", "0"))
IN_ALLREDUCE = os.environ.get("MLP_IN_ALLREDUCE", "")
IN_COMMIT = os.environ.get("MLP_IN_COMMIT", "")
HOLD_STEP, _, HOLD_PATH = os.environ.get("MLP_HOLD", "-1:").partition(":")
SENT: list[int] = []  # bytes this worker sent, per step (StepInfo.sent_bytes)
STEP = [-1]  # the step running now (lr_at is called once per step, before it)


def fault_in_allreduce() -> None:
    """MLP_IN_ALLREDUCE (module doc): wrap the reducer's launch of a bucket."""
    kind, rank, step = IN_ALLREDUCE.split(":")
    if int(rank) != RANK or os.environ.get("CHAMELEON_JOIN"):
        return
    from chameleon_runtime.reducer import Reducer

    launch = Reducer._launch
    sig = signal.SIGKILL if kind == "kill" else signal.SIGSTOP

    def launch_then_fault(self, k, **kwargs):
        launch(self, k, **kwargs)
        if STEP[0] == int(step) and not kwargs.get("draining"):
            os.kill(os.getpid(), sig)

    Reducer._launch = launch_then_fault


def fault_in_commit() -> None:
    """MLP_IN_COMMIT (module doc): wrap the step ledger's sends."""
    rank, step = (int(x) for x in IN_COMMIT.split(":"))
    if rank != RANK or os.environ.get("CHAMELEON_JOIN"):
        return
    from chameleon_runtime.step import Ledger

    send = Ledger.send

    def send_then_fault(self, gen, tensor, peer, kind, index, **kwargs):
        send(self, gen, tensor, peer, kind, index, **kwargs)
        if kind == "D" and STEP[0] == step:
            gen.flush_sends()
            os.kill(os.getpid(), signal.SIGKILL)

    Ledger.send = send_then_fault


LR = 0.05


def make_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, generator=g), torch.randint(0, 4, (), generator=g)) for _ in range(256)]


class Spin(nn.Module):
    """MLP_PASS_SPIN_S (module doc): a pass's work on a device, as CPU time."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        until = time.thread_time() + SPIN_S
        while time.thread_time() < until:
            pass
        return x


def make_layer(i: int, num_layers: int) -> nn.Module:
    if i == num_layers - 1:
        return nn.Linear(8, 4)
    layer = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    return nn.Sequential(Spin(), *layer) if i == 0 and SPIN_S else layer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--stages", type=lambda v: v if v == "auto" else int(v), default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--dump", default=None)
    parser.add_argument("--max-grad-norm", type=float, default=None)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--init-loss-scale", type=float, default=2.0**16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--transport", default="gloo")
    parser.add_argument("--exact", action="store_true")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = make_data()

    def layer(i: int) -> nn.Module:
        return make_layer(i, args.layers)

    def lr_at(step: int) -> float:  # called once per step, before it: the test hooks
        STEP[0] = step
        if (RANK, step) == STALL:
            time.sleep(10**6)
        if step == int(HOLD_STEP):
            while not os.path.exists(HOLD_PATH):
                time.sleep(0.05)
        if SLEEP_S:
            time.sleep(SLEEP_S)
        return LR

    if IN_ALLREDUCE:
        fault_in_allreduce()
    if IN_COMMIT:
        fault_in_commit()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = cr.Trainer(
        layers=layer,
        num_layers=args.layers,
        loss_fn=F.cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=LR),
        dataset=data,
        global_batch_size=args.global_batch,
        micro_batch_size=2,
        pipeline_stages=args.stages if args.stages == "auto" or world % args.stages == 0 else 1,
        lr_schedule=lr_at,
        max_grad_norm=args.max_grad_norm,
        precision=args.precision,
        init_loss_scale=args.init_loss_scale,
        device=args.device,
        transport=args.transport,
        exact=args.exact,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
    )
    step_log = os.environ.get("MLP_STEP_LOG")

    def on_step(info) -> None:
        SENT.append(info.sent_bytes)
        if step_log:
            with open(f"{step_log}.rank{RANK}", "a") as f:
                f.write(f"{os.getpid()} {info.step} {time.time()}\n")

    result = trainer.fit(args.steps, on_step=on_step)
    if args.dump:
        with open(f"{args.dump}.rank{RANK}.json", "w") as f:
            dump = {"checksums": trainer.checksums(), "losses": result.losses, "sent": SENT}
            dump["preempted"] = result.preempted
            json.dump(dump | {"loss_scale": trainer.loss_scale}, f)


if __name__ == "__main__":
    main()
