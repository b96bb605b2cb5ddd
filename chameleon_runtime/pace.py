"""The pace of a worker's recent steps, as the launcher fits its model to them: means over
the last few steps of the current generation, leaving out the generation's first steps
(warm-up: fresh groups' first messages, the allocator), so that one slow step does not
skew the fit the next recovery plans with.

Besides CPU time, the wall time a worker's passes took per micro-batch
(``busy_s_per_mb``, the median over the window: a garbage collection or a checkpoint's
write in one step does not move it, a slowdown of half the window's steps does): what tells a slow worker from its peers (launcher/stragglers.py).
CPU time cannot: a throttled GPU, a starved host or a stopped process spends no more CPU
per pass, only more time; and the wait in a collective is left out, so that the peers
the slow one holds up do not look slow too."""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from chameleon_runtime.protocol.messages import PACE_WARMUP_STEPS, PACE_WINDOW

WARMUP_STEPS = PACE_WARMUP_STEPS
WINDOW = PACE_WINDOW


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
        busy_s: float = 0.0,
        micro_batches: int = 0,
    ) -> None:
        if generation != self.generation:
            self.generation, self.seen = generation, 0
            self.recent.clear()
        self.seen += 1
        if self.seen > WARMUP_STEPS:
            self.recent.append((step_s, cpu_s, compute_cpu_s, pass_cpu_s, busy_s, micro_batches))

    def means(self) -> dict[str, float | int]:
        """``mean_step_s``, ``mean_cpu_s``, ``mean_compute_cpu_s``, ``mean_pass_cpu_s``,
        and ``busy_s_per_mb`` where the steps ran micro-batches; ``pace_steps``, how many
        steps they are over (0 until warm: what a status still shows of an earlier
        generation is not this one's pace)."""
        if not self.recent:
            return {"pace_steps": 0}
        n = len(self.recent)
        names = ("mean_step_s", "mean_cpu_s", "mean_compute_cpu_s", "mean_pass_cpu_s")
        means = {name: sum(r[i] for r in self.recent) / n for i, name in enumerate(names)}
        per_mb = [r[4] / r[5] for r in self.recent if r[5]]
        if per_mb:
            means["busy_s_per_mb"] = statistics.median(per_mb)
        means["pace_steps"] = n
        return means


class PassClock:
    """The wall time of a worker's passes. On the CPU: the host's clock around each pass.
    On a CUDA device the host returns from a pass once its kernels are queued, so the
    host's clock would time the launches and the device's slowness would show where the
    host waits for it (the step's sums, left out on purpose): a pair of CUDA events
    around each pass instead, read once the step has synchronised (``take``)."""

    def __init__(self, device: str | torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._host_s = 0.0
        self._pairs: list[tuple[Any, Any]] = []

    def start(self) -> Any:
        if self.cuda:
            began = torch.cuda.Event(enable_timing=True)
            began.record()
            return began
        return time.perf_counter()

    def stop(self, began: Any) -> None:
        if self.cuda:
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
            self._pairs.append((began, ended))
        else:
            self._host_s += time.perf_counter() - began

    def take(self) -> float:
        """Seconds of passes since the last take (after the step's sums: on CUDA the
        last event is waited for, which the step has waited for already)."""
        total, self._host_s = self._host_s, 0.0
        if self._pairs:
            self._pairs[-1][1].synchronize()
            total += sum(a.elapsed_time(b) for a, b in self._pairs) / 1e3
            self._pairs.clear()
        return total
