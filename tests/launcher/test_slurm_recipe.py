"""examples/slurm/train.sbatch as Slurm would run it: its srun and scontrol are stand-ins
on PATH (srun starts one task per node with SLURM_NODEID set, as srun --ntasks-per-node=1
does; scontrol records what it was asked), everything else is real: two `chameleon run`
agents that take the rendezvous from SLURM_*, drop-in workers, a USR1 preemption notice,
exit 75 and the requeue it asks for, then the requeued run finishing from the checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.clock import budget
from tests.launcher.helpers import env, leftovers, write
from tests.launcher.test_multinode import _free_slurm_job_id

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "runtime" / "preempt_script.py"

pytestmark = pytest.mark.slow

SRUN = """
    #!/bin/bash
    # srun --ntasks-per-node=1 CMD...: one task per node, in the background, their pids
    # recorded; the step's code is the first non-zero one.
    while [ "${1#--}" != "$1" ]; do shift; done
    pids=()
    for n in $(seq 0 $((SLURM_JOB_NUM_NODES - 1))); do
        SLURM_NODEID=$n SLURM_PROCID=$n SLURM_STEP_ID=0 SLURM_STEP_NUM_TASKS=$SLURM_JOB_NUM_NODES \
            SLURM_STEP_NUM_NODES=$SLURM_JOB_NUM_NODES SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST "$@" &
        pids+=($!)
        echo $! >> "$FAKE_SLURM/tasks"
    done
    rc=0
    for p in "${pids[@]}"; do wait "$p"; code=$?; [ $rc -eq 0 ] && rc=$code; done
    exit $rc
"""
SCONTROL = """
    #!/bin/bash
    echo "$*" >> "$FAKE_SLURM/scontrol.calls"
"""
CHAMELEON = f"""
    #!/bin/bash
    exec {sys.executable} -m chameleon_cli "$@"
"""


def _sbatch(tmp: Path, job: str, restarts: int) -> subprocess.Popen:
    fake = tmp / "fake"
    fake.mkdir(exist_ok=True)
    (fake / "tasks").unlink(missing_ok=True)
    for name, body in (("srun", SRUN), ("scontrol", SCONTROL), ("chameleon", CHAMELEON)):
        os.chmod(write(fake / name, body.lstrip("\n")), 0o755)
    train = f"{SCRIPT} --mode chameleon --steps 60 --ckpt {tmp / 'ckpt.pt'} --out {tmp / 'out'}"
    slurm = {
        "SLURM_JOB_ID": job,
        "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_SUBMIT_DIR": str(tmp),
        "SLURM_RESTART_COUNT": str(restarts),
        "FAKE_SLURM": str(fake),
        "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}",
        "TRAIN": train,
        "NPROC_PER_NODE": "1",
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.Popen(
        ["bash", str(ROOT / "examples" / "slurm" / "train.sbatch")],
        cwd=ROOT,
        env={**env(), **slurm},
        stdout=open(tmp / f"sbatch{restarts}.log", "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
    )


@pytest.mark.timeout(60)  # 13 s measured
def test_the_sbatch_recipe_saves_requeues_and_the_requeue_finishes(tmp_path):
    job = _free_slurm_job_id()
    first = _sbatch(tmp_path, job, 0)
    deadline = time.monotonic() + budget(120)
    progress = tmp_path / "out.progress0"
    while not (progress.exists() and progress.read_text().strip() >= "5"):
        assert first.poll() is None and time.monotonic() < deadline, (
            tmp_path / "sbatch0.log"
        ).read_text()[-3000:]
        time.sleep(0.05)
    for pid in (tmp_path / "fake" / "tasks").read_text().split():  # every task of the step
        os.kill(int(pid), signal.SIGUSR1)
    assert first.wait(timeout=budget(60)) == 75, (tmp_path / "sbatch0.log").read_text()[-3000:]
    log = (tmp_path / "sbatch0.log").read_text()
    assert "saved and stopped" in log and "requeued" in log
    assert (tmp_path / "fake" / "scontrol.calls").read_text().split() == ["requeue", job]
    stopped = {json.loads((tmp_path / f"out.rank{r}.json").read_text())["stopped"] for r in (0, 1)}
    assert len(stopped) == 1 and None not in stopped  # both at one step

    (tmp_path / "fake" / "scontrol.calls").unlink()
    second = _sbatch(tmp_path, job, 1)  # the requeued job: same id, SLURM_RESTART_COUNT=1
    assert second.wait(timeout=budget(120)) == 0, (tmp_path / "sbatch1.log").read_text()[-3000:]
    assert "chameleon: finished" in (tmp_path / "sbatch1.log").read_text()
    assert f"--rdzv-id {job}-requeue1 (SLURM_JOB_ID)" in (tmp_path / "sbatch1.log").read_text()
    assert not (tmp_path / "fake" / "scontrol.calls").exists()
    for r in (0, 1):
        assert json.loads((tmp_path / f"out.rank{r}.json").read_text())["step"] == 60
    assert leftovers(tmp_path) == []
