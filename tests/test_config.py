"""Config files: the shipped ones load and fit; bad ones fail with one line per field."""

import json
from pathlib import Path

import pytest

from planner.config import load_job
from planner.estimator.estimate import estimate
from planner.job.errors import ConfigError
from planner.plans.layout import LayoutError, initial_plan

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SHIPPED = sorted(CONFIGS.glob("*.toml"))


def test_the_four_required_configs_ship():
    names = {p.stem for p in SHIPPED}
    assert {
        "cpu_testbed",
        "ascend910b_32_gpt13b",
        "h100_1024_llama70b",
        "h100_16384_llama405b",
    } <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_configs_load_and_fit_before_any_failure(path):
    job = load_job(path)
    est = estimate(job, initial_plan(job))
    assert est.feasible
    assert est.step_s > 0


def test_paper_scale_model_is_about_13b_parameters():
    job = load_job(CONFIGS / "ascend910b_32_gpt13b.toml")
    total = sum(layer.num_params for layer in job.model.layers)
    assert 12e9 < total < 14e9
    big = load_job(CONFIGS / "h100_16384_llama405b.toml")
    assert 390e9 < sum(layer.num_params for layer in big.model.layers) < 420e9
    assert big.cluster.num_devices == 16384


def _write(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


BASE = (CONFIGS / "cpu_testbed.toml").read_text()


def test_each_bad_field_gets_its_own_line(tmp_path):
    bad = BASE.replace("num_nodes = 2", "num_nodes = -1").replace(
        "micro_batch_size = 2", 'micro_batch_size = "two"'
    )
    with pytest.raises(ConfigError) as info:
        load_job(_write(tmp_path, bad))
    lines = str(info.value).splitlines()
    assert any("cluster.num_nodes" in line and "greater than 0" in line for line in lines)
    assert any("training.micro_batch_size" in line for line in lines)
    assert len(lines) == 2


def test_unknown_fields_are_errors_not_ignored(tmp_path):
    with pytest.raises(ConfigError, match="cluster.num_gpus: unknown field"):
        load_job(_write(tmp_path, BASE.replace("[cluster]\n", "[cluster]\nnum_gpus = 8\n")))


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_job(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_job(_write(tmp_path, "[cluster\nname = 1"))


def test_layout_must_cover_the_cluster(tmp_path):
    job = load_job(_write(tmp_path, BASE.replace("dp = 2", "dp = 3")))
    with pytest.raises(
        LayoutError, match=r"dp\*pp\*tp = 3\*4\*1 = 12 does not match the cluster's 8 devices"
    ):
        initial_plan(job)


def test_model_that_never_fits_is_refused(tmp_path):
    job = load_job(
        _write(tmp_path, BASE.replace("device_memory_gib = 2", "device_memory_gib = 0.0001"))
    )
    with pytest.raises(LayoutError, match="the model does not fit"):
        initial_plan(job)


def test_cost_table_replaces_analytic_costs(tmp_path):
    table = {
        "device": "cpu",
        "micro_batch_size": 2,
        "layers": [
            {
                "name": f"l{i}",
                "num_params": 1000,
                "forward_s": 0.01,
                "backward_s": 0.02,
                "optimizer_s": 0.001,
                "activation_bytes": 4096,
                "stash_bytes": 8192,
            }
            for i in range(6)
        ],
        "intra_node": {"bandwidth_gb_per_s": 0.5, "latency_us": 80},
    }
    (tmp_path / "table.json").write_text(json.dumps(table))
    text = (
        BASE[: BASE.index("[model.gpt]")]
        + 'cost_table = "table.json"\n\n'
        + BASE[BASE.index("[training]") :]
    )
    job = load_job(_write(tmp_path, text))
    assert [layer.forward_s for layer in job.model.layers] == [0.01] * 6
    assert job.cluster.intra_node.bandwidth_bytes_per_s == 0.5e9
    mismatched = text.replace("micro_batch_size = 2", "micro_batch_size = 4").replace(
        "global_batch_size = 32", "global_batch_size = 64"
    )
    with pytest.raises(ConfigError, match="measured at micro_batch_size=2"):
        load_job(_write(tmp_path, mismatched))
