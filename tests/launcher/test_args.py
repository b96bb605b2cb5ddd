"""torchrun-compatible argument parsing."""

import pytest

from chameleon_runtime.protocol.messages import RecoveryPhase, WorkerStatus
from launcher.args import ArgsError, parse_run_args, run_help
from launcher.faults import FaultKind, FaultLedger, Injector, parse_fault


def test_both_spellings_and_torchrun_defaults():
    a = parse_run_args(["--nproc_per_node", "4", "--max-restarts", "2", "train.py"])
    b = parse_run_args(["--nproc-per-node", "4", "--max_restarts", "2", "train.py"])
    assert a == b
    assert (a.nproc_per_node, a.max_restarts, a.min_nodes, a.max_nodes) == (4, 2, 1, 1)
    assert (a.master_addr, a.master_port, a.rdzv_backend, a.role) == (
        "127.0.0.1",
        29500,
        "static",
        "default",
    )
    assert a.monitor_interval_s == 0.1 and a.heartbeat_timeout_s == 30.0


def test_script_arguments_pass_through_untouched():
    a = parse_run_args(
        ["--nproc-per-node", "2", "train.py", "--nproc-per-node", "9", "-m", "--lr=3"]
    )
    assert a.script == "train.py"
    assert a.script_args == ("--nproc-per-node", "9", "-m", "--lr=3")
    assert a.nproc_per_node == 2


def test_module_and_elastic_nodes():
    a = parse_run_args(
        ["--nnodes", "2:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "-m", "pkg.train"]
    )
    assert (a.min_nodes, a.max_nodes, a.module, a.script) == (2, 4, True, "pkg.train")


def test_redirects_and_tee_formats():
    a = parse_run_args(["--nproc-per-node", "3", "-r", "3", "--tee", "0:1,2:2", "t.py"])
    assert a.redirects == {0: 3, 1: 3, 2: 3}
    assert a.tee == {0: 1, 1: 0, 2: 2}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bogus", "t.py"], "unrecognized arguments: --bogus"),
        ([], "no training script given"),
        (["--nnodes", "2:1", "t.py"], "--nnodes must be"),
        (["--nnodes", "x", "t.py"], "--nnodes must be"),
        (["--nnodes", "1:2", "t.py"], "needs --rdzv-backend c10d"),
        (["--nproc-per-node", "0", "t.py"], "--nproc-per-node must be"),
        (["--event-log-handler", "x", "t.py"], "--event-log-handler is not supported"),
        (["--numa-binding", "node", "t.py"], "--numa-binding is not supported"),
        (["--start-method", "fork", "t.py"], "--start-method fork is not supported"),
        (["--rdzv-backend", "etcd-v2", "t.py"], "--rdzv-backend etcd-v2 is not supported"),
        (["--rdzv-backend", "etcd", "t.py"], "--rdzv-backend etcd needs --rdzv-endpoint"),
        (["--rdzv-endpoint", "a:1,b:2", "t.py"], "several --rdzv-endpoint addresses need"),
        (["--run-path", "relative.py"], "absolute path"),
        (["-r", "9", "t.py"], "--redirects must be"),
        (
            ["--inject-fault", "kill:rank=1", "t.py"],
            "exactly one of at=SECONDS, step=N or phase=PHASE / recovery=N",
        ),
        (["--inject-fault", "kill:rank=1,phase=lunch", "t.py"], "phase must be one of"),
        (["--inject-fault", "kill:rank=1,at=2,after_ms=5", "t.py"], "after_ms goes with"),
        (["--step-timeout", "soon", "t.py"], "--step-timeout must be auto or positive seconds"),
        (["--startup-timeout", "0", "t.py"], "must be positive"),
    ],
)
def test_bad_arguments_name_the_problem(argv, message):
    with pytest.raises(ArgsError, match=message.replace("(", r"\(")):
        parse_run_args(argv)


def test_fault_specs():
    f = parse_fault("kill:rank=3,at=5")
    assert (f.kind, f.rank, f.at_s, f.step, f.attempt) == (FaultKind.KILL, 3, 5.0, None, 0)
    g = parse_fault("exit:rank=1,step=10,code=7,attempt=1")
    assert (g.kind, g.step, g.code, g.attempt) == (FaultKind.EXIT, 10, 7, 1)
    h = parse_fault("kill:rank=2,phase=migrate,recovery=2,after_ms=50")
    assert (h.phase, h.recovery, h.after_ms) == ("migrate", 2, 50.0)
    s = parse_fault("slow:rank=2,factor=3,step=10,for=20")
    assert (s.kind, s.rank, s.factor, s.step, s.for_s) == (FaultKind.SLOW, 2, 3.0, 10, 20.0)
    assert s.describe() == "slow rank 2 3x for 20 s at step 10 (attempt 0)"
    assert parse_fault("slow:rank=0,factor=2.5,at=4").for_s is None
    for bad in (
        "slow:rank=1,at=1",  # how slow?
        "slow:rank=1,factor=1,at=1",
        "slow:rank=1,factor=0.5,at=1",
        "slow:rank=1,factor=2,at=1,for=0",
        "slow:rank=1,factor=2,phase=plan",
        "kill:rank=1,at=1,factor=2",
        "kill:rank=1,at=1,for=3",
        "explode:rank=1,at=1",
        "kill:at=1",
        "kill:rank=x,at=1",
        "kill:rank=1,at=1,step=2",
        "kill:rank=1,when=2",
        "kill:rank=1,phase=plan,step=3",
        "kill:rank=1,recovery=0",
    ):
        with pytest.raises(ValueError):
            parse_fault(bad)


def _phase(phase, recovery=1):
    return RecoveryPhase(recovery=recovery, phase=phase, generation=1)


