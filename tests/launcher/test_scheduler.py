"""What a scheduler's environment makes of ``chameleon run``: Slurm's compressed node lists
and SLURM_* variables, torchrun's PET_* variables, and which wins (launcher/scheduler.py,
launcher/args.py)."""

import signal

import pytest

from launcher.args import ArgsError, parse_run_args
from launcher.scheduler import SchedulerError, expand_nodelist, slurm_launch


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("gpu01", ["gpu01"]),
        ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[008-010]", ["n008", "n009", "n010"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("x[1,3],y,z[0-1]", ["x1", "x3", "y", "z0", "z1"]),
        ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
    ],
)
def test_slurm_node_lists_expand_as_scontrol_prints_them(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["gpu[01-04", "gpu01]", "gpu[4-1]", "gpu[a-b]", "g[[1]]", ""])
def test_a_bad_node_list_is_one_line_naming_it(text):
    with pytest.raises(SchedulerError, match="Slurm node list"):
        expand_nodelist(text)


SLURM = {  # what srun gives a task (a step of the job)
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[07-09]",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_NTASKS": "3",
}


def test_under_srun_the_rendezvous_comes_from_slurm():
    a = parse_run_args(["--nproc-per-node", "4", "train.py", "--nnodes", "9"], SLURM)
    assert (a.min_nodes, a.max_nodes, a.node_rank) == (3, 3, 1)
    assert a.master_addr == "gpu07" and a.rdzv_id == "4242"
    assert a.master_port == 20000 + 4242 and a.requeue == 0
    assert a.script_args == ("--nnodes", "9")  # the script's own flags stay its own
    assert "--node-rank 1 (SLURM_NODEID)" in a.from_env
    assert "--master-addr gpu07 (SLURM_JOB_NODELIST)" in a.from_env


def test_the_step_s_variables_come_before_the_job_s_and_a_requeue_gets_its_own_run_id():
    env = {**SLURM, "SLURM_STEP_NODELIST": "gpu[08-09]", "SLURM_STEP_NUM_NODES": "2"}
    env |= {"SLURM_STEP_NUM_TASKS": "2", "SLURM_RESTART_COUNT": "2"}
    a = parse_run_args(["train.py"], env)
    assert (a.max_nodes, a.master_addr, a.requeue) == (2, "gpu08", 2)
    assert a.rdzv_id == "4242-requeue2"


def test_flags_and_pet_variables_win_over_slurm():
    a = parse_run_args(["--nnodes", "2", "--master-addr", "h0", "train.py"], SLURM)
    assert (a.max_nodes, a.master_addr, a.node_rank) == (2, "h0", 1)
    a = parse_run_args(["train.py"], {**SLURM, "PET_NODE_RANK": "2", "PET_RDZV_ID": "mine"})
    assert (a.node_rank, a.rdzv_id) == (2, "mine")
    a = parse_run_args(["--standalone", "train.py"], SLURM)
    assert a.standalone and a.max_nodes == 1


def test_several_tasks_per_node_under_srun_is_a_one_line_error():
    with pytest.raises(ArgsError, match="srun --ntasks-per-node=1"):
        parse_run_args(["train.py"], {**SLURM, "SLURM_NTASKS": "12"})
    # ... unless the rendezvous is given in full
    flags = ["--nnodes", "1", "--node-rank", "0", "--master-addr", "h", "train.py"]
    assert parse_run_args(flags, {**SLURM, "SLURM_NTASKS": "12"}).max_nodes == 1


def test_outside_slurm_nothing_is_taken():
    # sbatch's own shell: the job's variables and SLURM_NODEID=0, but no step: a launcher
    # there is alone (its node count would wait for nodes that never come)
    batch = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"} | {"SLURM_NODEID": "0"}
    assert slurm_launch(batch) is None
    assert parse_run_args(["train.py"], batch).max_nodes == 1
    a = parse_run_args(["train.py"], {})
    assert (a.max_nodes, a.master_addr, a.master_port, a.from_env) == (1, "127.0.0.1", 29500, ())


def test_every_torchrun_flag_reads_its_pet_variable_and_a_flag_wins():
    env = {
        "PET_NNODES": "1:3",
        "PET_NPROC_PER_NODE": "2",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": "head:29400",
        "PET_RDZV_ID": "job7",
        "PET_MAX_RESTARTS": "5",
        "PET_MONITOR_INTERVAL": "0.5",
        "PET_STANDALONE": "0",
        "PET_LOG_DIR": "/tmp/logs",
        "PET_SIGNALS_TO_HANDLE": "SIGUSR1",
    }
    a = parse_run_args(["train.py"], env)
    assert (a.min_nodes, a.max_nodes, a.nproc_per_node) == (1, 3, 2)
    assert (a.rdzv_backend, a.rdzv_endpoint, a.rdzv_id) == ("c10d", "head:29400", "job7")
    assert (a.max_restarts, a.monitor_interval_s, a.log_dir) == (5, 0.5, "/tmp/logs")
    assert a.preempt_signals == {signal.SIGUSR1} and not a.standalone
    a = parse_run_args(["--nproc_per_node", "3", "--max-restarts", "1", "train.py"], env)
    assert (a.nproc_per_node, a.max_restarts) == (3, 1)
    assert parse_run_args(["-m", "pkg.train"], {"PET_MODULE": "1"}).module


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PET_STANDALONE": "yes"}, "PET_STANDALONE must be 0 or 1"),
        ({"PET_NUMA_BINDING": "node"}, "--numa-binding is not supported"),
        ({"PET_MAX_RESTARTS": "two"}, "invalid int value.*PET_MAX_RESTARTS='two'"),
        ({"PET_NNODES": "abc"}, r"MIN:MAX, got 'abc' \(from the environment: PET_NNODES='abc'\)"),
    ],
)
def test_a_bad_pet_variable_is_a_one_line_error(env, message):
    with pytest.raises(ArgsError, match=message):
        parse_run_args(["train.py"], env)


def test_named_signals_are_preemption_notices_and_ctrl_c_always_stops():
    assert parse_run_args(["train.py"], {}).preempt_signals == frozenset()
    a = parse_run_args(["--signals-to-handle", "SIGTERM,SIGINT,usr1", "train.py"], {})
    assert a.preempt_signals == {signal.SIGTERM, signal.SIGUSR1}
    for bad in ("SIGKILL", "9", "SIG_IGN", "SIGNOPE", "0"):
        with pytest.raises(ArgsError, match=f"{bad!r} is not a signal that can be handled"):
            parse_run_args(["--signals-to-handle", bad, "train.py"], {})
