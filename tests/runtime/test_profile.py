"""``chameleon profile`` end to end: two real workers measure the example GPT into a cost
table that the planner then reads through a config."""

import json
from pathlib import Path

import pytest

from planner.config import load_cost_table, load_job
from planner.estimator.estimate import estimate
from planner.plans.planjson import PlanWire
from tests.launcher.helpers import run, write

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "train_gpt.py")
MODEL = ["--blocks", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--micro-batch", "2"]

pytestmark = pytest.mark.slow


@pytest.mark.timeout(60)  # 5 s measured
def test_profile_writes_a_cost_table_the_planner_reads(tmp_path):
    out = tmp_path / "tables" / "gpt.json"
    result = run(
        "profile", "--out", str(out), "--nproc-per-node", "2", "--plain", EXAMPLE, *MODEL,
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    table = load_cost_table(out)
    # embedding, 2 blocks, head: parameter counts are exact, times were measured
    assert [c.name.split(".")[0] for c in table.layers] == ["Embedding", "Block", "Block", "Head"]
    hidden = 32
    vocab = table.layers[0].num_params // hidden - 16  # the example's corpus sets the vocabulary
    assert table.layers[0].num_params == (vocab + 16) * hidden  # tokens + positions
    assert table.layers[3].num_params == 2 * hidden + (hidden + 1) * vocab  # norm + projection
    assert table.layers[1].num_params == table.layers[2].num_params > 12 * hidden * hidden
    assert all(c.forward_s > 0 and c.backward_s > 0 and c.optimizer_s > 0 for c in table.layers)
    assert all(c.activation_bytes == 2 * 16 * hidden * 4 for c in table.layers[:-1])
    assert table.layers[1].stash_bytes > table.layers[1].activation_bytes
    assert table.micro_batch_size == 2 and table.concurrent_workers == 2
    assert table.intra_node is not None and table.intra_node.bandwidth_gb_per_s > 0
    assert "Block.1" in result.stdout and "link" in result.stdout
    # A chain of real transfers of the biggest layer, one at a time round both workers.
    assert table.migration is not None and table.migration.workers == 2
    assert table.migration.layer == max(range(4), key=lambda i: table.layers[i].num_params)
    assert table.migration.wall_s > 0 and table.unpack_cpu_s_per_param > 0

    testbed = (ROOT / "configs" / "cpu_testbed.toml").read_text()
    gpt = testbed[testbed.index("[model.gpt]") : testbed.index("[training]")]
    config = write(
        tmp_path / "tables" / "job.toml",
        testbed.replace(gpt, "")
        .replace('name = "tiny-gpt"', 'name = "tiny-gpt"\ncost_table = "gpt.json"')
        .replace("pp = 4", "pp = 2")
        .replace("dp = 2", "dp = 4"),
    )
    # Real steps of the script's layout were run after the layers (planner.estimator.fit fits what
    # a step costs beyond them): each worker's CPU per step covers its passes.
    steps = table.steps
    assert steps is not None and steps.step_s > 0 and sorted(steps.cpu_s) == [0, 1]
    assert all(steps.cpu_s[w] >= steps.compute_cpu_s[w] > 0 for w in (0, 1))
    job = load_job(config)
    # Fitted: one factor on every layer's time, and the profiled layout's estimate is the
    # step it measured (the layout's critical path or the shared host's bound).
    ratios = [
        x.forward_s / c.forward_s for x, c in zip(job.model.layers, table.layers, strict=True)
    ]
    assert max(ratios) == pytest.approx(min(ratios))
    assert job.cluster.worker_overhead_s >= 0
    profiled = PlanWire.model_validate(steps.plan).to_plan()
    assert estimate(job, profiled).step_s == pytest.approx(steps.step_s, rel=0.25)
    planned = run("plan", "-c", str(config), "--fail", "3", "--dry-run", "--json", cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["chosen"]["policy"] in ("reroute", "reparallelize")


@pytest.mark.timeout(60)  # 3 s measured
def test_profile_of_a_script_without_the_runtime_says_so(tmp_path):
    script = write(tmp_path / "plain.py", "print('hello')\n")
    result = run("profile", "--out", str(tmp_path / "t.json"), str(script), cwd=tmp_path)
    assert result.returncode != 0
    assert "wrote no cost table" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(60)  # 1 s measured
def test_profile_bad_input_is_one_line(tmp_path):
    missing = run("profile", "--out", "t.json", "nope.py", cwd=tmp_path)
    assert missing.returncode != 0 and "not found: nope.py" in missing.stderr
    no_out = run("profile", EXAMPLE, cwd=tmp_path)
    assert no_out.returncode != 0 and "--out" in no_out.stderr
    for r in (missing, no_out):
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
