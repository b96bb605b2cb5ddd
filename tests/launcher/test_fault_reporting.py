"""A fault asked for with --inject-fault that cannot fire is said, not passed over: a line
at the start when the script may report no steps, a row in the summary and in --json for
every fault that never fired, and exit 4 under --require-faults. And a plain script's
heartbeats (chameleon_runtime.heartbeat(), once a step) count as its steps."""

from __future__ import annotations

import json

import pytest

from launcher.faults import parse_fault, unreported
from tests.launcher.helpers import events, run, write

# a plain script that reports nothing: no chameleon_runtime, no torch (a quick launch)
SILENT = """
    import time
    for step in range(15):
        time.sleep(0.05)
"""

# the same loop, beating once a step; the first attempt waits after its 11th beat for
# the fault due there (the agent reads beats every quarter second, and a launcher starved
# of a core for the loop's last second saw it end first: the fault never fired)
BEATING = """
    import os
    import time
    import chameleon_runtime
    first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
    for step in range(20):
        time.sleep(0.05)
        chameleon_runtime.heartbeat()
        if first and step == 10:
            time.sleep(60)  # (killed here: the test's own timeout is the bound)
"""


def test_step_and_recovery_faults_are_unreported_for_a_script_without_the_runtime():
    step, clock = parse_fault("kill:rank=1,step=20"), parse_fault("kill:rank=1,at=3")
    phase = parse_fault("kill:rank=0,phase=migrate")
    anyone = parse_fault("kill:rank=any,at=3")  # (drawn among the ranks that report)
    imports = ["os", "torch", "torch.distributed"]
    assert unreported([step, clock, phase, anyone], imports) == [step, phase, anyone]
    assert unreported([step, phase], ["chameleon_runtime"]) == []
    assert unreported([step], ["chameleon_runtime.scriptbeat:heartbeat"]) == []


@pytest.mark.slow
@pytest.mark.timeout(60)  # 3 s measured
def test_a_step_fault_a_plain_script_never_reaches_is_said_and_fails_require_faults(tmp_path):
    write(tmp_path / "silent.py", SILENT)
    done = run(
        "run", "--standalone", "--nproc-per-node", "2", "--require-faults", "--json",
        "--events", str(tmp_path / "run.events"), "--inject-fault", "kill:rank=1,step=5",
        "silent.py", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 4, done.stderr[-2000:]
    assert "--inject-fault kill rank 1 at step 5 (attempt 0): steps and recoveries" in done.stderr
    assert "at=SECONDS of a named rank fires by the clock" in done.stderr
    outcome = json.loads(done.stdout)  # (the workers' lines go to stderr under --json)
    assert outcome["exit_code"] == 4 and outcome["failures"] == []
    assert outcome["faults_not_fired"] == ["kill rank 1 at step 5 (attempt 0)"]
    assert "no fault fired (--require-faults)" in outcome["reason"]
    (never,) = [e for e in events(tmp_path / "run.events") if e["event"] == "faults_not_fired"]
    assert never["faults"] == ["kill rank 1 at step 5 (attempt 0)"]
    # without --json, the summary's table says the same
    done = run(
        "run", "--standalone", "--nproc-per-node", "2", "--plain",
        "--inject-fault", "kill:rank=1,step=5", "silent.py", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Faults asked for that never fired" in done.stderr
    assert "kill rank 1 at step 5 (attempt 0)" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(60)  # 4 s measured
def test_a_plain_scripts_heartbeats_are_its_steps_for_a_step_fault(tmp_path):
    write(tmp_path / "beating.py", BEATING)
    done = run(
        "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
        "--require-faults", "--events", str(tmp_path / "run.events"),
        "--inject-fault", "kill:rank=1,step=10", "beating.py", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]  # killed, restarted, finished
    assert "steps and recoveries are those" not in done.stderr  # (it imports the runtime)
    log = events(tmp_path / "run.events")
    (fired,) = [e for e in log if e["event"] == "fault_injected"]
    assert fired["rank"] == 1
    assert [e["rank"] for e in log if e["event"] == "failure"] == [1]
    assert not [e for e in log if e["event"] == "faults_not_fired"]
    # an exit fault at a beat: a plain script cannot be asked to exit, it gets SIGTERM
    done = run(
        "run", "--standalone", "--nproc-per-node", "2", "--events", str(tmp_path / "exit.events"),
        "--inject-fault", "exit:rank=1,step=10,code=7", "beating.py", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 128 + 15, done.stderr[-2000:]
    log = events(tmp_path / "exit.events")
    assert [e["rank"] for e in log if e["event"] == "fault_injected"] == [1]
    assert not [e for e in log if e["event"] == "exit_requested"]
