"""The simulator kept honest by a real run: the same three kills, once on real workers
(``chameleon run --inject-fault``) and once replayed by ``chameleon simulate`` on the
config the run used, freshly profiled on this machine, with the run's calibration (its
event log: ``--calibration``). The adaptive policy on both sides; their throughputs
must agree within 20%."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launcher.helpers import free_port, run

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "train_gpt.py")
TEMPLATE = ROOT / "configs" / "cpu_testbed_profiled.toml"
KILLS = ("kill:rank=5,step=15", "kill:rank=2,step=30", "kill:rank=7,step=45")
STEPS = 60
# The adaptive choice on both sides. It once chose apart (ratio 0.52-0.59, two CI runs of
# November 2026): the run's planner was calibrated by the steps it measured, the
# simulation's was not, and one side kept a single intact pipeline at the first kill,
# so that the next kill hit a stage with no replica and restarted. Now the replay takes
# the run's calibration, and both see the restart such a layout risks (planner.choice.risk).
POLICY = "adaptive"
# What still moves the ratio (0.73-1.34 seen, most runs 0.9-1.1): the replay is fitted to
# generation 0's first settled steps (4 of them), and on 8 workers sharing 2 cores the
# host's pace drifts by up to a third within one run (the failure message prints each
# generation's measured step); the checkpoint every 10 steps is in the run and not in the
# replay (it charges checkpoints only to restarts), and the model underestimates how much
# faster 7 workers run than 8 on this host: these two err in opposite directions.

# a soak (scripts/soak.sh): the real run's pace on 8 workers sharing 2 cores drifts by
# up to a third within one run, so the figure it is held to is the host's that minute
pytestmark = [pytest.mark.slow, pytest.mark.soak]


def profiled_config(work: Path) -> Path:
    """The test bed's config on a cost table measured now, as docs/profile.md says to."""
    table = work / "table.json"
    result = run(
        "profile", "--out", str(table), "--nproc-per-node", "8", "--plain", EXAMPLE, cwd=work,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    config = work / "profiled.toml"
    config.write_text(
        TEMPLATE.read_text().replace("cost_tables/cpu_testbed_tiny_gpt.json", str(table))
    )
    return config


def test_simulated_throughput_agrees_with_a_real_run_of_the_same_kills(tmp_path):
    config = profiled_config(tmp_path)
    events_file = tmp_path / "events.jsonl"
    faults = [arg for kill in KILLS for arg in ("--inject-fault", kill)]
    result = run(
        "run", "--nproc-per-node", "8", "--plain", "--master-port", str(free_port()),
        "--config", str(config), "--max-rejoins", "0", "--policy", "auto", "--events", str(events_file), *faults,
        EXAMPLE, "--steps", str(STEPS), "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--pipeline-stages", "4",  # the config's launch layout (2 x 4), where the replay starts
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    events = [json.loads(line) for line in events_file.read_text().splitlines() if line.strip()]
    steps = sorted((e["step"], e["t"]) for e in events if e["event"] == "step")
    (first, t0), (last, t_end) = steps[0], steps[-1]
    kills = [(e["failed_at"], e["rank"]) for e in events if e["event"] == "failure"]
    inside = [(t, rank) for t, rank in kills if t0 < t < t_end]
    assert len(inside) >= 2, f"the kills fell outside the measured steps: {kills}, {steps}"
    batch = 32  # the example's --global-batch, the config's global_batch_size
    measured = (last - first) * batch / (t_end - t0)

    trace = tmp_path / "trace.json"
    trace.write_text(
        json.dumps(
            {
                "name": "three kills",
                "events": [{"t_hours": (t - t0) / 3600, "fail_ranks": [r]} for t, r in inside],
            }
        )
    )
    sim = run(
        "simulate", "--config", str(config), "--trace", str(trace),
        "--duration", f"{t_end - t0:.3f}s", "--policies", POLICY, "--json",
        "--calibration", str(events_file), cwd=tmp_path,
    )  # fmt: skip
    assert sim.returncode == 0, sim.stdout + sim.stderr
    report = json.loads(sim.stdout)
    (outcome,) = report["outcomes"]
    ratio = outcome["throughput"] / measured
    chosen = [e["policy"] for e in events if e["event"] == "plan_chosen"]
    print(f"simulated over measured: {ratio:.3f}; run chose {chosen}")
    restarts = [e for e in events if e["event"] == "restart"]
    assert not restarts and outcome["restarts"] == 0, (
        f"a restart: run chose {chosen}, simulation restarted {outcome['restarts']} times"
    )
    assert 0.8 <= ratio <= 1.2, (
        f"simulated {outcome['throughput']:.1f} samples/s, measured {measured:.1f} "
        f"over {t_end - t0:.2f} s (steps {first}..{last}); run chose {chosen}, "
        f"simulation recovered {outcome['in_place']} in place, {outcome['restarts']} restarts; "
        + _what_the_run_measured(events)
    )


def _what_the_run_measured(events: list[dict]) -> str:
    """Per generation, the step its workers measured (what the replay is fitted to, from
    generation 0) against the wall time between the step events, and each plan's
    estimate: where a disagreement came from when the ratio is off. (Said, never raised:
    it is read only in a failing assertion's message.)"""
    try:
        return _measured(events)
    except Exception as exc:  # noqa: BLE001 (the assertion's own message must stand)
        return f"(no per-generation figures: {exc!r})"


def _measured(events: list[dict]) -> str:
    fits = {
        e.get("generation"): e.get("measured_step_s") for e in events if e["event"] == "calibrated"
    }
    plans = [e.get("estimated_step_s") for e in events if e["event"] == "plan_chosen"]
    walls: dict[int, list[tuple[int, float]]] = {}
    for e in events:
        if e["event"] == "step":
            walls.setdefault(e.get("generation", 0), []).append((e["step"], e["t"]))
    periods = {
        g: (b[1] - a[1]) / (b[0] - a[0])
        for g, marks in walls.items()
        if len(marks) > 1 and (a := min(marks)) and (b := max(marks)) and b[0] > a[0]
    }
    return (
        f"measured step (s) per generation {fits}, wall per step between step events "
        f"{ {g: round(p, 4) for g, p in periods.items()} }, chosen plans' estimates {plans}"
    )
