"""A slow worker planned around, against waiting for it, in one run.

    python benchmarks/stragglers.py [--slow-for 8] [--factors 2,3] [--jobs dropin,trainer]
        [--repeat 1]

The same job on 2 workers (2 cores: a core each, as devices), rank 1 slowed from outside
its process (``--inject-fault slow``: stopped for ``factor - 1`` times the CPU it runs) by each
factor from step 30 for ``--slow-for`` seconds, with ``--stragglers off`` (every step
waits for it) and on (an uneven deal while it pays), beside the run without a slowdown:

- dropin: examples/train_hf.py (the drop-in API, a Hugging Face GPT-2), 8 micro-batches;
- trainer: examples/train_gpt.py --pipeline-stages 1 (the Trainer), 8 micro-batches.

For each it prints steps per second while slowed (from the move to the slowdown's end
when mitigated; the same stretch from the fault when not) against the run without a
slowdown, and against the optimum the planner predicts for the deal it chose, two ways:

- pred.: its estimate of that plan against its estimate of the even plan without the
  slowdown, times the failure-free rate (the same run's on the even deal once it moved
  back, at least 2 s of it, else the run without a slowdown), which the targets judge:
  what the slowdown costs by the model, on this run's own speed;
- est.: its estimate of that deal's step alone, made when it chose it (the cost model as
  fitted to the job's steps before the slowdown: it is not refitted while a straggler is
  found), printed, not judged: it carries the fit's own error, which is not the
  straggler's (the drop-in's even step estimated at 92 ms and run at 100-105 ms in one
  run), and the fit is from seconds before the slowdown, as pred.'s rate is from seconds
  after it, on a host whose rate drifts by more than the 15% from one stretch of seconds
  to the next (the Trainer without a slowdown: 40-58 ms a step, second by second);

the steps from the slowdown to the move, and from its end to the move back. Where a deal
was dealt again (made on an early factor: the pace median still mixed steps from before
the slowdown), the prediction is the last deal's, checked against the rate on that deal
alone (at least 2 s of it), while "on" still counts every step since the first move.

Targets (issue 38): mitigated within 15% of the predicted optimum (pred.; either way: a
rate well above it is a model that is wrong too), at least 1.3x the unmitigated throughput at
3x, the move within 20 steps of the slowdown, back within 20 steps of its end; judged on
the means over ``--repeat`` runs (each run's figures are printed too), since one run on a
shared 2-core host swings by more than the 15%.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from processes import kill_everything

ROOT = Path(__file__).resolve().parent.parent
STEP_LINE = re.compile(r"\bstep\s+(\d+)\s+loss")
SLOW_FROM_STEP = 30

JOBS = {
    "dropin": [
        str(ROOT / "examples" / "train_hf.py"), "--global-batch", "64", "--micro-batch", "8",
    ],
    "trainer": [
        str(ROOT / "examples" / "train_gpt.py"), "--pipeline-stages", "1",
        "--global-batch", "16", "--micro-batch", "2", "--checkpoint-every", "0",
    ],
}  # fmt: skip


@dataclass
class Run:
    name: str
    steps: list[tuple[float, int]] = field(default_factory=list)  # (seen at, step)
    events: list[dict] = field(default_factory=list)
    exit_code: int | None = None

    def step_at(self, t: float) -> int:
        return max((s for when, s in self.steps if when <= t), default=0)

    def rate(self, t0: float, t1: float) -> float | None:
        """Steps per second between ``t0`` and ``t1`` (by the step lines seen)."""
        inside = [(when, s) for when, s in self.steps if t0 <= when <= t1]
        if len(inside) < 3:
            return None
        (a, sa), (b, sb) = inside[0], inside[-1]
        return (sb - sa) / (b - a) if b > a else None

    def event(self, name: str, **match: object) -> dict | None:
        return next(
            (
                e
                for e in self.events
                if e["event"] == name and all(e.get(k) == v for k, v in match.items())
            ),
            None,
        )


def run(name: str, job: str, steps: int, work: Path, *launch: str) -> Run:
    out = Run(name)
    events = work / f"{name}.jsonl"
    cmd = [
        sys.executable, "-m", "chameleon_cli", "run", "--standalone",
        "--nproc-per-node", "2", "--events", str(events), *launch,
        *JOBS[job], "--steps", str(steps),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **_env()},
        start_new_session=True,
    )  # fmt: skip

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if "[rank 0]" in line or "[rank0]" in line:
                m = STEP_LINE.search(line)
                if m:
                    out.steps.append((time.time(), int(m.group(1))))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        out.exit_code = proc.wait(timeout=600)
    finally:
        kill_everything(proc, work)
        reader.join(timeout=5)
    if events.exists():
        out.events = [json.loads(x) for x in events.read_text().splitlines() if x.strip()]
    return out


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def measure(job: str, factors: list[float], slow_for: float, work: Path) -> list[dict]:
    # (enough for 2 s or more on the even deal after the move back, the prediction's
    # baseline: the Trainer's 300 steps left it 1.7 s at 3x)
    steps = 400 if job == "dropin" else 450
    free = run(f"{job}-free", job, steps, work)
    assert free.exit_code == 0, f"{job}: the failure-free run exited {free.exit_code}"
    t_first = free.steps[0][0] if free.steps else 0.0
    free_rate = free.rate(t_first + 3.0, free.steps[-1][0]) if free.steps else None
    rows = []
    for factor in factors:
        fault = f"slow:rank=1,factor={factor:g},step={SLOW_FROM_STEP},for={slow_for:g}"
        row: dict = {"job": job, "factor": factor, "free_steps_per_s": free_rate}
        for mode in ("off", "on"):
            r = run(f"{job}-{factor:g}x-{mode}", job, steps, work, "--stragglers", mode,
                    "--inject-fault", fault)  # fmt: skip
            began, ended = r.event("fault_injected"), r.event("slowdown_ended")
            if r.exit_code != 0 or began is None or ended is None:
                row[mode] = {"error": f"exit {r.exit_code}, slowdown seen: {began is not None}"}
                continue
            moves = [e for e in r.events if e["event"] == "plan_chosen" and "slow" in e]
            there = next((e for e in moves if e["slow"]), None)
            # (the move back after the slowdown's end: an even deal mid-slowdown is a flap)
            back = next(
                (e for e in moves if e["slow"] == {} and there and e["t"] >= ended["t"]), None
            )
            start = (there["t"] if there else began["t"] + 2.0) + 0.5
            rate = r.rate(start, ended["t"])
            cell = {"steps_per_s": rate, "moved": there is not None}
            if there is not None:
                # The deal the slowdown ran on longest: the last before it ended (a deal
                # made on an early factor is dealt again once the factor settles).
                dealt = [e for e in moves if e["slow"] and e["t"] <= ended["t"]] or [there]
                last = dealt[-1]
                options = last.get("options", {})
                uneven = options.get("uneven deal", {}).get("step_s")
                even = last.get("failure_free_step_s")
                # The failure-free rate the optimum is scaled from: this run's own on the
                # even deal again after the slowdown (the same processes, a minute apart
                # at most), else the run without one. The runs are minutes apart, and this
                # host's speed drifts by up to a fifth between them (the Trainer: 36.5
                # steps/s free in one benchmark, 30.4 in a run of it alone ten minutes on).
                after = [when for when, _ in r.steps if back and when >= back["t"] + 1.0]
                even_rate = (
                    r.rate(after[0], after[-1]) if len(after) > 2 and after[-1] - after[0] >= 2.0
                    else None
                )  # fmt: skip
                cell["even_steps_per_s"] = even_rate
                cell["baseline"] = "run" if even_rate else "free"
                baseline = even_rate or free_rate
                if uneven and even and baseline:
                    cell["predicted_steps_per_s"] = baseline * even / uneven
                if uneven:
                    cell["estimated_steps_per_s"] = 1.0 / uneven
                cell["load"] = last.get("load")
                cell["deals"] = len(dealt)
                # Its rate on that deal alone, against its prediction: the estimate checked
                # against what it estimates (the steps on an earlier deal count in
                # "on", against the run that waits). Too short a stretch (under 2 s):
                # the rate since the first move, which only undercounts it.
                settled = last["t"] + 0.5
                if len(dealt) > 1 and ended["t"] - settled >= 2.0:
                    cell["dealt_steps_per_s"] = r.rate(settled, ended["t"])
                cell["steps_to_move"] = there["resume_step"] - r.step_at(began["t"])
                if back is not None:
                    cell["steps_to_back"] = back["resume_step"] - r.step_at(ended["t"])
            row[mode] = cell
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slow-for", type=float, default=8.0, help="seconds each slowdown lasts")
    ap.add_argument("--factors", default="2,3")
    ap.add_argument("--jobs", default="dropin,trainer")
    ap.add_argument(
        "--repeat", type=int, default=1,
        help="runs of the whole set: the targets are judged on their means",
    )  # fmt: skip
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    factors = [float(x) for x in args.factors.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="stragglers-") as tmp:
        for n in range(args.repeat):
            work = Path(tmp) / str(n)
            work.mkdir()
            for job in args.jobs.split(","):
                for row in measure(job, factors, args.slow_for, work):
                    rows.append({**row, "repeat": n, **figures(row)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"{'job':8} {'slow':>5} {'free':>7} {'off':>7} {'on':>7} {'on/off':>7} "
        f"{'est.':>7} {'on/est':>7} {'pred.':>7} {'on/pred':>8} {'to move':>8} {'to back':>8}"
        "  deal"
    )
    for row in rows:
        on = row.get("on", {})
        print(
            f"{row['job']:8} {row['factor']:>4g}x {_f(row['free_steps_per_s'])} "
            f"{_f(row.get('off', {}).get('steps_per_s'))} {_f(on.get('steps_per_s'))} "
            f"{_f(row['on_off'])} {_f(on.get('estimated_steps_per_s'))} {_f(row['on_est'])} "
            f"{_f(on.get('predicted_steps_per_s'))}"
            f"{'*' if on.get('baseline') == 'free' else ' '}"
            f"{_f(row['on_pred'], '8.2f')} {_f(row['to_move'], '8.0f')} "
            f"{_f(row['to_back'], '8.0f')}  {on.get('load', on.get('error', '-'))}"
            + (f" (dealt {on['deals']} times)" if on.get("deals", 1) > 1 else "")
        )
    print("(steps per second; free: no slowdown; off/on: --stragglers, 'on' from the first "
          "move to the slowdown's end; est.: the planner's estimate for its last deal, when "
          "it chose it, printed, not judged (module doc); pred.: that over its estimate of "
          "the even plan, times the run's own rate on the even deal after it (*: the run "
          "without a slowdown's, where the run had under 2 s of it); on/est, on/pred: the "
          "rate on that deal alone, where it was dealt again; the targets are judged on the "
          "means, the standard errors say how far to trust them)")  # fmt: skip
    fails = []
    for (job, factor), group in _grouped(rows).items():
        means = {k: _mean_se([r[k] for r in group]) for k in ("on_off", "on_est", "on_pred",
                                                             "to_move", "to_back")}  # fmt: skip
        if len(group) > 1:
            print(f"{job:8} {factor:>4g}x over {len(group)} runs (mean ± standard error): "
                  + ", ".join(f"{k} {_pm(v)}" for k, v in means.items()))  # fmt: skip
        on_pred, on_off = means["on_pred"], means["on_off"]
        to_move, to_back = means["to_move"], means["to_back"]
        if on_pred is None or abs(on_pred[0] - 1.0) > 0.15:
            fails.append(f"{job} {factor:g}x: not within 15% of the optimum")
        if factor >= 3 and (on_off is None or on_off[0] < 1.3):
            fails.append(f"{job} {factor:g}x: under 1.3x the unmitigated rate")
        if to_move is None or to_back is None or to_move[0] > 20 or to_back[0] > 20:
            fails.append(f"{job} {factor:g}x: moves later than 20 steps")
    for fail in fails:
        print(f"target missed: {fail}")


def figures(row: dict) -> dict:
    """A row's ratios and steps (None where a run did not show them: a run that never
    moved back counts as missing the target, not as a number)."""
    off, on = row.get("off", {}), row.get("on", {})
    ratio = (
        on["steps_per_s"] / off["steps_per_s"]
        if on.get("steps_per_s") and off.get("steps_per_s") else None
    )  # fmt: skip
    pred, est = on.get("predicted_steps_per_s"), on.get("estimated_steps_per_s")
    on_deal = on.get("dealt_steps_per_s") or on.get("steps_per_s")
    return {
        "on_off": ratio,
        "on_est": on_deal / est if est and on_deal else None,
        "on_pred": on_deal / pred if pred and on_deal else None,
        "to_move": on.get("steps_to_move"),
        "to_back": on.get("steps_to_back"),
    }


def _grouped(rows: list[dict]) -> dict[tuple[str, float], list[dict]]:
    out: dict[tuple[str, float], list[dict]] = {}
    for row in rows:
        out.setdefault((row["job"], row["factor"]), []).append(row)
    return out


def _mean_se(values: list) -> tuple[float, float] | None:
    """The mean and its standard error; None if any run lacks the figure."""
    if not values or any(v is None for v in values):
        return None
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
    return mean, se


def _pm(v: tuple[float, float] | None) -> str:
    return "-" if v is None else f"{v[0]:.2f} ± {v[1]:.2f}"


def _f(x: float | None, spec: str = "7.2f") -> str:
    return format(x, spec) if x is not None else "-".rjust(int(spec.split(".")[0]))


if __name__ == "__main__":
    main()
