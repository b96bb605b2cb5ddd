"""``Trainer(pipeline_stages="auto")``: the planner picks the layout a job starts on.

Under ``chameleon run`` the leader plans generation 0 from the workers' description
(launcher/coordinator.py) and says so (``launch_planned``); every worker builds the
layers that plan gives it, workers it leaves out wait as spares, and a kill is
recovered in place from there. Without a launcher (torchrun, a plain script) the chief
plans it alone. Each run ends with the weights of one process training the whole model
(exact sums)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher.helpers import events, free_port, run
from tests.runtime.test_recipes import TOLERANCE
from tests.runtime.test_recipes import single_process as _single_process

ROOT = Path(__file__).resolve().parents[2]
MLP = str(ROOT / "tests" / "runtime" / "mlp.py")
LAYERS, STEPS, BATCH = 4, 12, 8

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def expected() -> dict[int, float]:
    weights, _ = _single_process(None)
    return weights


def dumped(tmp: Path) -> tuple[dict[int, list[float]], int]:
    """Checksums by layer over the workers of the last plan, and how many dumped none."""
    checks: dict[int, list[float]] = {}
    idle = 0
    for f in glob.glob(str(tmp / "dump.rank*.json")):
        dump = json.loads(Path(f).read_text())
        idle += not dump["checksums"]
        for layer, value in dump["checksums"].items():
            checks.setdefault(int(layer), []).append(value)
    return checks, idle


def assert_weights(checks: dict[int, list[float]], expected: dict[int, float]) -> None:
    assert sorted(checks) == sorted(expected)
    for layer, values in checks.items():
        assert max(values) == min(values), f"holders of layer {layer} disagree"
        assert values[0] == pytest.approx(expected[layer], rel=TOLERANCE, abs=TOLERANCE)


SCRIPT = ("--steps", str(STEPS), "--stages", "auto", "--layers", str(LAYERS),
          "--global-batch", str(BATCH), "--exact")  # fmt: skip


@pytest.mark.timeout(60)  # 5 s measured
def test_the_leader_plans_the_launch_layout_and_a_kill_recovers_from_it(tmp_path, expected):
    log = tmp_path / "events.jsonl"
    result = run(
        "run", "--nproc-per-node", "4", "--plain", "--master-port", str(free_port()),
        "--events", str(log), "--inject-fault", "kill:rank=1,step=5", MLP, *SCRIPT,
        "--dump", str(tmp_path / "dump"), cwd=tmp_path, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    evs = events(log)
    launch = [e for e in evs if e["event"] == "launch_planned"]
    assert len(launch) == 1, [e["event"] for e in evs]
    resumed = next(e for e in evs if e["event"] == "resumed")
    started = {s["worker"] for s in resumed["plan"]["stages"]}
    assert len(started) == launch[0]["workers"] == 4 - launch[0]["spares"]
    assert any(e["event"] == "recovered" for e in evs), "the kill was not recovered in place"
    assert not any(e["event"] == "restart" for e in evs)
    assert "launch" in result.stderr + result.stdout  # the plans table shows the launch layout
    checks, _ = dumped(tmp_path)
    assert_weights(checks, expected)


@pytest.mark.timeout(60)  # 4 s measured
def test_without_a_launcher_the_chief_plans_the_launch_layout(tmp_path, expected):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHAMELEON_")}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), MLP, *SCRIPT, "--dump", str(tmp_path / "dump")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    checks, _ = dumped(tmp_path)
    assert_weights(checks, expected)


@pytest.mark.timeout(60)  # 3 s measured
def test_auto_alone_in_a_plain_script(tmp_path, expected):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CHAMELEON_") and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK")
    }
    result = subprocess.run(
        [sys.executable, MLP, *SCRIPT, "--dump", str(tmp_path / "dump")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    checks, _ = dumped(tmp_path)
    assert_weights(checks, expected)
