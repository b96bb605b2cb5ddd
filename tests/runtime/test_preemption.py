"""A preemption notice (chameleon run --signals-to-handle SIGUSR1, as Slurm's
--signal=USR1@N sends it to every process of the job step): the workers save at the same step and leave, the launcher
exits 75 (requeue me) within the grace period; the requeued run resumes from the save and
ends with the failure-free weights (float64). tests/runtime/preempt_script.py is the loop."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.clock import budget
from tests.launcher.helpers import env, events, leftovers, start

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "runtime" / "preempt_script.py")
GRACE_S = 20.0

pytestmark = pytest.mark.slow


def _rank_json(tmp: Path, name: str) -> dict[int, dict]:
    import json

    return {r: json.loads((tmp / f"{name}.rank{r}.json").read_text()) for r in (0, 1)}


def _launch(tmp: Path, mode: str, name: str, *extra: str) -> subprocess.Popen:
    return start(
        "run", "--standalone", "--nproc-per-node", "2", "--signals-to-handle", "SIGUSR1",
        "--preemption-grace", str(GRACE_S), "--events", str(tmp / f"{name}.events"), *extra,
        SCRIPT, "--mode", mode, "--ckpt", str(tmp / "ckpt.pt"), "--out", str(tmp / name),
        cwd=tmp, log=tmp / f"{name}.log",
    )  # fmt: skip


def _notice_after(tmp: Path, launcher: subprocess.Popen, name: str, step: int) -> float:
    """USR1 to the launcher once rank 0 has done ``step`` steps; when it was sent."""
    progress = tmp / f"{name}.progress0"
    deadline = time.monotonic() + budget(120)
    while time.monotonic() < deadline:
        # One read: the script rewrites the file each step, so a second read can find
        # it truncated and empty (seen in CI).
        done = progress.read_text().strip() if progress.exists() else ""
        if done and int(done) >= step:
            break
        assert launcher.poll() is None, (tmp / f"{name}.log").read_text()[-2000:]
        time.sleep(0.02)
    sent = time.monotonic()
    launcher.send_signal(signal.SIGUSR1)
    return sent


@pytest.mark.timeout(90)  # 12 s measured; 23 s with a core busy
def test_the_drop_in_saves_at_one_step_leaves_75_and_the_requeue_ends_as_if_never_stopped(
    tmp_path,
):
    alone = subprocess.run(
        [sys.executable, SCRIPT, "--mode", "alone", "--step-s", "0", "--ckpt",
         str(tmp_path / "alone.pt"), "--out", str(tmp_path / "alone")],
        env={**env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=budget(120),
    )  # fmt: skip
    assert alone.returncode == 0, alone.stderr[-2000:]
    import json

    reference = json.loads((tmp_path / "alone.rank0.json").read_text())["state"]

    launcher = _launch(tmp_path, "chameleon", "first")
    sent = _notice_after(tmp_path, launcher, "first", 5)
    assert launcher.wait(timeout=budget(GRACE_S + 30)) == 75, (tmp_path / "first.log").read_text()[
        -3000:
    ]
    assert time.monotonic() - sent < GRACE_S
    assert leftovers(tmp_path) == []
    first = _rank_json(tmp_path, "first")
    stops = {r: out["stopped"] for r, out in first.items()}
    assert stops[0] == stops[1] and 5 <= stops[0] < 40, stops  # one step, on both
    assert first[0]["state"] == first[1]["state"]
    log = [e["event"] for e in events(tmp_path / "first.events")]
    assert "preemption_notice" in log
    (notice,) = [e for e in events(tmp_path / "first.events") if e["event"] == "preemption_notice"]
    assert notice["told"] == [0, 1] and notice["signalled"] == []  # the mailbox, no signal
    (end,) = [e for e in events(tmp_path / "first.events") if e["event"] == "exit"]
    assert end["exit_code"] == 75 and "preempted (SIGUSR1): the workers stopped" in end["reason"]
    assert (tmp_path / "ckpt.pt").exists()

    requeued = _launch(tmp_path, "chameleon", "second")
    assert requeued.wait(timeout=budget(120)) == 0, (tmp_path / "second.log").read_text()[-3000:]
    for out in _rank_json(tmp_path, "second").values():
        assert out["step"] == 40 and out["stopped"] is None
        for key, want in reference.items():
            got = out["state"][key]
            diff = sum((a - b) ** 2 for a, b in zip(want, got)) ** 0.5
            assert diff <= 1e-9 * (sum(a * a for a in want) ** 0.5), key


@pytest.mark.timeout(60)  # 4 s measured
def test_a_notice_slurm_sends_to_every_process_of_the_step_is_heard_by_the_workers_too(tmp_path):
    # Slurm's --signal (and scancel --signal) reaches every process of the job step: the
    # workers get USR1 themselves, whose default action would end them.
    launcher = _launch(tmp_path, "chameleon", "all")
    _notice_after(tmp_path, launcher, "all", 5)
    started = next(e for e in events(tmp_path / "all.events") if e["event"] == "workers_started")
    for pid in started["pids"]:
        os.kill(pid, signal.SIGUSR1)
    assert launcher.wait(timeout=budget(GRACE_S + 30)) == 75, (tmp_path / "all.log").read_text()[
        -3000:
    ]
    out = _rank_json(tmp_path, "all")
    assert out[0]["stopped"] == out[1]["stopped"] is not None
    assert [e for e in events(tmp_path / "all.events") if e["event"] == "failure"] == []


@pytest.mark.timeout(60)  # 4 s measured
def test_a_plain_script_gets_the_signal_and_saves_what_it_agrees_on(tmp_path):
    launcher = _launch(tmp_path, "plain", "plain")
    sent = _notice_after(tmp_path, launcher, "plain", 5)
    assert launcher.wait(timeout=budget(GRACE_S + 30)) == 75, (tmp_path / "plain.log").read_text()[
        -3000:
    ]
    assert time.monotonic() - sent < GRACE_S
    out = _rank_json(tmp_path, "plain")
    assert out[0]["stopped"] == out[1]["stopped"] is not None
    (notice,) = [e for e in events(tmp_path / "plain.events") if e["event"] == "preemption_notice"]
    assert notice["signalled"] == [0, 1]  # forwarded, as torchrun does
    assert (tmp_path / "ckpt.pt").exists()


@pytest.mark.timeout(60)  # 5 s measured
def test_workers_that_do_not_save_are_stopped_at_the_end_of_the_grace_period(tmp_path):
    launcher = start(
        "run", "--standalone", "--nproc-per-node", "2", "--signals-to-handle", "SIGUSR1",
        "--preemption-grace", "2", "--events", str(tmp_path / "deaf.events"), SCRIPT,
        "--mode", "chameleon", "--ignore-notice", "--steps", "100000", "--ckpt",
        str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "deaf"),
        cwd=tmp_path, log=tmp_path / "deaf.log",
    )  # fmt: skip
    sent = _notice_after(tmp_path, launcher, "deaf", 3)
    assert launcher.wait(timeout=budget(30)) == 75, (tmp_path / "deaf.log").read_text()[-3000:]
    assert 2.0 <= time.monotonic() - sent < 8.0
    (end,) = [e for e in events(tmp_path / "deaf.events") if e["event"] == "exit"]
    assert "stopped at the end of the grace period" in end["reason"]
    assert leftovers(tmp_path) == []


@pytest.mark.timeout(60)  # 3 s measured
def test_ctrl_c_during_the_grace_period_stops_the_run_at_once(tmp_path):
    launcher = start(
        "run", "--standalone", "--nproc-per-node", "2", "--signals-to-handle", "SIGUSR1",
        "--preemption-grace", "60", SCRIPT, "--mode", "chameleon", "--ignore-notice",
        "--steps", "100000", "--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "c"),
        cwd=tmp_path, log=tmp_path / "c.log",
    )  # fmt: skip
    _notice_after(tmp_path, launcher, "c", 3)
    time.sleep(0.5)
    sent = time.monotonic()
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=budget(30)) == 130, (tmp_path / "c.log").read_text()[-3000:]
    assert time.monotonic() - sent < 5.0
    assert leftovers(tmp_path) == []


MLP = str(ROOT / "tests" / "runtime" / "mlp.py")


def _mlp(tmp: Path, name: str, *flags: str, sleep_s: float = 0.0) -> subprocess.Popen:
    return start(
        "run", "--standalone", "--nproc-per-node", "2", "--events", str(tmp / f"{name}.events"),
        *flags, MLP, "--steps", "60", "--stages", "2", "--exact", "--checkpoint-dir",
        str(tmp / f"{name}.ckpt" if name == "ref" else tmp / "ckpt"), "--dump", str(tmp / name),
        cwd=tmp, log=tmp / f"{name}.log", env={"MLP_STEP_SLEEP_S": str(sleep_s)},
    )  # fmt: skip


def _dumps(tmp: Path, name: str) -> list[dict]:
    import json

    return [json.loads(p.read_text()) for p in sorted(tmp.glob(f"{name}.rank*.json"))]


@pytest.mark.timeout(120)  # 12 s measured; 32 s with a core busy
def test_a_pipeline_stops_at_one_step_saves_and_the_requeue_ends_with_the_same_bits(tmp_path):
    # The Trainer's stages cannot agree on a step inside one (no collective spans them):
    # the leader's recovery brings them to one, with a plan that says stop, and they save.
    ref = _mlp(tmp_path, "ref")
    assert ref.wait(timeout=budget(120)) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    first = _mlp(tmp_path, "first", "--signals-to-handle", "SIGUSR1", sleep_s=0.05)
    deadline = time.monotonic() + budget(120)
    while time.monotonic() < deadline:
        steps = [
            e.get("step", 0) for e in events(tmp_path / "first.events") if e["event"] == "step"
        ]
        if steps and max(steps) >= 5:
            break
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.05)
    first.send_signal(signal.SIGUSR1)
    assert first.wait(timeout=budget(GRACE_S + 30)) == 75, (tmp_path / "first.log").read_text()[
        -3000:
    ]
    dumps = _dumps(tmp_path, "first")
    assert [d["preempted"] for d in dumps] == [True, True]
    import json

    saved = json.loads((tmp_path / "ckpt" / "latest").read_text())["step"]
    assert 5 <= saved < 59 and all(max(map(int, d["losses"])) == saved for d in dumps)
    plan = [e for e in events(tmp_path / "first.events") if e["event"] == "plan_chosen"][-1]
    assert plan["policy"] == "reroute"
    requeued = _mlp(tmp_path, "second")
    assert requeued.wait(timeout=budget(120)) == 0, (tmp_path / "second.log").read_text()[-3000:]
    want = {k: v for d in _dumps(tmp_path, "ref") for k, v in d["checksums"].items()}
    got = {k: v for d in _dumps(tmp_path, "second") for k, v in d["checksums"].items()}
    assert got == want  # Trainer(exact=True): the same bits as the run never stopped
