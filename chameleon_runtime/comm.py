"""Communication for one plan generation: process groups built straight on the store (no
default group, no collective to create a subgroup), point-to-point transfers with tags,
bucket all-reduces, and waits that can be abandoned.

Why waits run on a helper thread: gloo cannot interrupt a blocked wait. ``abort()`` does not
wake it (tested on torch 2.13: waiters sat out the full group timeout), and a
``wait(timeout)`` that expires closes the gloo pair for good. So the main thread hands each
blocking ``wait()`` to this generation's helper thread and waits on an event, checking the
abort flag every few milliseconds. On abort the helper (and the group) are abandoned —
deliberately leaked, never destroyed: a gloo group's destructor blocks on a silent peer,
and at interpreter exit destroying one whose threads still run aborts the process
("terminate called without an active exception", seen on torch 2.13). The next
generation builds fresh groups under a fresh store prefix.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

ABORT_POLL_S = 0.005


class Aborted(RuntimeError):
    """The launcher (or a failed peer) ended this generation."""


class CommError(RuntimeError):
    """A transfer or collective failed: a peer died or its connection broke."""


_ABANDONED: list[_Helper] = []


def stuck_waits() -> list[str]:
    """Waits of abandoned generations still blocked (each a thread inside gloo)."""
    return [h.busy_with for h in _ABANDONED if h.busy_with is not None]


def _leak(obj: Any) -> None:
    """One reference Python never drops, so the object outlives interpreter teardown."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


class _Helper:
    """One thread that runs blocking ``Work.wait()`` calls, in order."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.busy_with: str | None = None  # what the thread is blocked on, for diagnostics
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        while True:
            work, done, box, what = self._jobs.get()
            self.busy_with = what
            try:
                work.wait()
            except Exception as exc:  # surfaced on the main thread
                box.append(exc)
            self.busy_with = None
            done.set()

    def submit(self, work: Any, what: str) -> tuple[threading.Event, list]:
        done, box = threading.Event(), []
        self._jobs.put((work, done, box, what))
        return done, box


def backend_for(device: str) -> str:
    return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[device]


def _make_group(store: dist.Store, rank: int, size: int, timeout: timedelta, device: str) -> Any:
    if device == "cpu":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if device == "cuda":
        return dist.ProcessGroupNCCL(store, rank, size)
    # Ascend: torch_npu registers ProcessGroupHCCL; imported only when asked for.
    import torch_npu  # noqa: F401

    return torch.distributed.ProcessGroupHCCL(store, rank, size, timeout)  # type: ignore[attr-defined]


class Generation:
    """Groups of one plan generation. ``members`` (global ranks) take part at all:
    the plan's workers plus survivors that only send weights away; ``workers`` run
    steps and get the group for step-wide collectives."""

    def __init__(
        self,
        *,
        store: dist.Store,
        generation: int,
        members: Sequence[int],
        workers: Sequence[int],
        me: int,
        buckets: Sequence[tuple[int, ...]],
        abort: threading.Event,
        key_prefix: str = "chameleon/0/",
        device: str = "cpu",
        timeout_s: float = 120.0,
    ) -> None:
        self.generation = generation
        self.members = list(members)
        self.me = me
        self.abort = abort
        self.device = device
        timeout = timedelta(seconds=timeout_s)
        prefix = f"{key_prefix}gen{generation}"
        self.group = _make_group(
            dist.PrefixStore(f"{prefix}/all", store),
            self.members.index(me),
            len(self.members),
            timeout,
            device,
        )
        self.workers = sorted(workers)
        self.step_group = self.group
        if self.workers != self.members and me in self.workers:
            self.step_group = _make_group(
                dist.PrefixStore(f"{prefix}/workers", store),
                self.workers.index(me),
                len(self.workers),
                timeout,
                device,
            )
        # One group per bucket holder set this worker belongs to; only its members build it.
        self.bucket_groups: dict[tuple[int, ...], Any] = {}
        for holders in buckets:
            if me in holders and holders not in self.bucket_groups and len(holders) > 1:
                key = "-".join(map(str, holders))
                self.bucket_groups[holders] = _make_group(
                    dist.PrefixStore(f"{prefix}/bucket/{key}", store),
                    holders.index(me),
                    len(holders),
                    timeout,
                    device,
                )
        self._helper = _Helper(f"comm-gen{generation}")
        self._pending_sends: list[Any] = []

    def _index(self, rank: int) -> int:
        return self.members.index(rank)

    def wait(self, work: Any, what: str = "?") -> None:
        done, box = self._helper.submit(work, what)
        while not done.wait(ABORT_POLL_S):
            if self.abort.is_set():
                raise Aborted(f"generation {self.generation} aborted")
        if box:
            raise CommError(str(box[0]).splitlines()[0][:300])

    def _post(self, fn: Any, *args: Any) -> Any:
        if self.abort.is_set():
            raise Aborted(f"generation {self.generation} aborted")
        try:
            return fn(*args)
        except Exception as exc:  # a broken pair raises at post time
            raise CommError(str(exc).splitlines()[0][:300]) from None

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """Asynchronous: completes at ``flush_sends`` (the tensor is kept alive till then)."""
        work = self._post(self.group.send, [tensor.contiguous()], self._index(dst), tag)
        self._pending_sends.append((work, tensor))

    def send_quietly(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """Post a send even though the generation is aborted, ignoring errors (a dead
        peer): draining, see chameleon_runtime.step. Kept alive, never waited."""
        try:
            work = self.group.send([tensor.contiguous()], self._index(dst), tag)
        except Exception:
            return
        self._pending_sends.append((work, tensor))

    def recv_quietly(self, buffer: torch.Tensor, src: int, tag: int) -> None:
        """Post a receive that nobody will wait for (draining): it lets the peer's send
        complete. Kept alive, with its buffer."""
        try:
            work = self.group.recv([buffer], self._index(src), tag)
        except Exception:
            return
        self._pending_sends.append((work, buffer))

    def post_recv(self, buffer: torch.Tensor, src: int, tag: int) -> Any:
        return self._post(self.group.recv, [buffer], self._index(src), tag)

    def recv(self, buffer: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        self.wait(self.post_recv(buffer, src, tag), f"recv from {src} tag {tag}")
        return buffer

    def flush_sends(self) -> None:
        pending, self._pending_sends = self._pending_sends, []
        for work, _tensor in pending:
            self.wait(work, "send")

    def allreduce(self, tensor: torch.Tensor, holders: tuple[int, ...] | None = None) -> None:
        """Sum ``tensor`` over a bucket's holders, or over the plan's workers when None."""
        group = self.step_group if holders is None else self.bucket_groups[holders]
        self.wait(self._post(group.allreduce, [tensor]), f"allreduce {holders}")

    def abandon(self) -> None:
        """Drop this generation without destroying anything that might block."""
        if self._helper in _ABANDONED:
            return
        _ABANDONED.append(self._helper)
        for obj in (
            self.group,
            self.step_group,
            *self.bucket_groups.values(),
            self._helper,
            self._pending_sends,
        ):
            _leak(obj)
        self._pending_sends = []
