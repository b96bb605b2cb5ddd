"""Chaos soak: one seeded run with many faults of every kind, against a failure-free run.

    python benchmarks/chaos.py [--seed 0] [--faults 32] [--workers 8] [--gap 150]
                               [--pipeline-stages 2|auto] [--json]

The example tiny GPT (examples/train_gpt.py, made smaller: 2-stage pipelines, or the
planner's launch layout with ``--pipeline-stages auto``) trains on
``--workers`` CPU workers under ``chameleon run``, planned as the shared 2-core host it
runs on (configs/cpu_testbed.toml) and told the soak's failure rate (``--mtbf``: the
failure-free run's time over the faults scheduled), with replacements rejoining and a
schedule of faults drawn from ``--seed``, each for any attempt (``attempt=any``: a fault
not reached before a restart fires after it):

- at steps about ``--gap`` apart (time for a replacement to start and be taken back in, as
  on a cluster whose failures are hours apart): kill -9 (60%), SIGSTOP (20%, a hang the
  liveness timeout finds) and a non-zero exit (20%) of a random working worker;
- inside recoveries: a kill -9 of a random worker in a random phase (collect, plan,
  groups, migrate, confirm) of a random later recovery, some of them a few ms into it.

It prints the faults injected, recoveries in place, replacements admitted back into the
job (and growths: recoveries that only took them into the layout), restarts (each with
whether every holder of a stage was lost at once, the one case a restart is due), wedges (no step for ``--wedge-s``), steps lost, the final weights'
largest relative difference from the failure-free run (and the final loss's), the
store's key count and a survivor's file descriptors and threads after the first and the
last recovery. It exits non-zero if anything wedged, fewer than ``--faults`` faults were
injected, a restart was not forced by the loss of a stage's every holder, or the weights
or the final loss differ by more than ``--tolerance``.

The runs sum gradients exactly by default (``Trainer(exact=True)``: float64 sums, the
same bits in any layout), so recovery must leave training exactly as it was: tolerance
1e-5, and every run we made came out at 0.0. ``--float32`` runs the default runtime (ring
all-reduce in float32), whose sums change order with every layout change: a failure-free
run on another layout ends elsewhere too, so a third run, failure-free on ``--workers - 2``
workers, measures that floor in the same soak, and the tolerance is the larger of 1e-3
and three times it (the faulted run changes layout some 25 times, the floor run once;
docs/runtime.md). ``--keep DIR`` keeps the runs' events and every worker's log.
"""

from __future__ import annotations

import argparse
import glob
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from processes import kill_everything

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_gpt.py"
MODEL = [
    "--blocks", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--global-batch", "16",
    "--micro-batch", "2", "--checkpoint-every", "50",
]  # fmt: skip
PHASES = ("collect", "plan", "groups", "migrate", "confirm")
# A restart's reason when no in-place recovery was left (launcher/coordinator.py,
# launcher/planning.py): every holder of some layer was lost.
FORCED = ("no worker that held state survived", "no in-place policy is feasible")


