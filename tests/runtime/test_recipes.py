"""Training recipes across stages and replicas, end to end (real processes, gloo):

- global-norm gradient clipping: a run of 2 pipelines of 2 stages clipping at
  --max-grad-norm ends with the weights of one process that trains the whole model and
  clips with torch.nn.utils.clip_grad_norm_, and so does a run whose worker is killed
  mid-way and recovered in place;
- bf16 (autocast, fp32 master weights), with clipping on: a run with a kill ends with the
  weights of the failure-free run, whatever layout the recovery moves to;
- fp16 with dynamic loss scaling, clipping on, from a loss scale that overflows: every
  worker skips the same steps, and a run with a kill ends with the failure-free fp16
  weights and loss scale."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from chameleon_runtime.data import Batches
from chameleon_runtime.shard import build_layer
from tests.launcher.helpers import events, free_port, run
from tests.runtime.mlp import LR, make_data, make_layer

ROOT = Path(__file__).resolve().parents[2]
MLP = str(ROOT / "tests" / "runtime" / "mlp.py")
LAYERS, STEPS, BATCH, MICRO = 4, 12, 8, 2
MAX_NORM = 0.2  # well below the MLP's gradient norms here: every step is clipped
TOLERANCE = 1e-5  # float64 sums of float32 gradients against autograd's float32 sums

pytestmark = pytest.mark.slow


def checksum(module: torch.nn.Module) -> float:
    """chameleon_runtime.shard.Shard.checksum of one layer."""
    with torch.no_grad():
        return float(
            sum(p.double().sum() + (p.double() ** 2).sum() * 1e-3 for p in module.parameters())
        )


def single_process(max_norm: float | None) -> tuple[dict[int, float], list[float]]:
    """The whole model in one process, the same batches in the same micro-batches, torch's
    own clipping over all of its parameters. Returns checksums per layer and the
    pre-clipping norm of every step."""
    layers = [build_layer(lambda i: make_layer(i, LAYERS), 0, i) for i in range(LAYERS)]
    params = [p for layer in layers for p in layer.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    batches = Batches(make_data(), global_batch_size=BATCH, micro_batch_size=MICRO)
    m = batches.num_micro_batches
    norms = []
    for step in range(STEPS):
        for mb in range(m):
            x = batches.inputs(step, mb)
            for layer in layers:
                x = layer(x)
            (F.cross_entropy(x, batches.targets(step, mb)) / m).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm or float("inf"))))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {i: checksum(layer) for i, layer in enumerate(layers)}, norms


def chameleon(
    tmp: Path, *flags: str, script: tuple[str, ...] = ()
) -> tuple[dict[int, list[float]], list[dict]]:
    log = tmp / "events.jsonl"
    result = run(
        "run", "--nproc-per-node", "4", "--plain", "--master-port", str(free_port()),
        "--events", str(log), *flags, MLP, "--steps", str(STEPS), "--stages", "2",
        "--layers", str(LAYERS), "--global-batch", str(BATCH), "--max-grad-norm",
        str(MAX_NORM), "--dump", str(tmp / "dump"), *script,
        cwd=tmp, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    checks: dict[int, list[float]] = {}
    for f in glob.glob(str(tmp / "dump.rank*.json")):
        dump = json.loads(Path(f).read_text())
        for layer, value in dump["checksums"].items():
            checks.setdefault(int(layer), []).append(value)
        if dump["checksums"]:  # a worker of the last plan (a spare's state is not current)
            checks.setdefault(-1, []).append(dump["loss_scale"])  # -1: fp16's loss scale
    return checks, events(log)


def assert_weights(checks: dict[int, list[float]], expected: dict[int, float]) -> None:
    scales = checks.pop(-1)
    assert len(set(scales)) == 1, f"workers end with different loss scales {scales}"
    assert scales[0] == expected.get(-1), scales
    assert sorted(checks) == sorted(k for k in expected if k >= 0)
    for layer, values in checks.items():
        assert max(values) == min(values), f"holders of layer {layer} disagree"
        assert values[0] == pytest.approx(expected[layer], rel=TOLERANCE, abs=TOLERANCE), layer


@pytest.fixture(scope="module")
def clipped():
    weights, norms = single_process(MAX_NORM)
    unclipped, _ = single_process(None)
    assert min(norms) > MAX_NORM  # every step clips: the test is about something
    assert any(abs(weights[i] - unclipped[i]) > 100 * TOLERANCE for i in weights)
    return weights


@pytest.mark.timeout(60)  # 5 s measured
def test_clipping_across_stages_and_replicas_is_clipping_the_whole_model(tmp_path, clipped):
    checks, _events = chameleon(tmp_path)
    assert_weights(checks, clipped | {-1: None})


@pytest.mark.timeout(60)  # 5 s measured
def test_a_run_with_a_kill_ends_with_the_clipped_failure_free_weights(
    tmp_path, clipped, monkeypatch
):
    # steps of a few milliseconds could all be over before the launcher sees step 5
    monkeypatch.setenv("MLP_STEP_SLEEP_S", "0.05")
    checks, evs = chameleon(tmp_path, "--inject-fault", "kill:rank=3,step=5")
    assert [e for e in evs if e["event"] == "recovered"], "no in-place recovery"
    assert not [e for e in evs if e["event"] == "restart"]
    assert_weights(checks, clipped | {-1: None})


def free_and_killed(
    tmp: Path, monkeypatch: pytest.MonkeyPatch, script: tuple[str, ...], kill_step: int
) -> tuple[dict[int, list[float]], dict[int, list[float]], list[dict]]:
    """The same run failure-free, and with rank 3 killed at ``kill_step`` and recovered
    by a re-partition, which changes how layers are grouped into stages: the free run's
    checks, the killed run's checks and its events."""
    (tmp / "free").mkdir()
    (tmp / "kill").mkdir()
    free, _ = chameleon(tmp / "free", script=script)
    monkeypatch.setenv("MLP_STEP_SLEEP_S", "0.05")
    checks, evs = chameleon(
        tmp / "kill", "--policy", "reparallelize", "--inject-fault",
        f"kill:rank=3,step={kill_step}", script=script,
    )  # fmt: skip
    return free, checks, evs


