"""Plain torchrun scripts under ``chameleon run``: warm restarts that run the script as a
fresh interpreter would, root causes from torchrun's error file, hang detection by
heartbeats. Real workers, real gloo, real kills."""

from __future__ import annotations

import json
import re
import signal
import time

import pytest

from tests.clock import budget, slack
from tests.launcher.helpers import events, run, start, write

# real processes, seconds each: the full suite (CI) runs them, the fast tier does not
pytestmark = pytest.mark.slow

PROBE = """
    import json, os, sys
    import torch
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    rank = os.environ["RANK"]
    facts = {"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
             "file": __file__, "threads": torch.get_num_threads(),
             "main": sys.modules["__main__"].__file__, "world": os.environ["WORLD_SIZE"]}
    with open(f"facts_{sys.argv[1]}_{attempt}_{rank}.json", "w") as f:
        json.dump(facts, f)
    if attempt == "0" and rank == "1":
        sys.exit(5)
"""


SERVER_PROBE = """
    import json, os, sys
    import torch
    server = os.getppid()
    fds = {fd: os.readlink(f"/proc/{server}/fd/{fd}") for fd in os.listdir(f"/proc/{server}/fd")}
    stat = open(f"/proc/{server}/stat").read().rsplit(")", 1)[1].split()
    with open(f"server_{os.environ['RANK']}.json", "w") as f:
        json.dump({"server": server, "parent": int(stat[1]), "session": int(stat[3]),
                   "fds": fds, "cmdline": open(f"/proc/{server}/cmdline").read()}, f)
"""


@pytest.mark.timeout(60)  # 3 s measured
def test_the_warm_server_is_a_fork_of_the_launcher_that_holds_nothing_of_it(tmp_path):
    # (launcher/early.py: forked once the launcher has imported torch, so as not to import
    # it twice.) What a fresh `python -m launcher.forkserver` would be: its own session,
    # stdin from /dev/null, output to its log, no descriptor of the launcher's (its
    # stdout, its listening sockets) but the socket to it, and named for what it is.
    write(tmp_path / "probe.py", SERVER_PROBE)
    proc = start(
        "run", "--standalone", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "runs"),
        "probe.py", cwd=tmp_path, log=tmp_path / "launcher.log",
        fresh=True,  # (the launcher's own import of torch, before the fork: a user's)
    )  # fmt: skip
    assert proc.wait(timeout=budget(60)) == 0, (tmp_path / "launcher.log").read_text()
    facts = [json.loads((tmp_path / f"server_{r}.json").read_text()) for r in (0, 1)]
    assert facts[0]["server"] == facts[1]["server"]  # one server for both
    server = facts[0]
    assert server["parent"] == proc.pid
    assert server["session"] == server["server"]
    assert "launcher.forkserver" in server["cmdline"]
    fds = server["fds"]
    assert fds["0"] == "/dev/null"
    assert fds["1"] == fds["2"] and fds["1"].endswith("/forkserver.log"), fds
    others = {fd: target for fd, target in fds.items() if fd not in ("0", "1", "2")}
    assert [t for t in others.values() if t.startswith("socket:")] and all(
        t.startswith(("socket:", "pipe:", "anon_inode:")) for t in others.values()
    ), fds
    assert len([t for t in others.values() if t.startswith("socket:")]) == 1, fds


