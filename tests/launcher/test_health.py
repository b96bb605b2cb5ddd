"""--health-check (launcher/health.py): a node that fails it does not join, and a
replacement is not started where it fails; the summary says why. Real agents, real
workers, a real shell command that fails on demand."""

import pytest

from tests.clock import budget
from tests.launcher.helpers import events, free_port, leftovers, run, start, write
from tests.launcher.test_multinode import DDP

pytestmark = pytest.mark.slow

FAILS = "echo 'GPU 3: 12 uncorrectable ECC errors' >&2; exit 1"


@pytest.mark.timeout(60)  # 3 s measured
def test_a_node_that_fails_the_check_does_not_start_its_workers(tmp_path):
    script = write(tmp_path / "ddp.py", DDP)
    log = tmp_path / "events.jsonl"
    done = run(
        "run", "--standalone", "--nproc-per-node", "2", "--health-check", FAILS,
        "--events", str(log), str(script), "5", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    assert (
        "this node failed --health-check (exit 1: GPU 3: 12 uncorrectable ECC errors): "
        "not joining" in done.stderr
    )
    names = [e["event"] for e in events(log)]
    assert "health_check" in names and "workers_started" not in names
    assert not list(tmp_path.glob("progress_*"))


@pytest.mark.timeout(60)  # 7 s measured
def test_an_elastic_job_forms_without_the_unhealthy_node(tmp_path):
    script = write(tmp_path / "ddp.py", DDP)
    port = free_port()
    common = [
        "run", "--nnodes", "2:3", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "health",
        "--rdzv-conf", "last_call_timeout=2",
    ]  # fmt: skip
    token = {"CHAMELEON_JOB_TOKEN": "t0ken"}
    first = start(*common, str(script), "5", cwd=tmp_path, log=tmp_path / "a.log", env=token)
    sick = start(
        *common, "--health-check", FAILS, str(script), "5", cwd=tmp_path,
        log=tmp_path / "sick.log", env=token,
    )  # fmt: skip
    second = run(*common, str(script), "5", cwd=tmp_path, env=token)
    assert second.returncode == 0, second.stderr[-2000:]
    assert first.wait(timeout=budget(60)) == 0, (tmp_path / "a.log").read_text()[-2000:]
    assert sick.wait(timeout=budget(60)) == 3
    assert "failed --health-check" in (tmp_path / "sick.log").read_text()
    for rank in range(4):  # two nodes of two
        assert (tmp_path / f"done_{rank}").read_text() == "4 6.0"
    assert not (tmp_path / "done_4").exists()


MLP = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "runtime" / "mlp.py")


@pytest.mark.timeout(60)  # 5 s measured
def test_a_replacement_is_not_started_where_the_check_fails(tmp_path):
    # Healthy when the node joins, not when the kill's replacement would start there.
    check = write(
        tmp_path / "check.sh",
        """
        if [ "$CHAMELEON_HEALTH_CHECK" = replace ]; then
            echo "GPU $CHAMELEON_HEALTH_RANK fell off the bus"; exit 1
        fi
        """,
    )
    log = tmp_path / "events.jsonl"
    done = run(
        "run", "--standalone", "--nproc-per-node", "2", "--health-check", f"sh {check}",
        "--max-rejoins", "1", "--inject-fault", "kill:rank=1,step=5", "--events", str(log),
        MLP, "--steps", "80", cwd=tmp_path, env={"MLP_STEP_SLEEP_S": "0.02"}, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    evs = events(log)
    checks = [e for e in evs if e["event"] == "health_check"]
    assert [(c["when"], c["ok"]) for c in checks] == [("join", True), ("replace", False)]
    assert checks[1]["why"] == "exit 1: GPU 1 fell off the bus"
    assert not [e for e in evs if e["event"] == "worker_respawned"]
    refused = [e for e in evs if e["event"] == "failure" and e["kind"] == "unhealthy"]
    assert [e["rank"] for e in refused] == [1]
    assert "was not replaced: its node failed --health-check" in done.stderr
    assert "exit 1: GPU 1 fell off the bus" in done.stderr  # the summary's failures
    assert leftovers(tmp_path) == []
