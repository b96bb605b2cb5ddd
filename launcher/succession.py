"""Leaders that follow one another within a round (``--rdzv-backend etcd``), mixed into
``launcher.agent.Agent``: the election of a successor when the leader's lease runs out,
the new worker store it serves, and every agent pointing its workers there.

The round's workers meet on a store the leader hosts; when its node is lost, so is the
store. The successor serves a new one and publishes its address under ``r<a>/
worker_store`` with the next epoch; each agent (the successor too) writes it to its
workers' store file (chameleon_runtime.storeaddr), where their connections look when the
old store stops answering, and reads its workers' statuses there. With the old leader's
snapshot (launcher/coordinator.py, Coordinator.snapshot) the successor recovers in place; without one it decides
as the old leader would have, which for a lost node is a restart.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from chameleon_runtime.protocol.messages import StoreAddress
from launcher.leader import Leader
from launcher.settings import STORE_FILE
from launcher.store import host_store

if TYPE_CHECKING:
    from launcher.local import LocalGroup
    from launcher.rendezvous import ControlPlane, World


class SuccessionMixin:
    """Mixed into ``Agent``, whose state it reads and sets."""

    _store_epoch = 0  # the epoch of the worker store this node's workers were told of

    @property
    def store_file(self) -> Path:
        return self.run_dir / STORE_FILE

    def _new_round_store(self) -> None:
        """A round starts on the leader's store (epoch 0): forget the last round's move."""
        self._store_epoch = 0
        self.store_file.unlink(missing_ok=True)

    def _follow_store(self, control: ControlPlane, world: World, group: LocalGroup) -> None:
        """Point this node's workers at the round's newest worker store."""
        found = control.get(f"r{world.attempt}/worker_store")
        if found is None or found["epoch"] <= self._store_epoch:
            return
        self._store_epoch = found["epoch"]
        address = StoreAddress(addr=found["addr"], port=found["port"], epoch=found["epoch"])
        tmp = self.store_file.with_suffix(".tmp")
        tmp.write_text(address.model_dump_json())
        os.replace(tmp, self.store_file)  # a worker never reads half of it
        group.move_store(found["addr"], found["port"])
        self.events.emit(
            "worker_store_moved",
            attempt=world.attempt,
            addr=found["addr"],
            port=found["port"],
            epoch=found["epoch"],
        )

    def _take_over(self, control: ControlPlane, world: World, group: LocalGroup) -> Leader | None:
        """The leader's lease ran out (its node is lost): campaign. The winner serves a new
        worker store and leads the rest of the round from the old leader's snapshot."""
        if not control.campaign():
            return None
        self.events.emit("leader_elected", attempt=world.attempt, key=control.key)
        attempt = world.attempt
        snapshot = control.get(f"r{attempt}/inplace")
        if snapshot is None:  # nothing to go on from: decide as the old leader would
            return Leader(self, control, world, group)
        timeout = float(self.args.rdzv_conf.get("join_timeout", 600))
        self.worker_store = host_store(control.worker_host, 0, timeout_s=timeout)
        last = control.get(f"r{attempt}/worker_store") or {"epoch": 0}
        control.put(
            f"r{attempt}/worker_store",
            {
                "addr": control.worker_host,
                "port": self.worker_store.port,
                "epoch": max(last["epoch"], self._store_epoch) + 1,
            },
        )
        self._follow_store(control, world, group)
        next_gen = control.get(f"r{attempt}/next_gen") or 0
        return Leader(
            self, control, world, group, takeover={"snapshot": snapshot, "next_gen": next_gen}
        )