@pytest.mark.timeout(60)  # 8 s measured
def test_workers_are_forks_of_the_warm_server_and_see_what_fresh_ones_see(tmp_path):
    script = write(tmp_path / "probe.py", PROBE)
    for how, flags in (("warm", []), ("fresh", ["--no-warm-start"])):
        log = tmp_path / f"{how}.jsonl"
        result = run(
            "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", *flags,
            "--events", str(log), "--log-dir", str(tmp_path / how),
            "probe.py", how, "--flag", cwd=tmp_path,
            fresh=True,  # (set against fresh workers: what a user's launcher holds)
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        started = [e["warm"] for e in events(log) if e["event"] == "workers_started"]
        assert started == [how == "warm"] * 2  # the first round and the restart
        ready = [e for e in events(log) if e["event"] == "warm_start_ready"]
        assert bool(ready) is (how == "warm")
        # started before the launcher imported itself (launcher/early.py), its log moved
        # into the run's folder
        assert [e["early"] for e in ready] == [True] * len(ready)
        # ... as a fork of the launcher once it had imported torch (not a second import)
        assert [e["forked"] for e in ready] == [True] * len(ready)
        assert sorted(p.name for p in (tmp_path / how).glob("*/forkserver.log")) == (
            ["forkserver.log"] if how == "warm" else []
        )
        assert list((tmp_path / how).glob(".forkserver-*")) == []
    for attempt in (0, 1):
        for rank in (0, 1):
            fresh = json.loads((tmp_path / f"facts_fresh_{attempt}_{rank}.json").read_text())
            warm = json.loads((tmp_path / f"facts_warm_{attempt}_{rank}.json").read_text())
            assert {**warm, "argv": None} == {**fresh, "argv": None}
            assert warm["argv"] == ["probe.py", "warm", "--flag"]
            assert fresh["file"] == str(script)


@pytest.mark.timeout(60)  # 2 s measured
def test_a_run_refused_after_the_server_started_leaves_nothing(tmp_path):
    # The flags read well, so the fork server starts first thing; then the launcher
    # refuses a value. The server goes, and its log (a hidden file) with it; this suite's
    # fixture fails the test if any process is left.
    write(tmp_path / "train.py", "import torch\n")
    result = run(
        "run", "--standalone", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
        "--heartbeat-timeout", "0", "train.py", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--heartbeat-timeout" in result.stderr and "Traceback" not in result.stderr
    assert list((tmp_path / "logs").iterdir()) == []


@pytest.mark.timeout(60)  # 3 s measured
def test_the_root_cause_comes_from_torchruns_error_file(tmp_path):
    write(
        tmp_path / "fail.py",
        """
        import os, time
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def main():
            if os.environ["RANK"] == "1":
                raise ValueError("bad batch size 7")
            time.sleep(60)

        main()
        """,
    )
    log = tmp_path / "events.jsonl"
    result = run(
        "run", "--standalone", "--nproc-per-node", "2", "--plain", "--events", str(log),
        "fail.py", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1
    (failure,) = [e for e in events(log) if e["event"] == "failure"]
    assert failure["rank"] == 1 and failure["message"] == "ValueError: bad batch size 7"
    assert failure["where"] == f"{tmp_path / 'fail.py'}:8 in main"
    assert failure["failed_at"] <= failure["detected_at"]
    assert "ValueError: bad batch size 7" in result.stderr and "user code" in result.stderr
    assert "fail.py:8 in main" in result.stderr


@pytest.mark.timeout(60)  # 3 s measured
def test_without_an_error_file_the_traceback_on_stderr_is_read(tmp_path):
    write(
        tmp_path / "fail.py",
        """
        import os, time
        def load(config):
            return config["lr"]
        if os.environ["RANK"] == "0":
            load({})
        time.sleep(60)
        """,
    )
    log = tmp_path / "events.jsonl"
    result = run(
        "run", "--standalone", "--nproc-per-node", "2", "--events", str(log), "fail.py",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1
    (failure,) = [e for e in events(log) if e["event"] == "failure"]
    assert failure["message"] == "KeyError: 'lr'"
    assert failure["where"] == f"{tmp_path / 'fail.py'}:4 in load"


STUCK = """
    import os, sys, time
    import torch
    import torch.distributed as dist
    import chameleon_runtime as cr

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    start = int(open("ckpt.txt").read()) + 1 if os.path.exists("ckpt.txt") else 0
    for step in range(start, 30):
        if attempt == 0 and rank == 1 and step == 12:
            print(f"STUCK {time.time():.3f}", flush=True)
            time.sleep(3600)  # blocks forever before its all-reduce
        t = torch.ones(4)
        dist.all_reduce(t)
        if rank == 0 and step % 5 == 0:
            with cr.section("checkpoint", timeout=60):
                with open("ckpt.tmp", "w") as f:
                    f.write(str(step))
                os.replace("ckpt.tmp", "ckpt.txt")
        if rank == 0:
            print(f"STEP {step} {attempt} {time.time():.3f}", flush=True)
        cr.heartbeat()
        time.sleep(0.02)
    dist.destroy_process_group()
"""


@pytest.mark.timeout(60)  # 8 s measured
def test_a_rank_stuck_before_its_all_reduce_is_caught_by_its_heartbeats(tmp_path):
    write(tmp_path / "stuck.py", STUCK)
    log = tmp_path / "events.jsonl"
    timeout = 3.0
    result = run(
        "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--heartbeat-timeout",
        str(timeout), "--events", str(log), "stuck.py", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = [line.split(": ", 1)[-1].split() for line in result.stdout.splitlines()]
    stuck_at = next(float(w[1]) for w in lines if w and w[0] == "STUCK")
    resumed = [(int(w[1]), float(w[3])) for w in lines if w and w[0] == "STEP" and w[2] == "1"]
    assert resumed[0][0] == 11  # from the checkpoint of step 10, not from the start
    record = events(log)
    hangs = [e for e in record if e["event"] == "failure" and e["kind"] == "hang"]
    assert hangs and all("no heartbeat for" in e["message"] for e in hangs)
    restarted = next(
        e["t"] for e in record if e["event"] == "workers_started" and e["attempt"] == 1
    )
    # caught after the timeout (not NCCL's or gloo's minutes): --heartbeat-timeout, or 10x
    # the slowest gap between beats where a loaded host made that longer (the message
    # says which), restarted within a second more on an idle machine (the last beat
    # written can precede the STUCK line by a write interval and a sleep)
    limit = max(float(re.search(r"\(timeout ([0-9.]+) s", e["message"]).group(1)) for e in hangs)
    assert limit >= timeout
    assert limit - 0.5 <= restarted - stuck_at < limit + slack(1.0)


@pytest.mark.timeout(60)  # 3 s measured
def test_ctrl_c_shows_one_line_per_rank_not_every_traceback(tmp_path):
    write(
        tmp_path / "loop.py",
        """
        import time
        print("up", flush=True)
        while True:
            time.sleep(0.1)
        """,
    )
    log = tmp_path / "out.txt"
    proc = start(
        "run", "--standalone", "--nproc-per-node", "3", "--plain", "loop.py", cwd=tmp_path,
        log=log,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + budget(60)
        while log.read_text().count("up") < 3:
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=budget(60)) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "Traceback" not in text
    worker_lines = [x.split(": ", 1)[1] for x in text.splitlines() if x.startswith("[rank ")]
    assert all(x == "up" or x.startswith("stopped by signal") for x in worker_lines)
    for rank in range(3):
        (line,) = [x for x in text.splitlines() if x.startswith(f"[rank {rank}]: stopped")]
        assert "stopped by signal 2" in line and "KeyboardInterrupt" in line and "loop.py" in line
