"""tests/prefork.py: a ``chameleon`` forked from the suite's warm server is the command a
fresh interpreter runs: the same output and exit code, its own environment, folder and
output file, and a death by a signal reported as ``subprocess.Popen`` reports it."""

import signal
import subprocess
import sys

import psutil
import pytest

from tests import prefork
from tests.clock import budget
from tests.launcher.helpers import chameleon_cmd, env, write

pytestmark = pytest.mark.slow  # (the server imports torch: seconds)

DUMP = """
    import json, os, sys
    with open(f"seen.{os.environ['RANK']}.json", "w") as f:
        json.dump({"world": os.environ["WORLD_SIZE"], "mark": os.environ.get("MARK")}, f)
    sys.exit(int(sys.argv[1]))
"""


@pytest.mark.timeout(120)
def test_a_forked_command_says_and_exits_as_a_fresh_one_does(tmp_path):
    for args in (["run", str(tmp_path / "missing.py")], ["--version"]):
        argv = chameleon_cmd(*args)
        forked = prefork.run(argv, cwd=tmp_path, env=env(), timeout=budget(60))
        fresh = prefork.run(argv, cwd=tmp_path, env=env(), timeout=budget(60), fresh=True)
        assert forked.forked and not fresh.forked
        assert (forked.returncode, forked.stdout, forked.stderr) == (
            fresh.returncode, fresh.stdout, fresh.stderr,
        )  # fmt: skip


@pytest.mark.timeout(120)
def test_a_forked_launcher_reads_its_own_environment_and_folder_and_exits_with_its_code(tmp_path):
    write(tmp_path / "dump.py", DUMP)
    log = tmp_path / "out.log"
    # torchrun's variable for --nproc-per-node: read by the launcher, not by the server
    own = {**env(), "PET_NPROC_PER_NODE": "3", "MARK": "mine"}
    with open(log, "w") as out:
        proc = prefork.popen(
            chameleon_cmd("run", "--standalone", "--max-restarts", "0", "dump.py", "7"),
            cwd=tmp_path, env=own, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    assert isinstance(proc, prefork.Launched)
    assert proc.wait(timeout=budget(90)) == 7, log.read_text()[-2000:]
    seen = [(tmp_path / f"seen.{rank}.json").read_text() for rank in range(3)]
    assert all('"world": "3"' in s and '"mark": "mine"' in s for s in seen)
    assert "chameleon" in log.read_text()  # its output went to its own file


@pytest.mark.timeout(120)
def test_a_forked_launcher_killed_reports_the_signal_as_popen_does(tmp_path):
    write(tmp_path / "sleep.py", "import time\ntime.sleep(60)\n")
    with open(tmp_path / "out.log", "w") as out:
        proc = prefork.popen(
            chameleon_cmd("run", "--standalone", "--nproc-per-node", "1", "sleep.py"),
            cwd=tmp_path, env=env(), stdout=out, stderr=out,
        )  # fmt: skip
    assert isinstance(proc, prefork.Launched)
    assert psutil.Process(proc.pid).ppid() == prefork.server_pid()
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(timeout=budget(30)) == -signal.SIGKILL
    assert proc.returncode == -signal.SIGKILL


def test_only_what_a_library_reads_as_it_loads_makes_a_command_start_fresh(monkeypatch):
    monkeypatch.delenv(prefork.FRESH_ENV, raising=False)
    argv = [sys.executable, "-m", "chameleon_cli", "run", "x.py"]
    base = prefork._base  # (remembered as the suite started: tests/conftest.py)
    # what the tests give a command now still forks: no test left this process's
    # environment changed where it counts (torch._dynamo's import did, seen in CI)
    assert base and prefork.forkable(argv, prefork.server_env())
    assert prefork.forkable(argv, {**base, "TORCHINDUCTOR_CACHE_DIR": "/tmp/x"})
    assert prefork.forkable(argv, base)
    assert prefork.forkable(argv, {**base, "CHAMELEON_JOB_TOKEN": "t", "SLURM_NNODES": "2"})
    for loaded in ("MALLOC_MMAP_THRESHOLD_", "PYTHONHASHSEED", "TORCH_LOGS", "OMP_NUM_THREADS"):
        assert not prefork.forkable(argv, {**base, loaded: "7"}), loaded
    assert not prefork.forkable(argv, {k: v for k, v in base.items() if k != "PYTHONPATH"})
    assert not prefork.forkable([sys.executable, "-m", "torch.distributed.run"], base)
    assert not prefork.forkable(["chameleon", "run", "x.py"], base)
    monkeypatch.setenv(prefork.FRESH_ENV, "1")
    assert not prefork.forkable(argv, base)
