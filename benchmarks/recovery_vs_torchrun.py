"""torchrun and NVIDIA's ft_launcher against chameleon run on the same plain DDP script,
in one run.

    python benchmarks/recovery_vs_torchrun.py [--workers 2] [--steps 150] [--kill-at 60] [--repeat 5]

ft_launcher (nvidia-resiliency-ext, `pip install -e .[bench]`) joins the baselines where it
is installed.
The script (benchmarks/ddp_checkpointed.py) trains a small MLP with DDP on gloo, saves a
checkpoint every 10 steps, resumes from it, and prints "STEP <n> <unix time>" per step.
For each launcher:
- without failures: time from launch to the first step (start-up), and the median time
  between steps after warm-up (steady state);
- with a kill -9 of rank 1 once step --kill-at is printed: time from the kill to the first
  step completed after recovery, steps redone (completed before the kill, then again),
  and whether the job reached its last step.
Each launcher's recovery is run --repeat times, interleaved, and the medians compared.
Targets: steady-state ratio chameleon/torchrun <= 1.02, start-up ratio <= 1.0 (issue 3);
kill -> first step after the restart, chameleon/ft_launcher <= 0.5 (issue 12: chameleon
restarts from a warm fork server that has torch imported, launcher/forkserver.py).
"""

from __future__ import annotations

import argparse
import os
import re
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
_PID_LINE = re.compile(r"\bPID (\d+) (\d+)\s*$")
SCRIPT = HERE / "ddp_checkpointed.py"


def launcher_cmd(name: str, workers: int) -> list[str]:
    flags = ["--nproc-per-node", str(workers), "--max-restarts", "3"]
    flags += ["--master-port", str(free_port())]
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *flags]
    if name == "ft_launcher":
        return [shutil.which("ft_launcher") or "ft_launcher", *flags]
    extra = ["--no-warm-start"] if name == "chameleon-cold" else []
    return [sys.executable, "-m", "chameleon_cli", "run", *flags, "--plain", *extra]


def launchers() -> list[str]:
    """torchrun, ft_launcher where installed, chameleon, and chameleon without its warm
    fork server (what the warm start buys)."""
    names = ["torchrun"]
    if shutil.which("ft_launcher"):
        names.append("ft_launcher")
    return [*names, "chameleon", "chameleon-cold"]


@dataclass
class Trial:
    launched_at: float
    steps: list[tuple[int, float]] = field(default_factory=list)  # (step, time) in print order
    killed_at: float | None = None
    kill_step: int | None = None
    exit_code: int | None = None
    timed_out: bool = False


def _rank_pid(root: int, rank: int) -> int | None:
    """Rank ``rank``'s worker among the launcher's descendants, by its environment: for a
    launcher whose console lost the worker's PID line (two ranks' output on one line).
    (A child of chameleon's fork server shows the server's environment: it prints.)"""
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
    # (the bench extra's pynvml makes torch warn at import in every worker, whichever
    # launcher: kept off the console, where chameleon would count it as a worker being up)
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), PYTHONWARNINGS="ignore::FutureWarning")
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
        pids: dict[int, int] = {}
        for line in proc.stdout:  # type: ignore[union-attr]
            said = _PID_LINE.search(line)  # every rank says who it is (ddp_checkpointed.py)
            if said:
                pids[int(said[1])] = int(said[2])
                continue
            parts = line.split("STEP ", 1)
            if len(parts) != 2:
                continue
            step, stamp = parts[1].split()
            t.steps.append((int(step), float(stamp)))
            if kill_at is not None and t.killed_at is None and int(step) >= kill_at:
                pid = pids.get(1) or _rank_pid(proc.pid, 1)
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


def recovery_s(t: Trial, steps: int) -> tuple[float | None, str]:
    """(kill -> first step completed after it, or None; a line describing the trial)."""
    if t.killed_at is None:
        return None, "could not kill rank 1"
    after = [(s, ts) for s, ts in t.steps if ts > t.killed_at]
    finished = t.exit_code == 0 and any(s == steps - 1 for s, _ts in t.steps)
    if not after:
        why = " (timed out)" if t.timed_out else ""
        return None, f"no step completed after the kill; exit {t.exit_code}{why}"
    first_step, first_time = after[0]
    redone = max(0, (t.kill_step or 0) - first_step + 1)
    took = first_time - t.killed_at
    return took, (
        f"{took:6.2f} s, steps redone {redone}, finished: {'yes' if finished else 'no'} "
        f"(exit {t.exit_code})"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--kill-at", type=int, default=60)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--skip-steady", action="store_true", help="recoveries only")
    args = parser.parse_args()
    names = launchers()
    med = statistics.median
    print(
        f"{args.workers} workers, {args.steps} steps, gloo on CPU; medians over {args.repeat} runs (range)"
    )
    if not args.skip_steady:
        startup: dict[str, list[float]] = {n: [] for n in names}
        steady: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(args.repeat):
            for name in names:  # interleaved, so drift hits every launcher alike
                t = trial(
                    name,
                    workers=args.workers,
                    steps=args.steps,
                    kill_at=None,
                    timeout_s=args.timeout,
                )
                if t.steps:
                    startup[name].append(t.steps[0][1] - t.launched_at)
                    steady[name].append(steady_step_s(t))
        print("without failures:")
        for name in names:
            if not startup[name]:
                print(f"  {name:14} no step completed")
                continue
            print(
                f"  {name:14} start-up to first step {med(startup[name]):6.2f} s ({min(startup[name]):.2f}-{max(startup[name]):.2f}); "
                f"steady step {med(steady[name]) * 1e3:6.2f} ms ({min(steady[name]) * 1e3:.2f}-{max(steady[name]) * 1e3:.2f})"
            )
        print(
            f"  ratio chameleon/torchrun: start-up {med(startup['chameleon']) / med(startup['torchrun']):.3f} (target <= 1.0), "
            f"steady step {med(steady['chameleon']) / med(steady['torchrun']):.3f} (target <= 1.02)"
        )
    print(f"with kill -9 of rank 1 at step {args.kill_at} (checkpoint every 10 steps):")
    took: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.repeat):
        for name in names:
            seconds, line = recovery_s(
                trial(
                    name,
                    workers=args.workers,
                    steps=args.steps,
                    kill_at=args.kill_at,
                    timeout_s=args.timeout,
                ),
                args.steps,
            )
            print(f"  run {i + 1} {name:14} kill -> first step after recovery {line}")
            if seconds is not None:
                took[name].append(seconds)
    print("kill -> first step after the restart, median (range):")
    for name in names:
        runs = took[name]
        text = (
            f"{med(runs):6.2f} s ({min(runs):.2f}-{max(runs):.2f}), {len(runs)} of {args.repeat} recovered"
            if runs
            else "never recovered"
        )
        print(f"  {name:14} {text}")
    for base in ("ft_launcher", "torchrun"):
        if took.get(base) and took["chameleon"]:
            ratio = med(took["chameleon"]) / med(took[base])
            print(
                f"  ratio chameleon/{base}: {ratio:.3f}"
                + (" (target <= 0.5)" if base == "ft_launcher" else "")
            )


if __name__ == "__main__":
    main()
