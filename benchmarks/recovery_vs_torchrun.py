"""torchrun against chameleon run on the same plain DDP script, in one run.

    python benchmarks/recovery_vs_torchrun.py [--workers 4] [--steps 150] [--kill-at 60] [--repeat 2]

The script (benchmarks/ddp_checkpointed.py) trains a small MLP with DDP on gloo, saves a
checkpoint every 10 steps, resumes from it, and prints "STEP <n> <unix time>" per step.
For each launcher:
- without failures: time from launch to the first step (start-up), and the median time
  between steps after warm-up (steady state);
- with a kill -9 of rank 1 once step --kill-at is printed: time from the kill to the first
  step completed after recovery, steps redone (completed before the kill, then again),
  and whether the job reached its last step.
Targets (issue 3): steady-state ratio chameleon/torchrun <= 1.02, start-up ratio <= 1.0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from processes import free_port, kill_everything

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "ddp_checkpointed.py"


def launcher_cmd(name: str, workers: int) -> list[str]:
    flags = ["--nproc-per-node", str(workers), "--max-restarts", "3"]
    flags += ["--master-port", str(free_port())]
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *flags]
    return [sys.executable, "-m", "chameleon_cli.app", "run", *flags, "--plain"]


@dataclass
class Trial:
    launched_at: float
    steps: list[tuple[int, float]] = field(default_factory=list)  # (step, time) in print order
    killed_at: float | None = None
    kill_step: int | None = None
    exit_code: int | None = None
    timed_out: bool = False


def _rank_pid(root: int, rank: int) -> int | None:
    for child in psutil.Process(root).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "ddp_checkpointed" in " ".join(
                child.cmdline()
            ):
                return child.pid
        except psutil.Error:
            continue
    return None


def trial(name: str, *, workers: int, steps: int, kill_at: int | None, timeout_s: float) -> Trial:
    work = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    t = Trial(launched_at=time.time())
    proc = subprocess.Popen(
        [*launcher_cmd(name, workers), str(SCRIPT), str(steps)],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    timer = threading.Timer(timeout_s, kill_everything, args=(proc, work))
    timer.start()
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            parts = line.split("STEP ", 1)
            if len(parts) != 2:
                continue
            step, stamp = parts[1].split()
            t.steps.append((int(step), float(stamp)))
            if kill_at is not None and t.killed_at is None and int(step) >= kill_at:
                pid = _rank_pid(proc.pid, 1)
                if pid is not None:
                    t.killed_at = time.time()
                    t.kill_step = int(step)
                    os.kill(pid, signal.SIGKILL)
        t.exit_code = proc.wait()
    finally:
        t.timed_out = not timer.is_alive()
        timer.cancel()
        kill_everything(proc, work)
        shutil.rmtree(work, ignore_errors=True)
    return t


def steady_step_s(t: Trial, warmup: int = 20) -> float:
    times = [s for _step, s in t.steps[warmup:]]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def report_recovery(name: str, t: Trial, steps: int) -> None:
    after = [(s, ts) for s, ts in t.steps if t.killed_at is not None and ts > t.killed_at]
    finished = t.exit_code == 0 and any(s == steps - 1 for s, _ts in t.steps)
    if t.killed_at is None:
        print(f"  {name:10} could not kill rank 1")
        return
    if not after:
        print(
            f"  {name:10} no step completed after the kill; exit {t.exit_code}{' (timed out)' if t.timed_out else ''}; finished: no"
        )
        return
    first_step, first_time = after[0]
    redone = max(0, (t.kill_step or 0) - first_step + 1)
    print(
        f"  {name:10} kill -> first step after recovery {first_time - t.killed_at:6.2f} s; steps redone {redone}; "
        f"finished: {'yes' if finished else 'no'} (exit {t.exit_code})"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--kill-at", type=int, default=60)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    print(
        f"{args.workers} workers, {args.steps} steps, gloo on CPU; median over {args.repeat} runs (range)"
    )
    startup: dict[str, list[float]] = {"torchrun": [], "chameleon": []}
    steady: dict[str, list[float]] = {"torchrun": [], "chameleon": []}
    for _ in range(args.repeat):
        for name in ("torchrun", "chameleon"):  # interleaved, so drift hits both
            t = trial(
                name, workers=args.workers, steps=args.steps, kill_at=None, timeout_s=args.timeout
            )
            if t.steps:
                startup[name].append(t.steps[0][1] - t.launched_at)
                steady[name].append(steady_step_s(t))
    med = statistics.median
    print("without failures:")
    for name in ("torchrun", "chameleon"):
        print(
            f"  {name:10} start-up to first step {med(startup[name]):6.2f} s ({min(startup[name]):.2f}-{max(startup[name]):.2f}); "
            f"steady step {med(steady[name]) * 1e3:6.2f} ms ({min(steady[name]) * 1e3:.2f}-{max(steady[name]) * 1e3:.2f})"
        )
    print(
        f"  ratio chameleon/torchrun: start-up {med(startup['chameleon']) / med(startup['torchrun']):.3f} (target <= 1.0), "
        f"steady step {med(steady['chameleon']) / med(steady['torchrun']):.3f} (target <= 1.02)"
    )
    print(f"with kill -9 of rank 1 at step {args.kill_at} (checkpoint every 10 steps):")
    for name in ("torchrun", "chameleon"):
        report_recovery(
            name,
            trial(
                name,
                workers=args.workers,
                steps=args.steps,
                kill_at=args.kill_at,
                timeout_s=args.timeout,
            ),
            args.steps,
        )


if __name__ == "__main__":
    main()
