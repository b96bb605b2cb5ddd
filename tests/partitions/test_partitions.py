"""Network partitions: three nodes in namespaces of this machine (tests/netns.py), two
workers each, one node's link cut mid-run. The side that keeps the control store and the
majority recovers in place and ends with the failure-free weights; the cut-off side stops
training, writes nothing once it has lost its lease (its workers' own step log, and the
control store), and exits 3 with a clear message. After the cut heals, a node started
there again joins as a replacement of the lost one, in place."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests import references
from tests.clock import budget
from tests.launcher.helpers import (
    ask_for_stacks,
    chameleon_cmd,
    env,
    events,
    freeze,
    leftovers,
    node_processes,
    running,
    wait_for_event,
)
from tests.runtime.test_liveness import MLP
from tests.runtime.test_recovery import dumps

pytestmark = pytest.mark.slow

STEPS = 150
LEASE_S = 3.0  # --heartbeat-timeout
# Job(hold=True): the step the workers wait at until the node started again has its
# worker up (what the test checks of it; it is then taken in, or the job ends with it a
# spare: a take-in needs the members training, it aborts their generation)
HOLD_STEP = 100


class Job:
    """Agents of one job in the namespaces of ``net``; agent ``i`` logs to n<i>.*."""

    def __init__(self, tmp: Path, net, flags: list[str], *, hold: bool = False) -> None:
        self.tmp, self.net, self.flags = tmp, net, flags
        self.procs: dict[str, subprocess.Popen] = {}
        # hold: the workers wait before step HOLD_STEP until ``go`` exists (``partition``:
        # the node started again after the heal must be taken in, and with a core busy
        # the job had ended before its agent was up)
        self.go = tmp / "go" if hold else None
        if hold:
            self.flags = [*flags, "--step-timeout", "300"]  # (a held step is not a hang)

    def start(self, node: int, name: str) -> subprocess.Popen:
        argv = chameleon_cmd(
            "run", "--nproc-per-node", "2", "--heartbeat-timeout", f"{LEASE_S:g}",
            "--local-addr", self.net.ip(node), *self.flags,
            # --nnodes 2:3 closes the round a second after two agents joined (our default):
            # on a loaded host the third came later (seen in CI), the first round had two
            # nodes, and the third's arrival restarted the job to grow. The round closes
            # as soon as all three are in, so the long call costs nothing otherwise.
            "--rdzv-conf", "last_call_timeout=30",
            "--events", str(self.tmp / f"{name}.jsonl"),
            MLP, "--steps", str(STEPS), "--stages", "1", "--dump", str(self.tmp / "dump"),
        )  # fmt: skip
        out = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115 - the process owns it
        extra = {
            "MLP_STEP_SLEEP_S": "0.1",
            "MLP_STEP_LOG": str(self.tmp / "steps"),
            "GLOO_SOCKET_IFNAME": "eth0",  # the namespace's own link
        }
        if self.go is not None:
            extra["MLP_HOLD"] = f"{HOLD_STEP}:{self.go}"
        self.procs[name] = subprocess.Popen(
            self.net.command(node, argv), cwd=self.tmp, env={**env(), **extra},
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        return self.procs[name]

    def start_all(self, nodes: int) -> None:
        """Agents n0..n<nodes-1>, node 0 first (it hosts the c10d endpoint, or starts the
        etcd incarnation and leads it)."""
        for i in range(nodes):
            self.start(i, f"n{i}")
            if i == 0:  # up before the others start
                wait_for_event(self.tmp / "n0.jsonl", "start", timeout=60)

    def events(self, name: str) -> list[dict]:
        return events(self.tmp / f"{name}.jsonl")

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()[-2500:]

    def top_step(self) -> int:
        return max(
            (e["step"] for n in self.procs for e in self.events(n) if e["event"] == "step"),
            default=-1,
        )

    def wait_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + budget(timeout)
        while self.top_step() < step:
            assert time.monotonic() < deadline, f"no step {step}"
            assert all(p.poll() is None for p in self.procs.values()), {
                n: self.log(n) for n, p in self.procs.items() if p.poll() is not None
            }
            time.sleep(0.05)

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def pids_of(job: Job, name: str) -> set[int]:
    started = [e for e in job.events(name) if e["event"] == "workers_started"]
    return set(started[0]["pids"])


def writes(tmp: Path, pids: set[int]) -> list[tuple[float, int]]:
    """What the workers ``pids`` wrote to their step log: (when, step) of each step."""
    done = []
    for path in tmp.glob("steps.rank*"):
        for line in path.read_text().splitlines():
            pid, step, at = line.split()
            if int(pid) in pids:
                done.append((float(at), int(step)))
    return sorted(done)


def logged_since(tmp: Path, pids: set[int], t: float) -> tuple[int, list[int]]:
    """The last step the workers ``pids`` logged before ``t`` (-1: none), and each step
    they logged from ``t`` on."""
    done = writes(tmp, pids)
    return max((s for at, s in done if at < t), default=-1), [s for at, s in done if at >= t]


def why(evs: list[dict]) -> str:
    """What a failed assertion on the rounds shows: the recoveries' events, one JSON line
    each (a string, so pytest prints every reason in full instead of eliding them)."""
    kinds = ("failure", "abort", "decision", "restart", "recovered", "straggler", "fenced")
    kinds += ("workers_started", "lease_lost", "node_lost", "exit")
    return "\n" + "\n".join(
        json.dumps({k: v for k, v in e.items() if k not in ("plan", "pids")}, default=str)
        for e in evs
        if e["event"] in kinds
    )


def partition(
    tmp_path, job: Job, cut: int, reference: dict, fenced_line: str, *, fenced_by_clock: bool
) -> None:
    """Cut node ``cut`` at step 20; the rest goes on; heal it, start a node there again."""
    names = ["n0", "n1", "n2"]
    others = [n for i, n in enumerate(names) if i != cut]
    job.wait_step(20)
    cut_pids = pids_of(job, names[cut])
    job.net.cut(cut)
    cut_at = time.time()
    top = job.top_step()
    stopped_in = None
    if fenced_by_clock:  # (c10d: its own clock; etcd: once etcd answers, after the heal)
        # Stopped while still cut off: by its own clock, not by anything the heal brings.
        # How soon is a load figure (seen: 2.5 s idle, 9 s in a loaded CI run), so it is
        # printed, not bounded; what the lease promises is asserted below: nothing
        # written past it.
        deadline = time.monotonic() + budget(60)
        while any(running(p) for p in cut_pids):
            if time.monotonic() > deadline:
                # where each of its threads waits: in the log, with its events
                ask_for_stacks(job.procs[names[cut]].pid)
                raise AssertionError(
                    "the cut-off workers were not stopped while cut off"
                    + why(job.events(names[cut]))
                    + "\nits agent's log:\n"
                    + (job.tmp / f"{names[cut]}.log").read_text()[-12000:]
                )
            time.sleep(0.05)
        stopped_in = time.time() - cut_at
    deadline = time.monotonic() + budget(120)
    while job.top_step() < top + 10:  # the majority trains on without it
        assert time.monotonic() < deadline, "the majority did not go on"
        assert all(job.procs[n].poll() is None for n in others), {n: job.log(n) for n in others}
        time.sleep(0.1)
    job.net.heal(cut)
    healed_at = time.time()
    code = job.procs[names[cut]].wait(timeout=budget(60))
    ended = [e["t"] for e in job.events(names[cut]) if e["event"] == "exit"]
    gone_after = (ended[0] if ended else time.time()) - cut_at
    assert code == 3, job.log(names[cut])
    assert fenced_line in job.log(names[cut])
    # The cut-off side wrote nothing once its lease (counted from the cut) was over: on
    # c10d at all (it fenced itself by its own clock, while still cut off); on etcd not
    # while cut off. It learns its lease is gone only once etcd answers again, after the
    # heal, and in between the step in flight at the cut may complete, its peers' packets
    # delivered late (seen: the leader's node, 0.3 s after the heal). That step is one
    # the majority did again from the same weights (it resumed there): the cut-off side
    # did not train on alone.
    late = [(at, step) for at, step in writes(tmp_path, cut_pids) if at >= cut_at + LEASE_S]
    if fenced_by_clock:
        assert late == []
    else:
        assert all(at >= healed_at for at, _step in late), (late, healed_at)
        resumed = [
            e["resume_step"] for n in others for e in job.events(n)
            if e["event"] == "recovered" and e["t"] > cut_at
        ]  # fmt: skip
        assert resumed, "the majority did not recover in place" + why(job.events(others[0]))
        assert all(step <= min(resumed) for _at, step in late), (late, resumed)
    again = job.start(cut, "again")
    if job.go is not None:
        try:
            wait_for_event(job.tmp / "again.jsonl", "worker_respawned", timeout=60)
        finally:
            job.go.touch()
    codes = [job.procs[n].wait(timeout=budget(180)) for n in others] + [
        again.wait(timeout=budget(60))
    ]
    assert codes == [0, 0, 0], {n: job.log(n) for n in [*others, "again"]}
    evs = [e for n in [*others, "again"] for e in job.events(n)]
    assert [e for e in evs if e["event"] == "recovered"], "not recovered in place"
    adopted = [e for e in evs if e["event"] == "node_adopted"]
    # (by host: ``node`` is the node's rank in the round, which the order the agents
    # joined in gives, not the namespace's number)
    assert len(adopted) == 1 and adopted[0]["lost_host"] == job.net.ip(cut)
    assert [e["attempt"] for e in evs if e["event"] == "workers_started"] == [0, 0, 0], why(evs)
    assert [e for e in job.events("again") if e["event"] == "worker_respawned"]
    checks, _losses = dumps(tmp_path)
    for layer, values in reference.items():
        assert checks[layer] and all(v == pytest.approx(values[0], rel=1e-5) for v in checks[layer])
    assert [p for p in leftovers(tmp_path) if p.name() != "etcd"] == []
    stopped = "" if stopped_in is None else f"its workers stopped {stopped_in:.1f} s, "
    print(f"node {cut} cut: {stopped}its agent gone {gone_after:.1f} s later (lease {LEASE_S:g} s)")


@pytest.mark.timeout(120)  # 30 s measured
def test_a_node_cut_off_from_the_c10d_store_fences_itself_and_the_rest_go_on(tmp_path, net):
    reference = references.mlp(workers=4, steps=STEPS)
    n = net(3)
    port = 29400
    job = Job(
        tmp_path, n,
        ["--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{n.ip(0)}:{port}",
         "--rdzv-id", "part"],
        hold=True,
    )  # fmt: skip
    try:
        job.start_all(3)
        partition(
            tmp_path, job, 2, reference, "fenced: cut off from the control store",
            fenced_by_clock=True,
        )  # fmt: skip
    finally:
        job.kill_all()


def etcd_partition(tmp_path, net, cut: int) -> Job:
    """``partition`` of node ``cut`` on etcd (three members on the hub); the job, for what
    the test checks after."""
    from tests.etcd.cluster import etcd_binary, start_cluster

    if etcd_binary() is None:
        pytest.skip("no etcd on PATH (scripts/install.sh installs Debian's etcd-server)")
    reference = references.mlp(workers=4, steps=STEPS)
    n = net(3)
    etcd = start_cluster(tmp_path / "etcd", host=n.hub)
    job = Job(
        tmp_path, n,
        ["--nnodes", "2:3", "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints,
         "--rdzv-id", "part"],
        hold=True,
    )  # fmt: skip
    try:
        job.start_all(3)
        partition(
            tmp_path, job, cut, reference, "fenced: this agent's etcd lease ran out",
            fenced_by_clock=False,
        )  # fmt: skip
    finally:
        job.kill_all()
        etcd.stop()
    return job


# (scripts/soak.sh: an etcd node cut off and fenced is in CI as the leader's, below, which
# is this and an election)
@pytest.mark.soak
@pytest.mark.timeout(120)  # 33 s measured
def test_a_node_cut_off_from_etcd_and_the_others_fences_itself_once_it_is_back(tmp_path, net):
    # On etcd the cut-off side cannot tell a cut from an outage of etcd, so it waits (its
    # workers cannot train: their peers are across the cut) until etcd answers again and
    # says its lease is gone.
    etcd_partition(tmp_path, net, 2)


@pytest.mark.timeout(120)  # 34 s measured
def test_the_leaders_node_cut_off_on_etcd_fences_itself_and_a_new_leader_goes_on(tmp_path, net):
    # Node 0 leads and hosts the worker store every worker and agent is connected to. A
    # new leader is elected once its lease runs out and serves a new store; every
    # connection to the old one, silent across the cut, fails at its deadline
    # (chameleon_runtime/protocol/link.py) and moves there.
    job = etcd_partition(tmp_path, net, 0)
    elected = [
        e for name in ("n1", "n2") for e in job.events(name) if e["event"] == "leader_elected"
    ]
    assert len(elected) == 1


@pytest.mark.timeout(120)  # 29 s measured; 35 s with a core busy
def test_a_frozen_node_on_c10d_fences_itself_when_resumed(tmp_path, net):
    # Its agent and workers stopped (SIGSTOP) for three leases: the others count it lost
    # and go on; resumed, its lease watch finds no beat went through for the lease, and
    # it kills its workers before they act on the generation the others left.
    reference = references.mlp(workers=4, steps=STEPS)
    n = net(3)
    job = Job(
        tmp_path, n,
        ["--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{n.ip(0)}:29400",
         "--rdzv-id", "frozen"],
    )  # fmt: skip
    try:
        job.start_all(3)
        job.wait_step(20)
        workers = pids_of(job, "n2")
        frozen_at = freeze(node_processes(job.procs["n2"].pid, workers), 3 * LEASE_S)
        resumed = time.time()
        code = job.procs["n2"].wait(timeout=budget(30))
        gone_in = time.time() - resumed
        assert code == 3, job.log("n2")
        assert "fenced: cut off from the control store" in job.log("n2")
        # Nothing trained after the freeze: a step whose collectives had completed as it
        # was stopped may be logged once it runs again (CI with a core busy: rank 3 logged
        # step 28 on resuming, its peer rank 2 had logged it before the freeze), one line
        # per worker at most, and never a step after it.
        reached, since = logged_since(tmp_path, workers, frozen_at)
        assert len(since) <= len(workers) and all(s <= reached + 1 for s in since), (
            reached, since)  # fmt: skip
        codes = [job.procs[name].wait(timeout=budget(180)) for name in ("n0", "n1")]
        assert codes == [0, 0], {name: job.log(name) for name in ("n0", "n1")}
        evs = [e for name in ("n0", "n1") for e in job.events(name)]
        assert [e for e in evs if e["event"] == "recovered"], "not recovered in place"
        assert [e["attempt"] for e in evs if e["event"] == "workers_started"] == [0, 0], why(evs)
        checks, _losses = dumps(tmp_path)
        for layer, values in reference.items():
            assert checks[layer] and all(
                v == pytest.approx(values[0], rel=1e-5) for v in checks[layer]
            )
        assert [p for p in leftovers(tmp_path) if p.name() != "etcd"] == []
        print(f"resumed -> fenced and gone in {gone_in:.2f} s")
    finally:
        job.kill_all()
