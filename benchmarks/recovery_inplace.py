"""In-place recovery on the CPU test bed against torchrun's restart, in one run.

    python benchmarks/recovery_inplace.py [--steps 60] [--kill-at 20] [--repeat 1]

The example tiny GPT (examples/train_gpt.py) on 8 workers (2 pipelines of 4 stages), with
checkpoints every 10 steps. Rank 5 gets kill -9 once the chief prints step --kill-at, and
the benchmark times, from the kill, the first step line printed after recovery:

- chameleon run --policy reroute, and --policy reparallelize (recovery in place);
- torchrun --max-restarts 1 (restart every worker, resume from the checkpoint).

Targets (issue 4): recovery under 2 s and under a tenth of torchrun's, zero steps redone.
Then post-recovery throughput against failure-free (median step time over the steps
before the kill and after recovery) beside the planner's prediction for the chosen plan
(from the "plan_chosen" event: its calibrated estimate against the failure-free one);
they should agree within 15%.
"""

from __future__ import annotations

import argparse
import json
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

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_gpt.py"
STEP_LINE = re.compile(r"step\s+(\d+)\s+loss\s+([0-9.]+)\s+([0-9.]+) ms\s+gen (\d+)")


@dataclass
class Run:
    name: str
    steps: list[tuple[float, int, float, int]] = field(
        default_factory=list
    )  # (seen at, step, ms, gen)
    killed_at: float | None = None
    kill_step: int | None = None
    exit_code: int | None = None
    events: list[dict] = field(default_factory=list)


def _rank_pid(root: int, rank: int) -> int | None:
    for child in psutil.Process(root).children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
            if (
                "train_gpt.py" in cmd
                and child.environ().get("RANK") == str(rank)
                and "run" not in child.cmdline()[1:3]
            ):
                return child.pid
        except psutil.Error:
            continue
    return None


def run_once(
    name: str, cmd: list[str], *, kill_at: int, timeout_s: float, events: Path | None
) -> Run:
    work = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    result = Run(name)
    proc = subprocess.Popen(
        cmd + [str(EXAMPLE), "--steps", str(ARGS.steps), "--checkpoint-dir", str(work / "ckpt")],
        cwd=work, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )  # fmt: skip
    timer = threading.Timer(timeout_s, kill_everything, args=(proc, work))
    timer.start()
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            match = STEP_LINE.search(line)
            if not match:
                continue
            now = time.time()
            step, ms, gen = int(match.group(1)), float(match.group(3)), int(match.group(4))
            result.steps.append((now, step, ms, gen))
            if result.killed_at is None and step >= kill_at:
                pid = _rank_pid(proc.pid, 5)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    result.killed_at, result.kill_step = time.time(), step
        result.exit_code = proc.wait()
    finally:
        timer.cancel()
        kill_everything(proc, work)
        if events is not None and events.exists():
            result.events = [json.loads(x) for x in events.read_text().splitlines() if x.strip()]
        shutil.rmtree(work, ignore_errors=True)
    return result


def chameleon(policy: str, events: Path) -> list[str]:
    # No replacement: on 2 shared cores its start-up (importing torch) would slow the very
    # steps whose throughput is measured against the prediction for the chosen plan.
    return [sys.executable, "-m", "chameleon_cli", "run", "--nproc-per-node", "8", "--master-port", str(free_port()),
            "--policy", policy, "--max-restarts", "1", "--max-rejoins", "0", "--events", str(events), "--plain"]  # fmt: skip


def torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "8", "--max-restarts", "1",
            "--master-port", str(free_port())]  # fmt: skip


def report(r: Run) -> dict:
    after = [s for s in r.steps if r.killed_at is not None and s[0] > r.killed_at]
    if r.killed_at is None or not after:
        print(f"  {r.name:14} no step after the kill (exit {r.exit_code})")
        return {}
    recovery_s = after[0][0] - r.killed_at
    redone = max(0, (r.kill_step or 0) - after[0][1] + 1)
    finished = r.exit_code == 0 and any(s[1] == ARGS.steps - 1 for s in r.steps)
    before_ms = [ms for _t, step, ms, _g in r.steps if 3 <= step < (r.kill_step or 0)]
    after_ms = [ms for _t, _step, ms, _g in after[2:]]
    measured = (
        statistics.median(before_ms) / statistics.median(after_ms)
        if before_ms and after_ms
        else None
    )
    chosen = next((e for e in r.events if e["event"] == "plan_chosen"), None)
    predicted = None
    if chosen and chosen.get("estimated_step_s") and chosen.get("failure_free_step_s"):
        predicted = chosen["failure_free_step_s"] / chosen["estimated_step_s"]
    line = f"  {r.name:14} kill -> first step {recovery_s:6.2f} s; steps redone {redone}; finished {'yes' if finished else 'no'}"
    if measured is not None:
        line += f"; throughput vs failure-free: measured {measured:.3f}"
        if predicted is not None:
            line += (
                f", predicted {predicted:.3f} ({abs(predicted - measured) / measured:.1%} apart)"
            )
    print(line)
    done = next((e for e in r.events if e["event"] == "recovered"), None)
    if chosen and done and "transition_parts_s" in chosen:
        parts = chosen["transition_parts_s"]
        print(
            f"  {'':14} transition parts, predicted / measured: groups "
            f"{parts['groups'] * 1e3:.0f} / {done.get('groups_s', 0) * 1e3:.0f} ms "
            f"(carried over: {done.get('groups_carried')}), migration "
            f"{parts['migration'] * 1e3:.0f} / {done.get('migration_s', 0) * 1e3:.0f} ms, "
            f"search {parts['search'] * 1e3:.1f} ms; recovery phases {done.get('phases_s')}"
        )
    return {
        "recovery_s": recovery_s,
        "redone": redone,
        "measured": measured,
        "predicted": predicted,
    }


def main() -> None:
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-at", type=int, default=25)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300)
    ARGS = parser.parse_args()
    print(
        f"8 workers (2 pipelines x 4 stages), tiny GPT, {ARGS.steps} steps, kill -9 rank 5 at step {ARGS.kill_at}"
    )
    results: dict[str, list[dict]] = {}
    for _ in range(ARGS.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            for policy in ("reroute", "reparallelize"):
                events = Path(tmp) / f"{policy}.jsonl"
                r = run_once(
                    f"chameleon {policy[:7]}",
                    chameleon(policy, events),
                    kill_at=ARGS.kill_at,
                    timeout_s=ARGS.timeout,
                    events=events,
                )
                results.setdefault(policy, []).append(report(r))
            r = run_once(
                "torchrun", torchrun(), kill_at=ARGS.kill_at, timeout_s=ARGS.timeout, events=None
            )
            results.setdefault("torchrun", []).append(report(r))
    base = [x["recovery_s"] for x in results["torchrun"] if x]
    for policy in ("reroute", "reparallelize"):
        mine = [x["recovery_s"] for x in results[policy] if x]
        if mine and base:
            print(
                f"  {policy}: recovery {statistics.median(mine):.2f} s (target < 2 s), "
                f"{statistics.median(mine) / statistics.median(base):.3f} of torchrun's (target < 0.1)"
            )


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