@pytest.mark.timeout(60)  # 10 s measured
def test_bf16_with_a_kill_ends_with_the_failure_free_bf16_weights(tmp_path, clipped, monkeypatch):
    # every layer's output is rounded to bf16, so the re-partition must not change the
    # arithmetic
    free, checks, evs = free_and_killed(tmp_path, monkeypatch, ("--precision", "bf16"), 5)
    reference = {layer: values[0] for layer, values in free.items()}
    # bf16 is on: its weights are not fp32's
    assert any(abs(reference[i] - clipped[i]) > 10 * TOLERANCE for i in clipped)
    recovered = [e for e in evs if e["event"] == "recovered"]
    assert recovered and recovered[0]["policy"] == "reparallelize"
    assert_weights(checks, reference)


@pytest.mark.timeout(60)  # 10 s measured
def test_fp16_skips_overflowing_steps_alike_and_a_kill_keeps_the_failure_free_weights(
    tmp_path, clipped, monkeypatch
):
    # 2^24 overflows fp16's gradients here: the first steps are skipped while the scale
    # halves, on every worker alike (else replicas would disagree and the commit break)
    fp16 = ("--precision", "fp16", "--init-loss-scale", str(2.0**24))
    free, checks, evs = free_and_killed(tmp_path, monkeypatch, fp16, 3)
    scale = free[-1][0]
    assert scale < 2.0**24 and len(set(free[-1])) == 1, free[-1]
    reference = {layer: values[0] for layer, values in free.items()}
    assert any(abs(reference[i] - clipped[i]) > 10 * TOLERANCE for i in clipped)
    assert [e for e in evs if e["event"] == "recovered"], "no in-place recovery"
    assert_weights(checks, reference)
