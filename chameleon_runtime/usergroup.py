"""The script's own ``torch.distributed``: under ``chameleon run`` the default process
group over the members of the current generation, rebuilt by every recovery; under
torchrun the one its environment describes (``from_torchrun``).

A script ported to the drop-in API (docs/dataparallel.md) no longer calls
``init_process_group``; under torchrun the drop-in initialises the default group from the
environment, and under chameleon run this module does, for each generation, so that the
script's collectives (a metrics all-reduce, a barrier, ``all_gather_object``,
``torch.distributed.checkpoint`` saving and loading) run among the workers that train now:
``dist.get_rank()`` is the member's place among them (lowest global rank first) and
``dist.get_world_size()`` their number. A spare (a worker a plan leaves out) has none.

How: the group is a gloo group built on the generation's helper thread, so that a member
lost while it is built ends the wait at the launcher's abort, as the runtime's own groups
do (chameleon_runtime.comm); it is then installed as the default group through a backend
registered under the name "chameleon" whose constructor hands that group over (torch has
no other public way to install a group built beforehand). gloo takes CPU and CUDA
tensors. Its keys live under the generation's prefix in the worker store, which the
leader deletes with the generation's.

A group the script or the drop-in makes from it (``new_group``: a sharded model's replica
groups, on which its DeviceMesh and so every DTensor collective of the script runs) is
abortable (chameleon_runtime.abortable): its waits end at the generation's abort, so that
a member whose mate left the step for the recovery is not held in a ``clip_grad_norm_``
the mate never joins.

What a failure does to the script's own collective: one that a lost peer interrupts
raises the backend's error in the script, as under torchrun, and that member is lost too
(the launcher sees a peer's error, not the script's: it recovers in place). The drop-in's
step, which the script's collectives usually follow, has recovered by then in nearly
every case.

``is_saver()``: whether this worker is the one to write what one worker writes (a final
save, a log): the lowest-ranked member of the current generation, which survives the loss
of rank 0; rank 0 under torchrun; True alone.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from chameleon_runtime.abortable import AbortableGroup, gloo_group
from chameleon_runtime.comm import OP_TIMEOUT_S, Generation

BACKEND = "chameleon"
_built: list[Any] = []  # the group the next init_process_group installs
_ours = False  # the default group is one this module installed
_generation: list[Generation] = []  # the generation whose groups new_group makes now


def _hand_over(store: Any, rank: int, size: int, timeout: Any) -> Any:
    if _built:  # the generation's default group, built already on its helper
        return _built[0]
    # A group made from the default one (dist.new_group on the default backend): the
    # script's, or a sharded model's replica group.
    if not _generation:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    gen = _generation[0]
    return AbortableGroup(
        gloo_group(store, rank, size, timeout),
        lambda: gen.interrupts.aborted(gen.generation),
        lambda event: gen.interrupts.watch(gen.generation, event),
    )


def install(gen: Generation, store: dist.Store, prefix: str, members: list[int], me: int) -> None:
    """The default group of generation ``gen`` over ``members`` (sorted global ranks)."""
    global _ours
    remove()
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _hand_over, devices=["cpu", "cuda"])
    group_store = dist.PrefixStore(f"{prefix}/user", store)
    index, size = members.index(me), len(members)
    group = gen.call(
        lambda: dist.ProcessGroupGloo(group_store, index, size, timedelta(seconds=OP_TIMEOUT_S)),
        "groups",
    )
    _built[:] = [group]
    # init_process_group wraps sys.excepthook in one that prefixes "[rankN]: " with the
    # group rank: one more wrapper per recovery, each with a stale rank. The launcher
    # prefixes workers' lines already; the hook as it was is put back.
    hook = sys.excepthook
    try:
        dist.init_process_group(
            BACKEND, store=dist.PrefixStore(f"{prefix}/init", store), rank=index, world_size=size
        )
    finally:
        _built.clear()
        sys.excepthook = hook
    _ours = True
    _generation[:] = [gen]


def remove() -> None:
    """Leave the generation's default group (a recovery, the end)."""
    global _ours
    _generation.clear()
    if _ours and dist.is_initialized():
        dist.destroy_process_group()
    _ours = False


def from_torchrun(device: Any) -> bool:
    """Under torchrun: whether there is a default group to sum on (False alone): the
    script's, or one initialised here from torchrun's environment, then destroyed at
    exit. Only the default group is named (group=None), never held: a gloo group still
    referenced when the interpreter ends is destroyed with its threads running, which
    aborted the process ("terminate called without an active exception") in about 1 exit
    of 8 here, plain DDP's included."""
    if dist.is_available() and dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    # On CUDA, NCCL for the gradients and gloo for the small host tensors a step
    # exchanges besides (stepmeta, the commit, the consistency check).
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    ScriptErrors.watch()
    atexit.register(_destroy)
    return True


# How long the last barrier waits for the others to end their scripts: a rank a step or
# two behind, a final save; past it (a peer that hangs) the group is destroyed anyway.
EXIT_BARRIER_S = 60.0


def _destroy() -> None:
    """Every rank past its last collective, then the groups shut down before the
    interpreter ends. A gloo group destroyed while a peer still talks to it aborted the
    process ("terminate called without an active exception": 1 drop-in exit in about
    30 HSDP runs in CI, as plain HSDP did before it waited so). After a script error the
    others may be in a collective this rank never joins: no barrier then."""
    if not dist.is_initialized():
        return
    if not ScriptErrors.raised:
        # gloo's monitored barrier ends its own wait at the timeout (a barrier's work
        # waited on with a timeout would stay queued, and the group's destruction wait
        # for it). A group with NCCL for CUDA tensors refuses it: no barrier there, as
        # before. (A peer gone or hung: what the launcher reports, not this exit.)
        with contextlib.suppress(Exception):
            dist.monitored_barrier(timeout=timedelta(seconds=EXIT_BARRIER_S))
    gc.collect()  # what still holds the group in a reference cycle lets go of it now
    dist.destroy_process_group()


class ScriptErrors:
    """Whether the script raised: an uncaught exception goes through ``sys.excepthook``
    (under plain Python and the warm fork server alike) before the interpreter's exit
    handlers run, which must then neither announce the end of training nor wait for
    the others at a barrier."""

    raised = False
    _installed = False

    @classmethod
    def watch(cls) -> None:
        if cls._installed:
            return
        cls._installed = True
        previous = sys.excepthook

        def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
            cls.raised = True
            previous(kind, value, tb)

        sys.excepthook = hook


def is_saver() -> bool:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    under_chameleon = "CHAMELEON_RUN_DIR" in os.environ and "MASTER_ADDR" in os.environ
    return not under_chameleon and int(os.environ.get("WORLD_SIZE", "1")) <= 1
