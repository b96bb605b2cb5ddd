"""A run's calibration read back (planner.simulation.calibration) for ``chameleon simulate
--calibration``, and the model a successor leader starts from (JobModel.snapshot)."""

import json
from pathlib import Path

import pytest

from launcher.calibration import JobModel
from planner.config import load_job
from planner.estimator.estimate import estimate, worker_compute_s
from planner.job.cost import CostModel
from planner.job.errors import ConfigError
from planner.job.failures import FailureRate
from planner.plans.layout import initial_plan
from planner.simulation.calibration import from_events
from tests.cli import chameleon

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "cpu_testbed.toml"


def _log(tmp_path: Path, job, *, slower: float = 1.6) -> Path:
    """An event log as chameleon run writes one: the failure-free generation measured
    ``slower`` times the config's estimate, a later generation, a transition factor and a
    measured restart."""
    plan = initial_plan(job)
    compute = worker_compute_s(plan, CostModel(job))
    measured = estimate(job, plan).step_s * slower
    # The workers keep the host's cores 80% busy: their CPU is 0.8 x cores x the step,
    # shared as their modelled compute is, 1/1.3 of it their layers'.
    cpu = {w: 0.8 * job.cluster.host_cores * measured * c / sum(compute.values())
           for w, c in compute.items()}  # fmt: skip

    def calibrated(generation, step):
        return {
            "event": "calibrated",
            "generation": generation,
            "measured_step_s": step,
            "factor": 9.9,  # fitted on the run's own description: not what a replay uses
            "cpu_s": {str(w): cpu[w] for w in plan.workers},
            "compute_cpu_s": {str(w): cpu[w] / 1.3 for w in plan.workers},
            "pass_loop_cpu_s": {str(w): 0.0 for w in plan.workers},
        }

    events = [
        {"event": "workers_started"},
        calibrated(0, measured),
        {"event": "plan_chosen", "policy": "reroute", "restart_s": 3.5},
        {"event": "recovered", "generation": 1, "transition_factor": 1.7},
        calibrated(1, measured * 2),
        {"event": "recovered", "generation": 2, "transition_factor": 2.1},
    ]
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in events) + "\n")
    return path


def test_a_replay_runs_on_the_failure_free_step_the_run_measured(tmp_path):
    job = load_job(CONFIG)
    plan = initial_plan(job)
    measured = estimate(job, plan).step_s * 1.6
    cal = from_events(_log(tmp_path, job))
    assert cal.measured_step_s == pytest.approx(measured)  # generation 0's, not 1's
    replay = cal.apply(job)
    assert estimate(replay, plan).step_s == pytest.approx(measured, rel=0.02)
    assert replay.cluster.transition_factor == 2.1  # what the run had learned last
    assert replay.cluster.restart_s == 3.5
    assert "measured step" in cal.source


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"event": "workers_started"}\n', "no 'calibrated' event"),
        ('{"event": "calibrated"\n', "not a JSON event"),
        ('{"event": "calibrated", "measured_step_s": "fast"}\n', "malformed calibrated"),
        ("[1, 2]\n", "not a JSON event"),
    ],
)
def test_a_log_without_a_usable_calibration_is_named(tmp_path, text, why):
    path = tmp_path / "events.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError, match=why):
        from_events(path)


def test_simulate_takes_a_runs_calibration_and_refuses_a_bad_one(tmp_path):
    job = load_job(CONFIG)
    log = _log(tmp_path, job)
    args = ["simulate", "-c", str(CONFIG), "--trace", "oobleck-30m", "--duration", "2h"]
    plain = json.loads(chameleon(*args, "--policies", "reroute", "--json").stdout)
    replay = json.loads(
        chameleon(*args, "--policies", "reroute", "--json", "--calibration", str(log)).stdout
    )
    assert replay["step_s"] == pytest.approx(
        estimate(job, initial_plan(job)).step_s * 1.6, rel=0.02
    )
    assert replay["step_s"] > plain["step_s"] * 1.5
    bad = chameleon(*args, "--calibration", str(tmp_path / "missing.jsonl"))
    assert bad.returncode != 0
    assert "--calibration" in bad.stderr and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_a_successor_starts_from_what_its_predecessor_learned():
    emitted = []
    old = JobModel(emit=lambda *a, **k: None, rate=FailureRate(7200.0), num_nodes=2,
                   workers_per_node=4)  # fmt: skip
    old.factor, old.host, old.wait_s = 1.7, (2.0, 0.001, 0.0004, 2e-5, 1e-4), 0.0004
    old.measured_s, old.fitted_generation, old.transition_factor = 0.21, 3, 1.9
    old.restart_s = 4.2
    old.expose(0.0, 8)
    old.expose(100.0, 7, failures=2, node_failures=1)
    snap = json.loads(json.dumps(old.snapshot()))  # as the mirror carries it: JSON
    new = JobModel(emit=lambda name, **kw: emitted.append((name, kw)), rate=FailureRate(7200.0),
                   num_nodes=2, workers_per_node=4)  # fmt: skip
    new.restore(snap)
    assert (new.factor, new.host, new.wait_s) == (old.factor, old.host, old.wait_s)
    assert (new.measured_s, new.fitted_generation) == (0.21, 3)
    assert (new.transition_factor, new.restart_s) == (1.9, 4.2)
    assert new.rate.mtbf(7).seconds == pytest.approx(old.rate.mtbf(7).seconds)
    assert new.rate.node_share() == pytest.approx(old.rate.node_share())
    assert emitted[0][0] == "calibration_restored" and emitted[0][1]["factor"] == 1.7
