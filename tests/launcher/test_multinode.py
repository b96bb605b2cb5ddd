"""Several agents on 127.0.0.1, and gloo jobs restarted after a real kill -9."""

import os
import signal
import time

import pytest

from tests import references
from tests.clock import budget
from tests.launcher.helpers import (
    events,
    free_port,
    leftovers,
    lose_node_1,
    run,
    start,
    wait_for_event,
    write,
)

# real processes, seconds each: the full suite (CI) runs them, the fast tier does not
pytestmark = pytest.mark.slow

DDP = """
    import os, sys, time, torch, torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = "ckpt.pt"
    start = torch.load(ckpt)["step"] + 1 if os.path.exists(ckpt) else 0
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(start, int(sys.argv[1])):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        if rank == 0:
            torch.save({"step": step}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        open(f"progress_{rank}", "w").write(str(step))
        time.sleep(0.05)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    open(f"done_{rank}", "w").write(f"{world} {total.item()}")
    dist.destroy_process_group()
    # torch 2.13's gloo can abort at interpreter exit ("terminate called without an active
    # exception", about 1 run in 16 on a loaded 2-core machine, under torchrun as well):
    # leave without running the C++ static destructors.
    os._exit(0)
"""


@pytest.mark.slow
@pytest.mark.timeout(60)  # 6 s measured
def test_gloo_job_restarts_after_external_kill_9(tmp_path):
    # torch 2.13's torchrun fails this: restarted gloo workers dial the dead attempt's
    # addresses (see launcher/store.py). Each attempt gets a fresh store here.
    script = write(tmp_path / "ddp.py", DDP)
    log = tmp_path / "events.jsonl"
    launcher = start(
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--events",
        str(log),
        str(script),
        "60",
        cwd=tmp_path,
        log=tmp_path / "out.log",
    )
    started = wait_for_event(log, "workers_started", attempt=0)
    deadline = time.monotonic() + budget(60)
    while not (tmp_path / "progress_1").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(started["pids"][1], signal.SIGKILL)
    assert launcher.wait(timeout=budget(120)) == 0, (tmp_path / "out.log").read_text()[-2000:]
    attempts = [e["attempt"] for e in events(log) if e["event"] == "workers_started"]
    assert attempts == [0, 1]
    assert (tmp_path / "done_0").read_text() == "2 1.0"
    failure = next(e for e in events(log) if e["event"] == "failure" and e["rank"] == 1)
    assert failure["exit_code"] == -9


@pytest.mark.slow
@pytest.mark.timeout(60)  # 4 s measured
def test_two_static_agents_run_one_ddp_job(tmp_path):
    script = write(tmp_path / "ddp.py", DDP)
    port = free_port()
    common = [
        "run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]
    node1 = start(
        *common, "--node-rank", "1", str(script), "5", cwd=tmp_path, log=tmp_path / "n1.log"
    )
    node0 = run(*common, "--node-rank", "0", str(script), "5", cwd=tmp_path)
    assert node0.returncode == 0, node0.stderr[-2000:]
    assert node1.wait(timeout=budget(60)) == 0
    for rank in range(4):
        assert (tmp_path / f"done_{rank}").read_text() == "4 6.0"  # 0+1+2+3 over 4 ranks


def _free_slurm_job_id() -> str:
    """A job id whose control store port (launcher/scheduler.py: 20000 + id % 10000) is
    free here."""
    import random
    import socket

    while True:
        job = random.randrange(10000, 99999)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 20000 + job % 10000))
            except OSError:
                continue
        return str(job)


def _two_agents(tmp_path, script, envs: list[dict[str, str]], *flags: str):
    """Node 1 in the background, node 0 in the foreground; both exit 0, and every rank of
    the 4 saw the same world."""
    node1 = start(
        "run", *flags, str(script), "5", cwd=tmp_path, log=tmp_path / "n1.log", env=envs[1]
    )
    node0 = run("run", *flags, str(script), "5", cwd=tmp_path, env=envs[0])
    assert node0.returncode == 0, node0.stderr[-2000:]
    assert node1.wait(timeout=budget(60)) == 0, (tmp_path / "n1.log").read_text()[-2000:]
    for rank in range(4):
        assert (tmp_path / f"done_{rank}").read_text() == "4 6.0"  # 0+1+2+3 over 4 ranks
    return node0


@pytest.mark.slow
@pytest.mark.timeout(60)  # 4 s measured
def test_two_agents_under_srun_take_the_rendezvous_from_slurm(tmp_path):
    # What srun gives each task of `srun --nodes 2 --ntasks-per-node 1 chameleon run ...`
    # (the two "hosts" are both this machine's loopback).
    job = _free_slurm_job_id()
    slurm = {
        "SLURM_JOB_ID": job,
        "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS": "2",
        "CHAMELEON_JOB_TOKEN": "t0ken",
    }
    step = {
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "127.0.0.[1-2]",
        "SLURM_STEP_NUM_NODES": "2",
    }
    envs = [{**slurm, **step, "SLURM_NODEID": str(n)} for n in (0, 1)]
    script = write(tmp_path / "ddp.py", DDP)
    node0 = _two_agents(tmp_path, script, envs, "--nproc-per-node", "2")
    assert f"--master-port {20000 + int(job) % 10000} (SLURM_JOB_ID)" in node0.stderr
    assert f"--rdzv-id {job} (SLURM_JOB_ID)" in node0.stderr