def schedule(seed: int, faults: int, gap: int) -> tuple[list[str], int]:
    """``--inject-fault`` specs (about two thirds at steps, a third inside recoveries) and
    the steps to train. More are drawn than asked for: a fault whose moment never comes (a
    recovery number not reached) is not injected."""
    rng = random.Random(seed)
    at_steps = faults * 2 // 3 + 1
    specs = []
    for i in range(at_steps):
        kind = rng.choices(["kill", "hang", "exit"], weights=[6, 2, 2])[0]
        step = 30 + i * gap + rng.randrange(max(1, gap // 3))
        specs.append(
            f"{kind}:rank=any,step={step},attempt=any" + (",code=3" if kind == "exit" else "")
        )
    # Each fault at a step starts a recovery (and a replacement taken back in may start
    # another): recoveries 2..at_steps surely come. A phase fault may still miss its
    # phase (a reroute's migration is over in a millisecond), hence a few spare ones.
    inside = min(at_steps - 1, faults - at_steps + 6)
    for recovery in sorted(rng.sample(range(2, at_steps + 1), inside)):
        after = rng.choice([0, 0, 5, 30])
        specs.append(
            f"kill:rank=any,phase={rng.choice(PHASES)},recovery={recovery},after_ms={after},"
            "attempt=any"
        )
    return specs, 30 + at_steps * gap + gap


def train(
    work: Path,
    name: str,
    args: argparse.Namespace,
    faults: list[str],
    steps: int,
    mtbf_s: float | None = None,
    workers: int | None = None,
) -> dict:
    """One run; its events, dumps and whether it wedged. ``mtbf_s``: the soak's failure
    rate, told to the planner (--mtbf); ``workers``: default ``--workers``."""
    out = work / name
    out.mkdir()
    log = out / "events.jsonl"
    flags = [x for spec in faults for x in ("--inject-fault", spec)]
    flags += ["--config", str(ROOT / "configs" / "cpu_testbed.toml")]
    flags += ["--mtbf", f"{mtbf_s:.3f}s"] if mtbf_s else []
    # Restarts are allowed only where every holder of a layer was lost (the report checks
    # each); with a third of 30+ faults landing inside recoveries, on layouts of two or
    # three replicas, three or four of those come in one soak: room for them, as a
    # torchrun user sizes --max-restarts to the failures expected.
    cmd = [
        sys.executable, "-m", "chameleon_cli", "run", "--plain", "--standalone",
        "--nproc-per-node", str(workers or args.workers), "--max-restarts", "8", "--max-rejoins", "50",
        "--heartbeat-timeout", "2", "--events", str(log), "--redirects", "3",
        "--log-dir", str(out / "logs"), *flags, str(EXAMPLE),
        "--steps", str(steps), *MODEL, "--pipeline-stages", args.pipeline_stages,
        "--checkpoint-dir", str(out / "ckpt"),
        "--dump", str(out / "dump"), *([] if args.float32 else ["--exact"]),
    ]  # fmt: skip
    started = time.monotonic()
    with open(out / "output.log", "w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=out, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        wedged, last_seen, last_count = False, time.monotonic(), 0
        while proc.poll() is None:
            time.sleep(1.0)
            count = len(log.read_text().splitlines()) if log.exists() else 0
            if count != last_count:
                last_seen, last_count = time.monotonic(), count
            elif time.monotonic() - last_seen > args.wedge_s:
                wedged = True
                kill_everything(proc, out)
                proc.wait()
    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    checks: dict[int, list[float]] = {}
    losses: dict[int, float] = {}
    for f in glob.glob(str(out / "dump.rank*.json")):
        dump = json.loads(Path(f).read_text())
        for layer, value in dump["checksums"].items():
            checks.setdefault(int(layer), []).append(value)
        losses.update({int(k): v for k, v in dump["losses"].items()})
    return {
        "code": proc.returncode,
        "wedged": wedged,
        "wall_s": time.monotonic() - started,
        "events": events,
        "checks": checks,
        "final_loss": losses[max(losses)] if losses else None,
    }


def distance(run: dict, reference: dict) -> tuple[float | None, float | None]:
    """The largest relative difference of ``run``'s per-layer weight checksums from
    ``reference``'s, and of its final loss."""
    diffs = [
        abs(values[0] - reference["checks"][layer][0])
        / max(1.0, abs(reference["checks"][layer][0]))
        for layer, values in run["checks"].items()
        if layer in reference["checks"]
    ]
    final, ref_final = run["final_loss"], reference["final_loss"]
    loss = abs(final - ref_final) / abs(ref_final) if final is not None and ref_final else None
    return (max(diffs) if diffs else None), loss


def report(run: dict, reference: dict) -> dict:
    from launcher.timeline import recoveries

    evs = run["events"]

    def named(name: str) -> list[dict]:
        return [e for e in evs if e["event"] == name]

    injected = named("fault_injected")
    kinds: dict[str, int] = {}
    for e in injected:
        key = (
            e["kind"]
            if e["recovery_phase"] in (None, "running")
            else f"kill in {e['worker_phase'] if e['worker_phase'] in ('groups', 'migrate') else e['recovery_phase']}"
        )
        kinds[key] = kinds.get(key, 0) + 1
    recovered = named("recovered")
    grown = [e for e in named("rejoined") if e.get("taken_in") and "generation" in e]
    admitted = sum(len(e["ranks"]) for e in named("admitted"))
    restarts = [e for e in named("decision") if e["action"] == "restart"]
    # Whether each restart was due: every holder of some layer lost at once (the
    # launcher's and the planner's own words for it), not a restart chosen over an
    # in-place recovery that was possible.
    forced = [any(why in (e.get("reason") or "") for why in FORCED) for e in restarts]
    steps = named("step")

    def settled_after(e: dict | None) -> dict | None:
        if e is None:
            return None
        later = [s for s in steps if s["t"] > e["t"] and s.get("fds") is not None]
        return later[min(2, len(later) - 1)] if later else None

    in_place = recovered + grown
    in_place.sort(key=lambda e: e["t"])
    first, last = (
        settled_after(in_place[0] if in_place else None),
        settled_after(in_place[-1] if in_place else None),
    )
    weights, loss = distance(run, reference)
    agree = all(max(v) == min(v) for v in run["checks"].values())
    complete = sorted(run["checks"]) == sorted(reference["checks"])
    return {
        "faults_injected": len(injected),
        "faults_by_kind": kinds,
        "recovered_in_place": len(recovered),
        "replacements_admitted": admitted,
        "growths": len(grown),
        "restarts": len(restarts),
        "restarts_forced": forced,  # per restart: every holder of a stage lost at once
        "restart_reasons": [e.get("reason") for e in restarts],
        "wedged": run["wedged"],
        "exit_code": run["code"],
        "steps_lost": sum(r.steps_lost or 0 for r in recoveries(evs)),
        "weights_max_rel_diff": weights,
        "final_loss_rel_diff": loss,
        "holders_agree": agree,
        "all_layers_held": complete,
        "store_keys": [first and first["store_keys"], last and last["store_keys"]],
        "fds": [first and first["fds"], last and last["fds"]],
        "threads": [first and first["threads"], last and last["threads"]],
        "wall_s": round(run["wall_s"], 1),
        "reference_wall_s": round(reference["wall_s"], 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", type=int, default=32)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--gap", type=int, default=150, help="steps between faults at steps")
    parser.add_argument("--wedge-s", type=float, default=120.0)
    parser.add_argument(
        "--float32",
        action="store_true",
        help="the default runtime (float32 ring sums), not Trainer(exact=True)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="default: 1e-5, or with --float32 the larger of 1e-3 and 3x the layout floor",
    )
    parser.add_argument(
        "--pipeline-stages",
        default="2",
        help='the launch layout: stages per pipeline, or "auto" (the planner picks it, '
        "and re-partitions once calibrated)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", default=None, help="keep both runs (events, worker logs) here")
    args = parser.parse_args()
    if args.float32 and args.workers < 4:
        parser.error("--float32 needs --workers 4 or more (its floor run takes 2 fewer)")
    specs, steps = schedule(args.seed, args.faults, args.gap)
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        reference = train(work, "reference", args, [], steps)
        if reference["code"] != 0:
            print(f"the failure-free run failed (exit {reference['code']})", file=sys.stderr)
            return 2
        # The planner is told the soak's failure rate, as a cluster's config tells it its
        # fleet's: a fault every few seconds. Learned from the test bed's prior (one
        # failure per 2 device-hours), D would stay in minutes for most of the run, and
        # layouts that one kill turns into a restart would look worth their speed.
        mtbf_s = reference["wall_s"] / len(specs)
        run = train(work, "chaos", args, specs, steps, mtbf_s)
        result = report(run, reference)
        floor = None
        if args.float32:  # where float32 sums alone take a failure-free run elsewhere
            other = train(work, "floor", args, [], steps, workers=args.workers - 2)
            if other["code"] != 0:
                print(f"the floor run failed (exit {other['code']})", file=sys.stderr)
                return 2
            floor = distance(other, reference)
    if args.tolerance is None:
        args.tolerance = max(1e-3, 3 * max(x or 0.0 for x in floor)) if floor is not None else 1e-5
    result["floor_workers"] = args.workers - 2 if floor else None
    result["floor_weights_rel_diff"], result["floor_loss_rel_diff"] = floor or (None, None)
    result["seed"], result["steps"], result["scheduled"] = args.seed, steps, specs
    result["mtbf_s"] = round(mtbf_s, 3)
    result["exact"], result["tolerance"] = not args.float32, args.tolerance
    ok = (
        not result["wedged"]
        and result["exit_code"] == 0
        and result["faults_injected"] >= args.faults
        and result["restarts"] == sum(result["restarts_forced"])
        and result["weights_max_rel_diff"] is not None
        and result["weights_max_rel_diff"] <= args.tolerance
        and result["final_loss_rel_diff"] is not None
        and result["final_loss_rel_diff"] <= args.tolerance
        and result["holders_agree"]
        and result["all_layers_held"]
    )
    result["ok"] = ok
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            if key != "scheduled":
                print(f"{key:22} {value}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
