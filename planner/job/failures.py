"""D, the mean time to the next failure, for one job: a prior from the devices in use,
updated by the failures the job sees.

Failures of a job on n devices arrive as a Poisson process of rate n * lambda, lambda the
failure rate of one device. Meta's clusters show why D must scale with n: 7.9 h mean
time to failure at 1,024 GPUs, 1.8 h at 16,384 (Kokolis et al., 2024); Llama 3 saw 419
unexpected interruptions in 54 days on 16,384 H100 (Dubey et al., 2024), one per 50,700
device-hours.

The textbook conjugate for a Poisson rate is a Gamma distribution: a prior of shape
``a`` and rate ``b`` (device-hours) has mean a / b; after k failures over an exposure of
E device-hours the posterior is Gamma(a + k, b + E), with mean (a + k) / (b + E). The
prior's strength ``a`` is a number of pseudo-failures: with a = 1 the prior weighs as much
as one observed failure, so a job whose devices fail far more often than the config says
sees its D fall within a few failures, and one that sees none drifts back towards the
prior. D = 1 / (n * posterior mean).

``--mtbf`` (or a config's ``mtbf_hours``) fixes D for the job and nothing is learned.
Every ``plan_chosen`` event says which D was used and where it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Llama 3 on 16,384 H100: 419 unexpected interruptions in 54 days.
DEFAULT_DEVICE_MTBF_H = 54 * 24 * 16384 / 419
PRIOR_PSEUDO_FAILURES = 1.0
# Llama 3 405B's unexpected interruptions by cause (PAPER.md), and what each takes down: a
# GPU its worker until repaired, a software fault the worker's process, network and host
# faults the whole node. Drawn traces (planner.simulation.trace) and the risk a layout takes at the
# next failure (planner.choice.risk) both read it.
CAUSES: tuple[tuple[str, float, str], ...] = (
    ("gpu", 0.587, "device"),
    ("software", 0.129, "process"),
    ("network", 0.084, "node"),
    ("host", 0.200, "node"),
)


def scope_shares() -> tuple[float, float]:
    """(the share of failures that take one worker, the share that take its node)."""
    total = sum(w for _, w, _ in CAUSES)
    node = sum(w for _, w, scope in CAUSES if scope == "node") / total
    return 1.0 - node, node


@dataclass(frozen=True)
class Mtbf:
    seconds: float
    source: str  # how it was obtained, for the event log and the plan report

    def as_fields(self) -> dict[str, object]:
        return {"mtbf_s": self.seconds, "mtbf_source": self.source}


@dataclass(frozen=True)
class FailureRate:
    """The Gamma posterior over one device's failure rate (module doc). Times in s."""

    device_mtbf_s: float  # the prior's mean time between failures of one device
    fixed_s: float | None = None  # D given outright (--mtbf, mtbf_hours): nothing learned
    fixed_source: str = ""
    pseudo_failures: float = PRIOR_PSEUDO_FAILURES
    failures: int = 0
    exposure_device_s: float = 0.0  # device-seconds observed
    node_failures: int = 0  # of ``failures``, those that took a whole node

    def observe(
        self, *, devices: int, seconds: float, failures: int = 0, node_failures: int = 0
    ) -> FailureRate:
        """``devices`` ran for ``seconds`` and ``failures`` failures ended it, of which
        ``node_failures`` took a whole node."""
        return replace(
            self,
            failures=self.failures + failures,
            node_failures=self.node_failures + node_failures,
            exposure_device_s=self.exposure_device_s + max(0.0, seconds) * max(0, devices),
        )

    def node_share(self) -> float:
        """The share of failures that take a whole node: Llama 3's cause mix (CAUSES) as a
        prior worth ``pseudo_failures`` failures, updated by the failures seen (a job whose
        failures are all single devices soon stops fearing for its nodes)."""
        a = self.pseudo_failures
        return (a * scope_shares()[1] + self.node_failures) / (a + self.failures)

    def device_rate_per_s(self) -> float:
        a = self.pseudo_failures
        b = a * self.device_mtbf_s  # prior mean a / b = 1 / device_mtbf_s
        return (a + self.failures) / (b + self.exposure_device_s)

    def mtbf(self, devices: int) -> Mtbf:
        """D for a job on ``devices`` devices."""
        if self.fixed_s is not None:
            return Mtbf(self.fixed_s, self.fixed_source)
        d = 1.0 / (max(1, devices) * self.device_rate_per_s())
        if self.failures or self.exposure_device_s:
            hours = self.exposure_device_s / 3600
            source = (
                f"posterior: {self.failures} failure(s) in {hours:.3g} device-hours on a prior "
                f"of one per {self.device_mtbf_s / 3600:.3g} device-hours, x {devices} devices"
            )
        else:
            source = f"prior: one failure per {self.device_mtbf_s / 3600:.3g} device-hours x {devices} devices"
        return Mtbf(d, source)
