"""What the members of the drop-in data-parallel API exchange at each step besides the
gradients (chameleon_runtime.dataparallel), in one small all-reduce before the commit:

- **Which parameters got a gradient anywhere** (``find_unused_parameters=True``, as DDP's):
  a parameter no member's backward reached keeps ``.grad`` None, so the optimizer leaves
  it alone (no weight decay, no momentum), as DDP leaves it. Without the flag a parameter
  with no gradient on this worker is an error naming it, as under DDP.
- **The buffers** (BatchNorm's running statistics; DDP's ``broadcast_buffers``): after a
  step every replica holds what the forwards of micro-batch 0 left, on the member that
  computed it (DDP broadcasts rank 0's, which computed exactly that micro-batch). The
  holder contributes its buffers, every other member zeros, so the sum is the holder's
  values to the bit; a step whose deal changed (a recovery) still ends with the same
  buffers. Only the buffers a state dict holds travel: those a model registers as not
  persistent are caches of constants (a causal mask, GPT-2's ``masked_bias``, Llama's
  ``inv_freq``), and sending them made every Hugging Face model pay a second all-reduce
  a step (about 10% of examples/train_hf.py's failure-free step, measured). Nor do
  boolean ones (masks).

Both travel as float64 (exact for every float and for integers below 2**53). The
exchange ends before the commit is posted, so a member that rolls a step forward after
a recovery has seen it too. Models with neither need no exchange.

Then the commit itself (chameleon_runtime.elastic's module doc), one more small sum: every
member's 1, its step and the step's square, so that members that would commit different
steps are told apart and stop instead of applying either.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# The commit's step number is sent modulo this (its square must stay exact in float64
# summed over thousands of members); members a multiple of it apart are not told apart.
STEP_MODULUS = 1 << 16

Sum = Callable[[torch.Tensor], None]  # an all-reduce over the members, in place


class StepMeta:
    def __init__(self, module: nn.Module, params: list[nn.Parameter], *, find_unused: bool) -> None:
        self.params = params
        self.find_unused = find_unused
        saved = set(module.state_dict(keep_vars=True))
        self.buffers = [
            b for name, b in module.named_buffers() if name in saved and b.dtype != torch.bool
        ]
        self._buffer_numel = sum(b.numel() for b in self.buffers)
        self.committed: torch.Tensor | None = None  # the buffers as the last step left them
        # -- the step in progress
        self.ran_first = False  # this worker ran micro-batch 0 of the step
        self._snapshot: torch.Tensor | None = None  # the buffers micro-batch 0 left
        self._stale = False  # a stale deal's forwards ran since the buffers were put back
        self._pending: torch.Tensor | None = None  # the exchange's buffers, until the commit
        self._unused: list[nn.Parameter] = []  # the exchange's: no member's gradient

    # -- the step's micro-batches on this worker

    def begin_step(self) -> None:
        if self._stale:  # a stale deal's forwards moved the buffers: undone
            self.restore()
            self._stale = False
        self.ran_first = False
        self._snapshot = None

    def stale_forward(self) -> None:
        self._stale = True

    def micro_batch(self, first: bool) -> None:
        """One of this worker's micro-batches of the step begins (``first``: micro-batch 0)."""
        if self.ran_first and self._snapshot is None and self.buffers:
            # The buffers micro-batch 0's forwards left, before this worker's next
            # micro-batches of the step move them again.
            self._snapshot = self.flat_buffers()
        if first:
            self.ran_first = True

    # -- the exchange and the commit

    def exchange(self, used: set[nn.Parameter], allreduce: Sum) -> None:
        """This step's metadata summed over the members (module doc); a failure of the
        all-reduce is the caller's."""
        self._unused, self._pending = [], None
        if not self.needed:
            return
        source = None
        if self.ran_first:
            source = self._snapshot if self._snapshot is not None else self.flat_buffers()
        mine = self.pack(used, source)
        allreduce(mine)
        self._unused, self._pending = self.unpack(mine)

    def commit(self, step: int, allreduce: Sum, who: str, *, stop_asked: bool = False) -> bool:
        """The commit's all-reduce (module doc); raises when the members' steps differ.
        ``who``: this member, for the message. ``stop_asked``: this member heard a
        preemption notice; returns whether any member did, which every member that sees
        the commit end learns at the same step (chameleon_runtime.preemption)."""
        s = float(step % STEP_MODULUS)
        record = torch.tensor([1.0, s, s * s, float(stop_asked)], dtype=torch.float64)
        allreduce(record)
        count, total, squares, asked = record.tolist()
        if total != count * s or squares != count * s * s:
            raise RuntimeError(
                f"chameleon: the {int(count)} members of {who} disagree on the step they "
                f"commit (this one is at step {step}, the mean of theirs is "
                f"{total / max(count, 1):.2f} mod {STEP_MODULUS}): stopped before applying it"
            )
        return asked > 0

    def committed_step(self) -> list[nn.Parameter]:
        """The step holds: its buffers are installed; returns the parameters no member
        gave a gradient (their .grad is dropped)."""
        if self._pending is not None:
            self.install(self._pending)
        unused, self._unused, self._pending = self._unused, [], None
        return unused

    def abandon_step(self) -> None:
        """The step is redone: what its exchange said no longer holds."""
        self._unused, self._pending = [], None

    @property
    def needed(self) -> bool:
        return self.find_unused or bool(self.buffers)

    def flat_buffers(self) -> torch.Tensor:
        if not self.buffers:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat([b.detach().reshape(-1).to("cpu", torch.float64) for b in self.buffers])

    def pack(self, used: set[nn.Parameter], buffers: torch.Tensor | None) -> torch.Tensor:
        """This member's share: a 1 per parameter it gave a gradient (with the flag), and
        the buffers when it holds micro-batch 0 (else zeros)."""
        n_used = len(self.params) if self.find_unused else 0
        out = torch.zeros(n_used + self._buffer_numel, dtype=torch.float64)
        if n_used:
            out[:n_used] = torch.tensor(
                [float(p in used) for p in self.params], dtype=torch.float64
            )
        if buffers is not None and self._buffer_numel:
            out[n_used:] = buffers
        return out

    def unpack(self, summed: torch.Tensor) -> tuple[list[nn.Parameter], torch.Tensor | None]:
        """The parameters no member gave a gradient, and the buffers the step leaves (to
        ``install`` once the step commits: until then it may still be redone)."""
        n_used = len(self.params) if self.find_unused else 0
        counts = summed[:n_used].tolist()
        unused = [p for p, c in zip(self.params, counts, strict=True) if c == 0] if n_used else []
        return unused, (summed[n_used:].clone() if self._buffer_numel else None)

    def install(self, flat: torch.Tensor) -> None:
        """Set the buffers from ``flat`` (float64) and keep it as the committed copy, which
        an abandoned step's forwards are undone to (``restore``)."""
        offset = 0
        with torch.no_grad():
            for b in self.buffers:
                n = b.numel()
                b.copy_(flat[offset : offset + n].view(b.shape).to(b.dtype))
                offset += n
        self.committed = flat

    def restore(self) -> None:
        """A step was abandoned: its forwards' updates to the buffers are undone, so the
        step redone starts from the buffers of the last commit."""
        if self.committed is not None and self._buffer_numel:
            self.install(self.committed)
