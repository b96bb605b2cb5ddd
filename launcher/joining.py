"""How an agent joins its job (mixed into ``launcher.agent.Agent``): where the control
store is, the rendezvous of several nodes (``_join_job``, ``_world``) and the shortcut
of one node, which needs none (``_start_single_node``)."""

from __future__ import annotations

import socket
import time

from launcher.leader import record_missing_nodes
from launcher.local import LocalGroup
from launcher.rendezvous import (
    RUN_ID_KEY,
    ControlPlane,
    NodeInfo,
    RendezvousError,
    World,
    control_endpoint,
    node_key,
)
from launcher.store import (
    StoreError,
    bind_listener,
    host_store,
    is_loopback,
    put_json,
    serve_store,
)

# Workers of a failed round are useless (their collectives are broken): give them a short
# grace to flush, not the full shutdown timeout.
RESTART_GRACE_S = 2.0


class JobError(RuntimeError):
    """The job could not be set up or lost its control plane; ``str()`` is one line."""


class JoiningMixin:
    """Mixed into ``Agent``, whose state it reads and sets."""

    def _control_endpoint(self) -> tuple[str, int, bool | None]:
        try:
            return control_endpoint(self.args)
        except RendezvousError as exc:
            raise JobError(str(exc)) from None

    def _emit_start(self, control: ControlPlane) -> None:
        a = self.args
        self.events.emit(
            "start",
            run_id=self.run_id,
            leader=control.is_leader,
            control=control.endpoint,
            nnodes=f"{a.min_nodes}:{a.max_nodes}",
            nproc_per_node=a.nproc_per_node,
            command=self.command,
            run_dir=str(self.run_dir),
        )

    def _join_job(self) -> ControlPlane:
        if self.args.rdzv_backend == "etcd":
            return self._join_etcd()
        addr, port, want_leader = self._control_endpoint()
        try:
            control = ControlPlane.open(
                run_id=self.run_id,
                addr=addr,
                port=port,
                want_leader=want_leader,
                timeout_s=float(self.args.rdzv_conf.get("join_timeout", 600)),
                seal=self.seal,
            )
        except (StoreError, RendezvousError) as exc:
            raise JobError(str(exc)) from None
        self._emit_start(control)
        return control

    def _join_etcd(self) -> ControlPlane:
        from launcher.etcd import parse_endpoints
        from launcher.etcd_control import EtcdControlPlane

        a = self.args
        try:
            control = EtcdControlPlane.open(
                run_id=self.run_id,
                endpoints=a.rdzv_endpoint,
                ttl_s=a.heartbeat_timeout_s,
                timeout_s=float(a.rdzv_conf.get("join_timeout", 600)),
                # Each round's worker store: on loopback unless told this node's address.
                worker_host=a.local_addr or "127.0.0.1",
                seal=self.seal,
            )
        except (StoreError, RendezvousError) as exc:
            raise JobError(str(exc)) from None
        if a.local_addr is None and any(
            not is_loopback(h) for h, _ in parse_endpoints(a.rdzv_endpoint)
        ):
            self.console.say(
                "chameleon: this node serves worker stores on 127.0.0.1 when it leads; "
                "pass --local-addr for a job across hosts"
            )
        self._emit_start(control)
        return control

    def _start_single_node(self) -> tuple[ControlPlane, tuple[World, LocalGroup]]:
        """One node needs no rendezvous: bind both stores' sockets in plain Python, then
        import torch and serve the stores while the workers' imports (fresh workers) or
        the fork server's (warm ones) take seconds; store clients wait in the backlog."""
        addr, port, _ = self._control_endpoint()
        try:
            control_socket = bind_listener(addr, port)
            worker_socket = bind_listener(addr, 0)
        except StoreError as exc:
            raise JobError(str(exc)) from None
        bound, control_port = control_socket.getsockname()[:2]
        worker_port = worker_socket.getsockname()[1]
        key = node_key()
        host = self.args.local_addr or socket.gethostname()
        world = World(0, (NodeInfo(key, 0, self.args.nproc_per_node, host, 0),), bound, worker_port)
        # Fresh workers start now and import torch while we do; forks of the warm server
        # start once it is ready, and the server's imports overlap ours instead.
        group = None if self.forkserver is not None else self._start_group(world, world.nodes[0])
        timeout = float(self.args.rdzv_conf.get("join_timeout", 600))
        try:
            store = serve_store(control_socket, timeout_s=timeout)
            self.worker_store = serve_store(worker_socket, timeout_s=timeout)
        except StoreError as exc:
            if group is not None:
                group.stop(grace_s=RESTART_GRACE_S)
            raise JobError(str(exc)) from None
        if group is None:
            group = self._start_group(world, world.nodes[0])
        put_json(store, RUN_ID_KEY, self.run_id)
        control = ControlPlane(
            store,
            self.run_id,
            key,
            is_leader=True,
            addr=bound,
            port=control_port,
            seal=self.seal,
        )
        control.join(0, node_rank=0, nproc=self.args.nproc_per_node, host=host)
        control.put("r0/world", world.to_json())
        self._last_world = world
        self._emit_start(control)
        self.events.emit(
            "round_started",
            attempt=0,
            world_size=world.world_size,
            nodes=1,
            worker_store=f"{bound}:{worker_port}",
        )
        self.events.emit("workers_started", **group.started)
        return control, (world, group)

    def _world(self, control: ControlPlane, attempt: int) -> World | None:
        a = self.args
        timeout = float(a.rdzv_conf.get("join_timeout", 600))
        if not control.is_leader and control.elected:
            world = self._follow(control, attempt, timeout)
            if world is not None or not control.is_leader:
                self._last_world = world or self._last_world
                return world
        if control.is_leader:
            # A fresh store for this attempt's workers (see launcher/store.py for why).
            self.worker_store = host_store(control.worker_host, 0, timeout_s=timeout)
            try:
                world = control.form_world(
                    attempt,
                    min_nodes=a.min_nodes,
                    max_nodes=a.max_nodes,
                    static_ranks=a.rdzv_backend == "static" and not a.standalone,
                    worker_addr=control.worker_host,
                    worker_port=self.worker_store.port,
                    last_call_s=float(a.rdzv_conf.get("last_call_timeout", 1.0)),
                    timeout_s=timeout,
                )
            except RendezvousError as exc:
                raise JobError(str(exc)) from None
            record_missing_nodes(self, self._last_world, world)
            self._last_world = world
            return world
        try:
            return control.wait_world(attempt, timeout, stop=lambda: self._signal is not None)
        except RendezvousError as exc:
            raise JobError(str(exc)) from None

    def _follow(self, control: ControlPlane, attempt: int, timeout: float) -> World | None:
        """An elected control plane's follower: wait for the round's world; when the
        leader goes first (its lease expired), campaign, and form the world if we won."""
        deadline = time.monotonic() + timeout

        def stop() -> bool:
            return self._signal is not None or control.leader() is None

        while True:
            try:
                world = control.wait_world(
                    attempt,
                    max(0.0, deadline - time.monotonic()),
                    stop=stop,
                )
            except (RendezvousError, StoreError) as exc:
                raise JobError(str(exc)) from None
            if world is not None or self._signal is not None:
                return world
            if control.campaign():
                self.events.emit("leader_elected", attempt=attempt, key=control.key)
                return None
