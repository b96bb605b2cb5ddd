"""A run's calibration, read back from its event log, so that ``chameleon simulate
--calibration events.jsonl`` replays failures on the costs the run measured.

``chameleon run`` fits its planner's model to the steps its workers measure
(launcher/calibration.py) and logs each fit as a ``calibrated`` event: the measured step,
and per worker the CPU per step, its passes' and the pass loop's. A replay fits the
config's job to the failure-free generation's measurements with the same code
(``planner.estimator.fit.fit_run``), so the simulated failure-free step is the measured one even
where the config's cost table was profiled at another time on a host whose speed drifts.
The run's transitions are measured too (``recovered`` events carry the factor that moved
the modelled transitions toward them) and its restart's start-up (``plan_chosen`` events
carry the ``restart_s`` the planner used); the replay takes the last of each.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from planner.estimator.fit import fit_run
from planner.job.errors import ConfigError
from planner.job.workload import Job
from planner.plans.layout import initial_plan


class _Calibrated(BaseModel):
    """The part of a ``calibrated`` event a replay needs."""

    model_config = ConfigDict(extra="ignore")

    generation: int = 0  # logs before it was logged held generation 0's first
    measured_step_s: float
    cpu_s: dict[int, float]
    compute_cpu_s: dict[int, float]
    pass_loop_cpu_s: dict[int, float] = {}


class RunCalibration(BaseModel):
    """What a run measured, as ``chameleon simulate`` applies it."""

    source: str
    measured_step_s: float  # the failure-free generation's
    cpu_s: dict[int, float]
    compute_cpu_s: dict[int, float]
    pass_loop_cpu_s: dict[int, float]
    transition_factor: float = 1.0
    restart_s: float | None = None

    def apply(self, job: Job) -> Job:
        """``job`` fitted to the run's failure-free step on its launch layout, with the
        run's transition factor and restart."""
        plan = initial_plan(job)
        fit, _ = fit_run(
            job, plan, self.measured_step_s, self.cpu_s, self.compute_cpu_s, self.pass_loop_cpu_s
        )
        fitted = fit.apply(job)
        cluster = replace(fitted.cluster, transition_factor=self.transition_factor)
        if self.restart_s is not None:
            cluster = replace(cluster, restart_s=self.restart_s)
        return replace(fitted, cluster=cluster)


def from_events(path: Path) -> RunCalibration:
    """The calibration in a ``chameleon run --events`` log (ConfigError if it has none)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"--calibration: cannot read {path} ({exc.strerror})") from None
    first: _Calibrated | None = None
    factor, restart = 1.0, None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"--calibration: {path}:{n} is not a JSON event") from None
        if not isinstance(event, dict):
            raise ConfigError(f"--calibration: {path}:{n} is not a JSON event")
        kind = event.get("event")
        try:
            if kind == "calibrated":
                fit = _Calibrated.model_validate(event)
                if first is None or (fit.generation == 0 and first.generation != 0):
                    first = fit
            elif kind in ("recovered", "rejoined") and event.get("transition_factor"):
                factor = float(event["transition_factor"])
            elif kind == "plan_chosen" and event.get("restart_s"):
                restart = float(event["restart_s"])
        except (ValidationError, TypeError, ValueError):
            raise ConfigError(f"--calibration: {path}:{n}: a malformed {kind} event") from None
    if first is None:
        raise ConfigError(
            f"--calibration: {path} has no 'calibrated' event (a chameleon_runtime job logs "
            "one once its first steps settle)"
        )
    return RunCalibration(
        source=f"{path}: measured step {first.measured_step_s * 1e3:.1f} ms, "
        f"transitions x{factor:.2f}" + (f", restart {restart:.1f} s" if restart else ""),
        measured_step_s=first.measured_step_s,
        cpu_s=first.cpu_s,
        compute_cpu_s=first.compute_cpu_s,
        pass_loop_cpu_s=first.pass_loop_cpu_s,
        transition_factor=factor,
        restart_s=restart,
    )
