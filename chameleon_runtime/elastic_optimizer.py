"""``ElasticOptimizer``: the user's optimizer, stepped once per global step of the drop-in
data-parallel API (chameleon_runtime.dataparallel).

``step()`` ends a turn of the loop and returns True when the step committed (this
worker's share of it done, the sums in, every member agreeing on the step), False while
the worker accumulates or when a recovery left the step to be redone. Several optimizers
of one model (one per parameter subset) each call ``step()`` in a turn: the first ends
the turn, the others get its outcome, and each applies its own update.

``torch.amp.GradScaler`` works unchanged: the scaler hands itself to ``step()`` (this
class sets ``_step_supports_amp_scaling``, the hook torch gives optimizers that handle
scaling). Every micro-batch of a step is scaled by the same factor (the scaler's
``update()`` does nothing until the step commits), the step's summed gradient is
unscaled and checked for infs once, on the reduced sums every member holds, and the
update is skipped everywhere or nowhere: what DDP with a scaler does for one batch.
"""

from __future__ import annotations

import time
import warnings
from collections import defaultdict
from typing import Any

import torch

from chameleon_runtime.dataparallel import ElasticDataParallel

# GradScaler warns at every step() that its grad_scaler keyword is going away; torch
# 2.13 (the range pyproject.toml admits) still passes it, and tests/runtime catch the
# day it stops.
warnings.filterwarnings(
    "ignore", message="GradScaler is going to stop passing itself", category=FutureWarning
)


class _ScalerBridge:
    """A GradScaler seen through ``step(grad_scaler=...)``: its ``update()`` waits for
    the step's commit (module doc). The scaler's own method is kept and called then."""

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        self.mid_step = False
        self._update = scaler.update
        scaler.update = self.update  # this instance only: the class is untouched

    def update(self, new_scale: Any = None) -> None:
        if self.mid_step:
            from torch.amp.grad_scaler import _refresh_per_optimizer_state

            # Only the per-step bookkeeping starts again; the scale and its growth
            # tracker stay as they were, for the step's next micro-batch.
            self.scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
            return
        self._update(new_scale)


class ElasticOptimizer(torch.optim.Optimizer):
    """The user's optimizer around one ``ElasticDataParallel`` (module doc)."""

    _step_supports_amp_scaling = True

    def __init__(self, optimizer: torch.optim.Optimizer, model: ElasticDataParallel) -> None:
        # (torch.optim.Optimizer.__init__ is not called: the state is the inner one's)
        if not isinstance(model, ElasticDataParallel):
            raise TypeError(
                f"ElasticOptimizer takes the cr.ElasticDataParallel model, not a "
                f"{type(model).__name__}"
            )
        self.optimizer = optimizer
        self.model = model
        self._applied_turn = -1
        self._bridges: dict[int, _ScalerBridge] = {}
        self._last_scaler: Any = None  # the GradScaler of the last step() that applied
        model.optimizers.append(self)

    @property
    def global_step(self) -> int:
        """The job's committed steps: a loop's counter (a replacement joins mid-run)."""
        return self.model.sampler.step

    def heal_with(self, *objects: Any) -> None:
        """``ElasticDataParallel.heal_with``: objects a replacement takes from a live
        member besides the model, the optimizers, the sampler and the random state."""
        self.model.heal_with(*objects)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def step(self, closure: Any = None, grad_scaler: Any = None) -> bool:  # type: ignore[override]
        if grad_scaler is not None:  # (a step rolled forward inside the turn applies with it)
            self._last_scaler = grad_scaler
        outcome = self.model.turn()
        if grad_scaler is not None:
            bridge = self._bridges.get(id(grad_scaler))
            if bridge is None or bridge.scaler is not grad_scaler:
                bridge = self._bridges[id(grad_scaler)] = _ScalerBridge(grad_scaler)
            bridge.mid_step = not outcome.committed
        if not outcome.committed:
            return False
        self._apply(outcome.turn, grad_scaler, closure)
        return True

    def apply_rolled(self, turn: int) -> None:
        """Apply turn ``turn``'s step now, a step rolled forward whose state a replacement
        is about to receive (ElasticDataParallel._roll_now); through the scaler this
        optimizer last stepped with, as its step() would."""
        self._apply(turn, self._last_scaler)

    def _apply(self, turn: int, scaler: Any, closure: Any = None) -> None:
        if self._applied_turn == turn:  # stepped twice in one turn: once only
            return
        self._applied_turn = turn
        if scaler is None or self._finite(scaler):
            started = time.thread_time()
            if closure is not None:
                self.optimizer.step(closure)
            else:
                self.optimizer.step()
            self.model.charge_cpu(time.thread_time() - started)
        self.model.after_apply()

    def _finite(self, scaler: Any) -> bool:
        """The scaler's check, as GradScaler.step makes it for an ordinary optimizer: the
        step's gradients unscaled (unless the script did it, to clip), no inf or NaN."""
        from torch.amp.grad_scaler import OptState

        state = scaler._per_optimizer_states[id(self)]
        if state["stage"] is OptState.READY:
            scaler.unscale_(self)
        found = sum(float(v.item()) for v in state["found_inf_per_device"].values())
        return found == 0.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As the inner optimizer's: between micro-batches of a step ``.grad`` is empty
        anyway (the sums are kept apart: chameleon_runtime.buckets)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"ElasticOptimizer({self.optimizer!r})"