def _status(phase, step=3):
    return WorkerStatus(pid=1, beat=1, phase=phase, generation=1, step=step, progress=step)


def test_phase_faults_fire_in_their_phase_of_their_recovery_after_their_delay():
    plan = parse_fault("kill:rank=1,phase=plan,after_ms=50")
    groups = parse_fault("kill:rank=2,phase=groups,recovery=2")
    step = parse_fault("hang:rank=3,step=4")
    injector = Injector([plan, groups, step], ranks=[0, 1, 2, 3])
    due = injector.due
    assert due(0.0, since_start_s=0, status={}, phase=_phase("collect")) == []
    assert due(1.0, since_start_s=1, status={}, phase=_phase("plan")) == []  # armed
    assert due(1.049, since_start_s=1, status={}, phase=_phase("confirm")) == []
    assert due(1.05, since_start_s=1, status={}, phase=_phase("confirm")) == [plan]
    worker = {2: _status("groups")}
    assert due(2.0, since_start_s=2, status=worker, phase=_phase("confirm")) == []  # recovery 1
    assert due(3.0, since_start_s=3, status=worker, phase=_phase("confirm", 2)) == [groups]
    assert due(4.0, since_start_s=4, status={3: _status("train", step=4)}, phase=None) == []
    assert due(4.1, since_start_s=4, status={3: _status("train", step=5)}, phase=None) == [step]
    assert injector.pending == []


def test_a_step_fault_of_a_spare_rank_fires_when_the_job_passes_the_step():
    """A re-partition may leave the rank spare; its own step stands still, so the fault
    follows the job's (its node's working ranks), not the end of the run."""
    spec = parse_fault("kill:rank=2,step=30")
    injector = Injector([spec], ranks=[0, 1, 2, 3])
    spare = _status("spare", step=15)
    assert injector.due(0.0, since_start_s=0, status={2: spare, 0: _status("train", 30)},
                        phase=None) == []  # fmt: skip
    assert injector.due(0.1, since_start_s=0, status={2: spare, 0: _status("train", 31)},
                        phase=None) == [spec]  # fmt: skip
    alone = Injector([spec], ranks=[2])  # no working rank to follow: its own step
    assert alone.due(0.0, since_start_s=0, status={2: spare}, phase=None) == []


def test_any_rank_is_one_seen_in_the_phase():
    spec = parse_fault("kill:rank=any,phase=migrate")
    injector = Injector([spec], ranks=[4, 5, 6, 7])
    statuses = {4: _status("groups"), 5: _status("migrate"), 6: _status("spare")}
    statuses[7] = _status("migrate")
    assert injector.watches_status()
    (due,) = injector.due(0.0, since_start_s=0, status=statuses, phase=_phase("confirm"))
    assert due.rank in (5, 7) and "any rank" in spec.describe()


def test_workers_pause_only_where_a_pending_fault_waits_for_them():
    migrate, plan = (
        parse_fault("kill:rank=any,phase=migrate"),
        parse_fault("kill:rank=1,phase=plan"),
    )
    injector = Injector([migrate, plan], ranks=[0, 1])
    assert injector.failpoints() == ["migrate"]  # plan is the leader's phase, not a worker's
    injector.due(0.0, since_start_s=0, status={0: _status("migrate")}, phase=_phase("confirm"))
    assert injector.failpoints() == []  # fired: nobody waits any more


def test_help_lists_torchrun_and_chameleon_flags():
    text = run_help()
    for flag in (
        "--nproc-per-node",
        "--rdzv-endpoint",
        "--max-restarts",
        "--heartbeat-timeout",
        "--inject-fault",
    ):
        assert flag in text


def test_a_fault_of_any_attempt_fires_once_in_the_run():
    """A soak's schedule goes on after a restart: a fault for any attempt is pending in
    every round until it has fired, then in none (the agent's rounds share ``fired``)."""
    spec = parse_fault("kill:rank=1,step=40,attempt=any")
    assert spec.in_attempt(0) and spec.in_attempt(3) and "any attempt" in spec.describe()
    assert not parse_fault("kill:rank=1,step=40").in_attempt(1)
    ledger = FaultLedger()
    first = Injector([spec], ranks=[0, 1], ledger=ledger, attempt=0)
    assert first.due(0.0, since_start_s=0, status={1: _status("train", 30)}, phase=None) == []
    # restarted before step 40: the next round's injector still has it, and fires it
    pending = [f for f in [spec] if id(f) not in ledger.fired]
    second = Injector(pending, ranks=[0, 1], ledger=ledger, attempt=1)
    assert second.due(0.0, since_start_s=0, status={1: _status("train", 41)}, phase=None) == [spec]
    assert [f for f in [spec] if id(f) not in ledger.fired] == []  # a third round has none


def test_a_phase_fault_of_any_attempt_counts_recoveries_across_restarts():
    """recovery=3 of any attempt is the run's third: after an attempt that recovered twice
    and restarted, the next attempt's first recovery."""
    spec = parse_fault("kill:rank=1,recovery=3,attempt=any")
    ledger = FaultLedger()
    first = Injector([spec], ranks=[0, 1], ledger=ledger, attempt=0)
    for n in (1, 2):
        assert first.due(0.0, since_start_s=0, status={1: _status("train", 5)},
                         phase=_phase("plan", recovery=n)) == []  # fmt: skip
    second = Injector([spec], ranks=[0, 1], ledger=ledger, attempt=1)
    due = second.due(0.0, since_start_s=0, status={1: _status("train", 5)},
                     phase=_phase("plan", recovery=1))  # fmt: skip
    assert due == [spec] and ledger.recoveries == {0: 2, 1: 1}
