"""The chaos soak (benchmarks/chaos.py), short: six workers planned as the shared 2-core
host they run on, at least five faults of mixed kinds, some inside recoveries (a kill may
land in a step's all-reduce), replacements rejoining. Nothing may wedge, nothing may
restart unless every holder of some layer was lost at once (on 2 cores the planner keeps
two whole replicas, and a kill in the middle of the recovery from a kill of the other can
take both), and the final weights and loss must be those of the failure-free run within
the default runtime's stated tolerance (docs/runtime.md): float32 sums change order with
every layout, so the soak measures that floor in the same run (failure-free on 4 workers
against 6) and allows the larger of 1e-3 and 3x it. The floor itself must stay under 1e-3
for a run this short (CI once measured 1.27e-3 after the faults: over a flat 1e-3, within
its floor's rule)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.clock import budget
from tests.launcher.helpers import env

ROOT = Path(__file__).resolve().parents[2]

# a soak: scripts/soak.sh runs it (before resolving anything that touches recovery)
pytestmark = [pytest.mark.slow, pytest.mark.soak]


@pytest.mark.timeout(600)  # three runs (reference, chaos, floor): 130-230 s on 2 shared cores
def test_a_short_chaos_run_recovers_in_place_every_fault_it_can(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--seed", "1", "--faults", "6",
         "--workers", "6", "--gap", "100", "--float32", "--json", "--keep", str(tmp_path)],
        env=env(), capture_output=True, text=True, timeout=budget(580),
    )  # fmt: skip
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["ok"], result.stdout[-3000:] + result.stderr[-3000:]
    assert report["faults_injected"] >= 6 and not report["wedged"]
    assert report["restarts"] == sum(report["restarts_forced"]), report["restart_reasons"]
    assert report["recovered_in_place"] >= 4
    assert any(k.startswith("kill in ") for k in report["faults_by_kind"])  # inside recoveries
    assert report["floor_weights_rel_diff"] <= 1e-3 and report["floor_loss_rel_diff"] <= 1e-3
    # (the soak's own tolerance: max(1e-3, 3x its floor), benchmarks/chaos.py)
    tolerance = report["tolerance"]
    assert tolerance == max(
        1e-3, 3 * report["floor_weights_rel_diff"], 3 * report["floor_loss_rel_diff"]
    )
    assert report["weights_max_rel_diff"] <= tolerance and report["holders_agree"]
    assert report["final_loss_rel_diff"] <= tolerance
    assert report["steps_lost"] == 0 or report["restarts"], "steps lost in place"
