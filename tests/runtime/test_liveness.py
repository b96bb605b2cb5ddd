"""Liveness apart from progress, end to end (real processes, tests/runtime/mlp.py): a slow
healthy step is not a hang; a worker stalled in its first step is found and blamed alone;
a replacement whose start-up outlasts the heartbeat timeout is judged by its own beats."""

from pathlib import Path

import pytest

from tests import prefork, references
from tests.clock import budget
from tests.launcher.helpers import chameleon_cmd, env, events, leftovers
from tests.runtime.test_recovery import dumps

MLP = str(Path(__file__).resolve().parent / "mlp.py")

pytestmark = pytest.mark.slow


def run_mlp(tmp: Path, name: str, *flags: str, workers: int, steps: int, extra_env=None, args=()):
    out = tmp / name
    out.mkdir()
    log = out / "events.jsonl"
    result = prefork.run(
        chameleon_cmd(
            "run", "--plain", "--standalone", "--nproc-per-node", str(workers), "--events",
            str(log), *flags, MLP, "--steps", str(steps), "--dump", str(out / "dump"), *args,
        ),
        cwd=out, env={**env(), **(extra_env or {})}, timeout=budget(240),
    )  # fmt: skip
    assert leftovers(out) == [], "workers outlived the launcher"
    checks, _losses = dumps(out)
    return result, events(log), checks


def named(evs, name):
    return [e for e in evs if e["event"] == name]


@pytest.mark.timeout(60)  # 11 s measured
def test_steps_slower_than_the_heartbeat_timeout_are_not_hangs(tmp_path):
    # Each step sleeps 2.5 s; a worker's heartbeat thread beats through it.
    result, evs, _ = run_mlp(
        tmp_path, "slow", "--heartbeat-timeout", "1", workers=2, steps=3,
        extra_env={"MLP_STEP_SLEEP_S": "2.5"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert named(evs, "failure") == []


@pytest.mark.timeout(90)  # 21 s measured
def test_a_worker_stalled_in_its_first_step_is_blamed_alone_and_the_rest_recover(tmp_path):
    # Rank 1 blocks forever before step 0; its peers wait on it. Within the startup
    # timeout it is found, blamed (not the peers waiting on it) and the others go on.
    # (The timeout must cover 4 workers importing torch on 2 cores: 4.4 s measured, so a
    # 4 s timeout failed healthy workers that had not beaten yet.)
    reference = references.mlp(workers=3, steps=12)
    result, evs, checks = run_mlp(
        tmp_path, "stall", "--startup-timeout", "12", "--max-rejoins", "0", "--max-restarts", "0",
        workers=4, steps=12, extra_env={"MLP_STALL_RANK": "1", "MLP_STALL_STEP": "0"},
        args=("--stages", "1"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (failure,) = named(evs, "failure")
    assert failure["rank"] == 1 and failure["kind"] == "hang"
    assert "no progress" in failure["message"] and "wait on it" in failure["message"]
    (stalled,) = named(evs, "stalled")
    assert stalled["rank"] == 1
    # Before it was killed, it wrote its stacks (every thread's) to its log and the console:
    # where it was stuck, the stall's frame among them.
    mine = [line for line in result.stderr.splitlines() if line.startswith("[rank 1]")]
    assert any("most recent call first" in line for line in mine), result.stderr[-3000:]
    assert any("mlp.py" in line for line in mine)
    assert named(evs, "recovered") and [e["attempt"] for e in named(evs, "workers_started")] == [0]
    # Data parallel over 3 survivors: the same weights as 3 workers from the start.
    for layer, values in checks.items():
        assert max(values) == min(values)
        assert values[0] == pytest.approx(reference[layer][0], rel=1e-5)


@pytest.mark.timeout(60)  # 16 s measured
def test_a_replacement_slow_to_start_is_judged_by_its_own_heartbeats(tmp_path):
    # Rank 3 is killed; its replacement sleeps 5 s before it even imports the runtime, far
    # past --heartbeat-timeout 3. Judged on its dead predecessor's last heartbeat it was
    # killed as hung; it must start, join and be counted as a worker of the job again.
    result, evs, _ = run_mlp(
        tmp_path, "rejoin", "--heartbeat-timeout", "3", "--inject-fault", "kill:rank=3,step=3",
        workers=4, steps=200,
        extra_env={"MLP_JOIN_SLEEP_S": "5", "MLP_STEP_SLEEP_S": "0.05"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    failures = named(evs, "failure")
    assert [f["rank"] for f in failures] == [3], (failures, result.stderr[-3000:])  # the kill only
    (respawned,) = named(evs, "worker_respawned")
    assert respawned["rank"] == 3
    assert any(3 in e["ranks"] for e in named(evs, "admitted"))
