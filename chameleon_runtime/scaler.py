"""Dynamic loss scaling for fp16 (``Trainer(precision="fp16")``), the rules of
``torch.amp.GradScaler`` kept by every worker alike.

fp16 holds values up to 65,504 and loses small gradients below 6e-8, so the loss is
multiplied by a scale S before the backward passes and the gradients divided by it
before the optimizer. A step whose gradients overflowed (an inf or nan anywhere) is
skipped and S halves; after ``growth_interval`` good steps in a row S doubles.

Why every worker decides alike: the overflow check is on the global gradient norm, the
squared norms every lowest holder reports before the commit and every worker reads after
it (planner.plans.program.TailKind.READ_NORM), so all workers see the same finite-or-not and
skip the same steps, and their S stays the same.

Why S travels with the layers: a worker that joins (a respawned rank, a spare brought
back) must use the S of the step it resumes, which only the workers that trained through
know. Every exported layer carries the state (``LossScale.to_header``), stamped with the
next step it applies to; a worker adopts a migrated layer's state when it is newer than
its own, and a checkpoint's state always (a restart goes back to the checkpoint's step).
S is a power of two, so scaling and unscaling are exact.
"""

from __future__ import annotations

from dataclasses import dataclass

INIT_SCALE = 2.0**16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


@dataclass
class LossScale:
    scale: float = INIT_SCALE
    growth_interval: int = GROWTH_INTERVAL
    good_steps: int = 0  # finite steps in a row since S last changed
    next_step: int = 0  # the step this state applies to
    skipped: int = 0  # steps skipped for overflow in this process's life (a statistic)

    def update(self, step: int, finite: bool) -> None:
        """After step ``step``'s global norm is known: GradScaler.update's rules."""
        if finite:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= GROWTH_FACTOR
                self.good_steps = 0
        else:
            self.scale *= BACKOFF_FACTOR
            self.good_steps = 0
            self.skipped += 1
        self.next_step = step + 1

    def to_header(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "next_step": self.next_step}

    def adopt(self, header: dict | None, *, restore: bool = False) -> None:
        """Take a layer's state: when it is newer (a migration), or always (``restore``:
        a checkpoint)."""
        if header is None:
            return
        if restore or header["next_step"] > self.next_step:
            self.scale = float(header["scale"])
            self.good_steps = int(header["good_steps"])
            self.next_step = int(header["next_step"])
