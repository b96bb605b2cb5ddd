"""The pace of a worker's recent steps, as the launcher fits its model to them: means over
the last few steps of the current generation, leaving out the generation's first steps
(warm-up: fresh groups' first messages, the allocator), so that one slow step does not
skew the fit the next recovery plans with."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WARMUP_STEPS = 2
WINDOW = 8


@dataclass
class Pace:
    generation: int = -1
    seen: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))

    def add(
        self,
        generation: int,
        step_s: float,
        cpu_s: float,
        compute_cpu_s: float,
        pass_cpu_s: float = 0.0,
    ) -> None:
        if generation != self.generation:
            self.generation, self.seen = generation, 0
            self.recent.clear()
        self.seen += 1
        if self.seen > WARMUP_STEPS:
            self.recent.append((step_s, cpu_s, compute_cpu_s, pass_cpu_s))

    def means(self) -> dict[str, float]:
        """``mean_step_s``, ``mean_cpu_s``, ``mean_compute_cpu_s``, ``mean_pass_cpu_s``
        (empty until warm)."""
        if not self.recent:
            return {}
        n = len(self.recent)
        names = ("mean_step_s", "mean_cpu_s", "mean_compute_cpu_s", "mean_pass_cpu_s")
        return {name: sum(r[i] for r in self.recent) / n for i, name in enumerate(names)}
