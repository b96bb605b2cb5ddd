"""The runtime on a CUDA GPU (``pytest -m gpu``; skipped where no GPU is visible, as on CI).

- ranks sharing one GPU, gloo transport with CUDA tensors staged through pinned host
  memory: a run with a kill -9 recovers in place and ends with the failure-free weights;
- a single-rank NCCL smoke test (one GPU cannot hold two ranks of one NCCL communicator);
- the same job's step time on the GPU and on the CPU, printed (a figure, not a bound).
"""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path

import pytest
import torch

from tests.launcher.helpers import events, free_port, run

ROOT = Path(__file__).resolve().parents[2]
MLP = str(ROOT / "tests" / "runtime" / "mlp.py")
GPT = str(ROOT / "examples" / "train_gpt.py")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible"),
]


def _mlp(tmp: Path, nproc: int, *flags: str, script: tuple[str, ...] = ()) -> tuple[dict, list]:
    log = tmp / "events.jsonl"
    result = run(
        "run", "--nproc-per-node", str(nproc), "--plain", "--master-port", str(free_port()),
        "--events", str(log), *flags, MLP, "--steps", "12", "--stages", "2", "--layers", "4",
        "--global-batch", "8", "--device", "cuda", "--dump", str(tmp / "dump"), *script,
        cwd=tmp, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    checks: dict[int, list[float]] = {}
    for f in glob.glob(str(tmp / "dump.rank*.json")):
        for layer, value in json.loads(Path(f).read_text())["checksums"].items():
            checks.setdefault(int(layer), []).append(value)
    return checks, events(log)


def test_ranks_sharing_a_gpu_recover_a_kill_with_the_failure_free_weights(tmp_path, monkeypatch):
    (tmp_path / "free").mkdir()
    (tmp_path / "kill").mkdir()
    free, _ = _mlp(tmp_path / "free", 4)
    monkeypatch.setenv("MLP_STEP_SLEEP_S", "0.05")
    checks, evs = _mlp(tmp_path / "kill", 4, "--inject-fault", "kill:rank=3,step=5")
    assert [e for e in evs if e["event"] == "recovered"], "no in-place recovery"
    assert sorted(checks) == sorted(free)
    for layer, values in checks.items():
        assert max(values) == min(values), f"holders of layer {layer} disagree"
        assert values[0] == pytest.approx(free[layer][0], rel=1e-6, abs=1e-6), layer


def test_a_single_rank_trains_on_nccl(tmp_path):
    checks, _ = _mlp(tmp_path, 1, script=("--transport", "native"))
    assert sorted(checks) == [0, 1, 2, 3]


def _mean_step_ms(tmp: Path, device: str) -> float:
    result = run(
        "run", "--nproc-per-node", "2", "--plain", "--master-port", str(free_port()), GPT,
        "--steps", "30", "--pipeline-stages", "2", "--device", device,
        "--checkpoint-dir", str(tmp / device), cwd=tmp, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    times = [float(m) for m in re.findall(r"loss \S+\s+([\d.]+) ms", result.stdout)]
    assert len(times) >= 20, result.stdout[-2000:]
    return sum(times[10:]) / len(times[10:])  # past warm-up


def test_step_time_on_the_gpu_against_the_cpu(tmp_path):
    cpu, gpu = _mean_step_ms(tmp_path, "cpu"), _mean_step_ms(tmp_path, "cuda")
    print(f"\ntrain_gpt.py, 2 ranks, 2 stages: cpu {cpu:.1f} ms/step, cuda {gpu:.1f} ms/step")
