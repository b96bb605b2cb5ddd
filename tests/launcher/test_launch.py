"""``chameleon run`` end to end, with worker scripts that do not import torch (fast)."""

import json
import os
import signal
import subprocess
import time

import psutil
import pytest

from tests.clock import budget, slack
from tests.launcher.helpers import events, free_port, run, start, wait_for_event, write

# real processes, seconds each: the full suite (CI) runs them, the fast tier does not
pytestmark = pytest.mark.slow

TORCHRUN_VARS = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
]

DUMP_ENV = f"""
    import json, os, sys
    keys = {TORCHRUN_VARS!r}
    with open(f"env_{{sys.argv[1]}}_{{os.environ['RANK']}}.json", "w") as f:
        json.dump({{k: os.environ.get(k) for k in keys}}, f)
"""


@pytest.mark.slow
@pytest.mark.timeout(60)  # 4 s measured
def test_workers_get_torchruns_environment(tmp_path):
    script = write(tmp_path / "dump.py", DUMP_ENV)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    port = free_port()
    ours = run(
        "run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(port),
        str(script),
        "ours",
        cwd=tmp_path,
        fresh=True,  # (set against torchrun's: both launchers fresh interpreters)
    )
    assert ours.returncode == 0, ours.stderr
    theirs = subprocess.run(
        [
            "torchrun",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            str(script),
            "torchrun",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=budget(120),
    )
    assert theirs.returncode == 0, theirs.stderr
    for rank in (0, 1):
        a = json.loads((tmp_path / f"env_ours_{rank}.json").read_text())
        b = json.loads((tmp_path / f"env_torchrun_{rank}.json").read_text())
        assert set(k for k, v in a.items() if v is not None) == set(
            k for k, v in b.items() if v is not None
        )
        for key in TORCHRUN_VARS:
            if key in ("MASTER_PORT", "TORCHELASTIC_ERROR_FILE"):
                continue  # a fresh port per attempt; our own log folder
            assert a[key] == b[key], key


@pytest.mark.timeout(60)  # 3 s measured
def test_exit_code_is_the_root_causes(tmp_path):
    script = write(
        tmp_path / "fail.py",
        """
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(7)
        time.sleep(30)
    """,
    )
    result = run(
        "run", "--standalone", "--nproc-per-node", "2", "--plain", str(script), cwd=tmp_path
    )
    assert result.returncode == 7
    assert "rank 1 exited with code 7" in result.stderr
    assert "no restarts left" in result.stderr


@pytest.mark.timeout(60)  # 4 s measured
def test_a_spent_restart_budget_exits_93_do_not_requeue(tmp_path):
    # A worker killed in every attempt (no message: not a loop of the same error), two
    # restarts allowed: the third failure gives up with ft_launcher's "do not requeue".
    script = write(
        tmp_path / "dies.py",
        """
        import os, signal, time
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)
    """,
    )
    result = run(
        "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--plain",
        str(script), cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 93, result.stderr[-2000:]
    assert "no restarts left (--max-restarts 2)" in result.stderr


@pytest.mark.timeout(60)  # 5 s measured
def test_the_same_error_three_attempts_in_a_row_gives_up_before_the_budget(tmp_path):
    script = write(
        tmp_path / "bug.py",
        """
        import os, time
        if os.environ["RANK"] == "0":
            raise ValueError("bad batch size 7")
        time.sleep(30)
    """,
    )
    log = tmp_path / "events.jsonl"
    result = run(
        "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "10", "--plain",
        "--events", str(log), str(script), cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 93, result.stderr[-2000:]
    assert "the same failure ended the last 3 attempts" in result.stderr
    assert [e["attempt"] for e in events(log) if e["event"] == "workers_started"] == [0, 1, 2]


@pytest.mark.timeout(60)  # 5 s measured
def test_restart_counts_and_then_succeeds(tmp_path):
    script = write(
        tmp_path / "flaky.py",
        """
        import os, sys
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if attempt < 2 and os.environ["RANK"] == "0":
            sys.exit(3)
    """,
    )
    log = tmp_path / "events.jsonl"
    result = run(
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--events",
        str(log),
        str(script),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    names = [e["event"] for e in events(log)]
    assert names.count("restart") == 2 and names[-1] == "exit"
    assert [e["attempt"] for e in events(log) if e["event"] == "workers_started"] == [0, 1, 2]


@pytest.mark.timeout(60)  # 2 s measured
def test_crash_is_detected_within_half_a_second(tmp_path):
    # (half a second on an idle machine: the watch polls every 50 ms; tests/clock.py)
    script = write(tmp_path / "sleep.py", "import time; time.sleep(30)\n")
    log = tmp_path / "events.jsonl"
    result = run(
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--inject-fault",
        "kill:rank=1,at=0.5",
        "--events",
        str(log),
        str(script),
        cwd=tmp_path,
    )
    assert result.returncode == 128 + 9
    failure = next(e for e in events(log) if e["event"] == "failure")
    assert failure["kind"] == "signal" and failure["exit_code"] == -9
    assert failure["detected_at"] - failure["failed_at"] < slack(0.5)


@pytest.mark.timeout(60)  # 4 s measured
def test_hang_is_detected_and_the_worker_killed(tmp_path):
    script = write(tmp_path / "sleep.py", "import time; time.sleep(30)\n")
    log = tmp_path / "events.jsonl"
    t0 = time.monotonic()
    result = run(
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--heartbeat-timeout",
        "1.5",
        "--inject-fault",
        "hang:rank=0,at=0.5",
        "--events",
        str(log),
        str(script),
        cwd=tmp_path,
    )
    assert result.returncode == 3  # a hang has no exit code of its own
    failure = next(e for e in events(log) if e["event"] == "failure")
    assert failure["kind"] == "hang" and "stopped" in failure["message"]
    # never before the timeout; after it, within a beat period or so
    assert 1.5 <= failure["detected_at"] - failure["failed_at"] < 1.5 + slack(0.5)
    assert time.monotonic() - t0 < slack(20)


def _test_processes(marker: str) -> list[psutil.Process]:
    """Workers and their children: processes with the marker that are not a launcher."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmdline = p.info["cmdline"] or []
            if "chameleon_cli" in cmdline:
                continue
            if any(marker in part for part in cmdline):
                found.append(p)
        except psutil.Error:
            pass
    return found


SPAWNER = """
    import os, subprocess, sys, time
    # A child of the worker too, as a data loader would start.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "{marker}"])
    time.sleep(120)
"""


@pytest.mark.timeout(60)  # 2 s measured
def test_no_orphans_when_the_launcher_is_sigkilled(tmp_path):
    marker = f"orphan-check-{os.getpid()}-kill"
    script = write(tmp_path / "spawner.py", SPAWNER.format(marker=marker))
    log = tmp_path / "events.jsonl"
    launcher = start(
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--events",
        str(log),
        str(script),
        marker,
        cwd=tmp_path,
        log=tmp_path / "out.log",
        fresh=True,  # (a launcher as a shell starts it: its parent is not a fork server)
    )
    try:
        wait_for_event(log, "workers_started")
        deadline = time.monotonic() + budget(20)
        while len(_test_processes(marker)) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_test_processes(marker)) == 4  # 2 workers + 2 children
        launcher.kill()
        launcher.wait()
        gone_by = time.monotonic() + budget(5)
        while _test_processes(marker) and time.monotonic() < gone_by:
            time.sleep(0.1)
        assert _test_processes(marker) == []
    finally:
        for p in _test_processes(marker):
            p.kill()


@pytest.mark.timeout(60)  # 3 s measured
def test_sigterm_is_forwarded_then_sigkill_after_the_grace(tmp_path):
    marker = f"orphan-check-{os.getpid()}-term"
    script = write(
        tmp_path / "term.py",
        f"""
        import os, signal, sys, time
        rank = os.environ["RANK"]
        def on_term(signum, frame):
            open(f"got_term_{{rank}}", "w").close()
            if rank == "0":
                sys.exit(0)   # rank 0 exits when asked; rank 1 ignores it
        signal.signal(signal.SIGTERM, on_term)
        open(f"ready_{{rank}}", "w").close()
        while True:
            time.sleep(0.1)
        # {marker}
    """,
    )
    log = tmp_path / "events.jsonl"
    launcher = start(
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--shutdown-timeout",
        "1",
        "--events",
        str(log),
        str(script),
        marker,
        cwd=tmp_path,
        log=tmp_path / "out.log",
    )
    try:
        wait_for_event(log, "workers_started")
        deadline = time.monotonic() + budget(30)  # both workers' handlers installed
        while not all((tmp_path / f"ready_{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.02)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=budget(20)) == 128 + signal.SIGTERM
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert (tmp_path / "got_term_0").exists() and (tmp_path / "got_term_1").exists()
    assert _test_processes(marker) == []


@pytest.mark.timeout(60)  # 2 s measured
def test_logs_redirect_tee_and_filter(tmp_path):
    script = write(
        tmp_path / "talk.py",
        """
        import os, sys
        print("out from", os.environ["RANK"])
        print("err from", os.environ["RANK"], file=sys.stderr)
    """,
    )
    logdir = tmp_path / "logs"
    result = run(
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--log-dir",
        str(logdir),
        "-r",
        "0:3",
        "-t",
        "1:1",
        "--local-ranks-filter",
        "1",
        str(script),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    (run_dir,) = list(logdir.iterdir())
    assert (run_dir / "attempt_0" / "0" / "stdout.log").read_text() == "out from 0\n"
    assert (run_dir / "attempt_0" / "0" / "stderr.log").read_text() == "err from 0\n"
    assert (run_dir / "attempt_0" / "1" / "stdout.log").read_text() == "out from 1\n"
    assert not (run_dir / "attempt_0" / "1" / "stderr.log").exists()
    assert "[rank 1]: out from 1" in result.stdout and "[rank 1]: err from 1" in result.stderr
    assert "from 0" not in result.stdout + result.stderr.replace(str(run_dir), "")


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (
            ["run", "--nproc-per-node", "2", "missing.py"],
            1,
            "training script not found: missing.py",
        ),
        (["run", "--bogus", "x.py"], 2, "unrecognized arguments: --bogus"),
        (["run", "--nnodes", "0", "x.py"], 2, "--nnodes must be"),
    ],
)
@pytest.mark.timeout(60)  # 0 s measured
def test_bad_input_is_one_line(tmp_path, args, code, message):
    result = run(*args, cwd=tmp_path)
    assert result.returncode == code
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (None, "config file not found"),
        ("[cluster]\nname = 3\n", "cluster.name"),
        ("not toml [", "not valid TOML"),
    ],
)
@pytest.mark.timeout(60)  # 0 s measured
def test_a_bad_config_fails_before_any_worker_starts(tmp_path, config, message):
    marker = tmp_path / "started"
    script = write(tmp_path / "touch.py", f"open({str(marker)!r}, 'w').close()\n")
    path = tmp_path / "job.toml"
    if config is not None:
        path.write_text(config)
    result = run("run", "--config", str(path), str(script), cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.startswith("chameleon: config error: ")
    assert not marker.exists()


@pytest.mark.timeout(60)  # 0 s measured
def test_port_in_use_is_one_line(tmp_path):
    script = write(tmp_path / "ok.py", "pass\n")
    port = free_port()
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        result = run("run", "--master-port", str(port), str(script), cwd=tmp_path)
    assert result.returncode == 1
    lines = [
        line
        for line in result.stderr.strip().splitlines()
        if not line.startswith("chameleon: run ")
    ]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0]
