"""Agents of one machine are counted as one host even where each has an address of its
own (network namespaces, containers): they share its cores, which decides whether
--stragglers auto plans around a slow CPU worker (launcher/coordinator.py)."""

from __future__ import annotations

from pathlib import Path

from chameleon_runtime.protocol.seal import Seal
from launcher.leader import _machine
from launcher.rendezvous import ControlPlane, NodeInfo, machine_id


def test_a_world_formed_on_a_real_store_names_each_agents_machine():
    seal = Seal(None, "m")
    lead = ControlPlane.open(
        run_id="m", addr="127.0.0.1", port=0, want_leader=True, timeout_s=5, seal=seal
    )
    other = ControlPlane.open(
        run_id="m", addr="127.0.0.1", port=lead.port, want_leader=False, timeout_s=5, seal=seal
    )
    other.key = "other:1"  # (one process here: the two agents' keys told apart by hand)
    lead.join(0, node_rank=0, nproc=2, host="10.0.0.1")
    other.join(0, node_rank=1, nproc=2, host="10.0.0.2")
    world = lead.form_world(
        0, min_nodes=2, max_nodes=2, static_ranks=False, worker_addr="127.0.0.1",
        worker_port=1, last_call_s=0.0, timeout_s=5,
    )  # fmt: skip
    assert [n.host for n in world.nodes] == ["10.0.0.1", "10.0.0.2"]
    assert {n.machine for n in world.nodes} == {machine_id()} != {""}
    assert {_machine(n) for n in world.nodes} == {machine_id()}


def test_the_boot_id_is_what_namespaces_of_one_kernel_share():
    text = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert machine_id() == text and len(text) == 36


def test_a_node_from_an_older_agent_is_counted_by_its_host():
    old = NodeInfo("k", 0, 2, "10.0.0.9", 0)
    assert _machine(old) == "10.0.0.9"