@pytest.mark.slow
@pytest.mark.timeout(60)  # 4 s measured
def test_two_agents_configured_as_a_pytorchjob_does_form_one_job(tmp_path):
    # Kubeflow's elastic PyTorchJob: the same PET_* variables in every pod, no flags.
    port = free_port()
    pet = {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "2",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}",
        "PET_RDZV_ID": "pytorchjob-7",
        "CHAMELEON_JOB_TOKEN": "t0ken",
    }
    script = write(tmp_path / "ddp.py", DDP)
    node0 = _two_agents(tmp_path, script, [pet, pet])
    assert "--rdzv-backend c10d (PET_RDZV_BACKEND)" in node0.stderr


SLEEPER = """
    import os, sys, time
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    open(f"ran_{attempt}_{os.environ['RANK']}_of_{os.environ['WORLD_SIZE']}", "w").close()
    time.sleep(60 if attempt == 0 else 0.5)
"""


@pytest.mark.slow
@pytest.mark.timeout(60)  # 8 s measured
def test_lost_node_is_detected_and_the_job_shrinks(tmp_path):
    script = write(tmp_path / "sleeper.py", SLEEPER)
    endpoint = f"127.0.0.1:{free_port()}"
    common = [
        "run",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "shrink",
        "--max-restarts",
        "1",
        "--heartbeat-timeout",
        "2",
    ]
    log0 = tmp_path / "events0.jsonl"
    node0 = start(
        *common, "--events", str(log0), str(script), cwd=tmp_path, log=tmp_path / "n0.log"
    )
    wait_for_event(log0, "start")  # node 0 binds the endpoint: it leads
    node1 = start(
        *common,
        "--events",
        str(tmp_path / "events1.jsonl"),
        str(script),
        cwd=tmp_path,
        log=tmp_path / "n1.log",
    )
    wait_for_event(log0, "round_started", world_size=4)
    wait_for_event(tmp_path / "events1.jsonl", "workers_started")
    node1.kill()
    assert node0.wait(timeout=budget(60)) == 0, (tmp_path / "n0.log").read_text()[-2000:]
    lost = wait_for_event(log0, "node_lost")
    assert lost["node"] == 1 and lost["silent_s"] >= 2
    # When node 0 starts its first round alone, node 1's arrival is a restart first
    # ("grow to 2", not counted against --max-restarts): the shrink is the one after.
    decision = next(
        e
        for e in events(log0)
        if e["event"] == "decision" and e["action"] == "restart" and e["t"] >= lost["t"]
    )
    assert "shrink to 1 node" in decision["reason"]
    shrunk = decision["attempt"] + 1
    assert (tmp_path / f"ran_{shrunk}_0_of_2").exists()
    assert (tmp_path / f"ran_{shrunk}_1_of_2").exists()


@pytest.mark.slow
@pytest.mark.timeout(60)  # 3 s measured
def test_an_agent_of_another_run_id_is_refused(tmp_path):
    script = write(tmp_path / "sleeper.py", "import time; time.sleep(20)\n")
    endpoint = f"127.0.0.1:{free_port()}"
    common = [
        "run",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
    ]
    host = start(
        *common, "--rdzv-id", "alpha", "--events", str(tmp_path / "a.jsonl"), str(script),
        cwd=tmp_path, log=tmp_path / "a.log",
    )  # fmt: skip
    try:
        wait_for_event(tmp_path / "a.jsonl", "start")  # the job's store is up
        intruder = run(
            *common,
            "--rdzv-id",
            "beta",
            "--rdzv-conf",
            "join_timeout=5",
            str(script),
            cwd=tmp_path,
            timeout=budget(60),
        )
        assert intruder.returncode == 1
        assert "has run id 'alpha', not 'beta': refused" in intruder.stderr
    finally:
        host.kill()
        host.wait()


@pytest.mark.timeout(60)  # 4 s measured
def test_an_agent_with_another_token_or_none_is_refused(tmp_path):
    script = write(tmp_path / "sleeper.py", "import time; time.sleep(20)\n")
    endpoint = f"127.0.0.1:{free_port()}"
    common = ["run", "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", endpoint, "--rdzv-id", "alpha"]  # fmt: skip
    host = start(
        *common, "--events", str(tmp_path / "a.jsonl"), str(script), cwd=tmp_path,
        log=tmp_path / "a.log", env={"CHAMELEON_JOB_TOKEN": "right"},
    )  # fmt: skip
    try:
        wait_for_event(tmp_path / "a.jsonl", "start")  # the job's store is up
        for conf, why in (
            ("join_timeout=5,token=wrong", "is signed with another job token: refused"),
            ("join_timeout=5", "needs its job token"),
        ):
            intruder = run(*common, "--rdzv-conf", conf, str(script), cwd=tmp_path, timeout=60)
            assert intruder.returncode == 1
            assert f"the job at {endpoint} {why}" in intruder.stderr, intruder.stderr
    finally:
        host.kill()
        host.wait()


# (scripts/soak.sh: a lost node recovered in place and the job's exit 0 are in CI as
# tests/runtime/test_dropin.py's lost node)
@pytest.mark.soak
@pytest.mark.timeout(60)  # 13 s measured
def test_a_lost_node_recovered_in_place_lets_the_job_end(tmp_path):
    # Two agents of two runtime workers each; node 1's agent is SIGKILLed mid-run (its
    # workers die with it). Node 0 recovers in place, trains to the end with the weights
    # of a failure-free run, and exits 0 (before: its launcher never ended).

    from tests.runtime.test_liveness import MLP
    from tests.runtime.test_recovery import dumps

    reference = references.mlp(workers=4, steps=60)
    args = [MLP, "--steps", "60", "--stages", "1", "--dump", str(tmp_path / "dump")]
    evs = lose_node_1(tmp_path, args, after_step=15, env={"MLP_STEP_SLEEP_S": "0.1"}, timeout=90)
    assert [e["node"] for e in evs if e["event"] == "node_lost"] == [1]
    assert [e["attempt"] for e in evs if e["event"] == "workers_started"] == [0]  # in place
    finish = [e for e in evs if e["event"] == "decision" and e["action"] == "finish"]
    assert finish and finish[-1]["exit_code"] == 0
    assert leftovers(tmp_path) == []
    checks, _losses = dumps(tmp_path)
    assert sorted(checks) == sorted(reference)
    for layer, values in checks.items():
        assert max(values) == min(values)
        assert values[0] == pytest.approx(reference[layer][0], rel=1e-5)


@pytest.mark.timeout(180)  # 25 s measured; 55 s with a core busy
def test_a_hot_spare_node_takes_a_lost_nodes_ranks_in_place(tmp_path):
    # Three agents for a job of two nodes (--nnodes 2:2): the third waits as a hot spare.
    # Node 1's agent is SIGKILLed (its workers die with it); the spare takes its ranks in
    # the running round (no restart): their replacements start there, join as spares and
    # are taken in, and the job ends with the failure-free weights.
    from tests.runtime.test_liveness import MLP
    from tests.runtime.test_recovery import dumps

    steps = 150
    reference = references.mlp(workers=4, steps=steps)
    port = free_port()
    common = [
        "run", "--nnodes", "2:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "spare",
        "--heartbeat-timeout", "3",  # (a lease a loaded host meets: 2 s is not)
    ]  # fmt: skip
    args = [MLP, "--steps", str(steps), "--stages", "1", "--dump", str(tmp_path / "dump")]
    env = {"MLP_STEP_SLEEP_S": "0.1"}
    procs = []
    for i in range(3):
        log = tmp_path / f"n{i}.jsonl"
        procs.append(
            start(
                *common,
                "--events",
                str(log),
                *args,
                cwd=tmp_path,
                log=tmp_path / f"n{i}.log",
                env=env,
            )  # fmt: skip
        )
        if i < 2:
            wait_for_event(log, "start")
    try:
        wait_for_event(tmp_path / "n2.jsonl", "waiting", timeout=60)
        deadline = time.monotonic() + budget(90)
        while not any(
            e["event"] == "step" and e["step"] >= 15 for e in events(tmp_path / "n0.jsonl")
        ):
            assert time.monotonic() < deadline and procs[0].poll() is None
            time.sleep(0.05)
        procs[1].kill()
        procs[1].wait()
        # Once the spare's replacements are taken in, one of them is killed in turn: it is
        # replaced again, on the adopted node (the coordinator no longer counts it gone).
        wait_for_event(tmp_path / "n0.jsonl", "rejoined", timeout=90)
        first = [e for e in events(tmp_path / "n2.jsonl") if e["event"] == "worker_respawned"]
        os.kill(next(e["pid"] for e in first if e["rank"] == 2), signal.SIGKILL)
        codes = [procs[i].wait(timeout=budget(150)) for i in (0, 2)]
        logs = [(tmp_path / f"n{i}.log").read_text()[-2500:] for i in (0, 2)]
        assert codes == [0, 0], logs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    lead = events(tmp_path / "n0.jsonl")
    spare = events(tmp_path / "n2.jsonl")
    adopted = [e for e in lead if e["event"] == "node_adopted"]
    assert len(adopted) == 1 and adopted[0]["ranks"] == [2, 3], adopted
    assert [e["attempt"] for e in lead + spare if e["event"] == "workers_started"] == [0, 0]
    assert [e for e in lead if e["event"] == "decision" and e["action"] == "restart"] == []
    respawned = [e for e in spare if e["event"] == "worker_respawned"]
    assert sorted((e["rank"], e["count"]) for e in respawned) == [(2, 1), (2, 2), (3, 1)]
    assert [e for e in lead if e["event"] == "recovered"]
    assert leftovers(tmp_path) == []
    checks, _losses = dumps(tmp_path)
    for layer, values in reference.items():
        assert checks[layer] and all(v == pytest.approx(values[0], rel=1e-5) for v in checks[layer])
