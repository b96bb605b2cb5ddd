"""``chameleon plan --dry-run`` as a user runs it: a real process, real exit codes."""

import json

import pytest

from tests.cli import ROOT, chameleon

TESTBED = str(ROOT / "configs" / "cpu_testbed.toml")
ASCEND = str(ROOT / "configs" / "ascend910b_32_gpt13b.toml")


def test_json_has_the_documented_fields():
    result = chameleon("plan", "--dry-run", "--config", TESTBED, "--fail", "3", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["failed"] == [3]
    assert {"policy", "step_time_s", "transition_s", "score", "layout"} <= out["chosen"].keys()
    assert [c["policy"] for c in out["candidates"]] == ["reroute", "reparallelize", "restart"]
    for c in out["candidates"]:
        assert {
            "policy",
            "feasible",
            "reason",
            "step_time_s",
            "peak_memory_bytes",
            "transition_s",
            "score",
        } <= c.keys()
    assert {"bytes", "rounds", "est_time_s", "naive_est_time_s"} <= out["migration"].keys()
    assert out["search_ms"] > 0
    chosen = next(c for c in out["candidates"] if c["policy"] == out["chosen"]["policy"])
    assert chosen["score"] == max(c["score"] for c in out["candidates"] if c["feasible"])


def test_forced_policy_and_node_failure():
    result = chameleon(
        "plan", "--dry-run", "-c", ASCEND, "--fail-node", "0", "--policy", "reroute", "--json"
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["failed"] == list(range(8))
    assert out["chosen"]["policy"] == "reroute"
    assert out["chosen"]["layout"]["num_workers"] == 12


def test_losing_a_whole_stage_falls_back_to_restart_and_says_why():
    # The test bed is 2 pipelines of 4 (workers 0-3 and 4-7): 0 and 4 are both stage 0.
    result = chameleon("plan", "--dry-run", "-c", TESTBED, "--fail", "0,4", "--json")
    out = json.loads(result.stdout)
    assert out["chosen"]["policy"] == "restart"
    reroute = out["candidates"][0]
    assert not reroute["feasible"] and "lost every replica" in reroute["reason"]


def test_forced_infeasible_policy_exits_1_with_the_reason():
    result = chameleon(
        "plan", "--dry-run", "-c", TESTBED, "--fail", "0,4", "--policy", "reroute", "--plain"
    )
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("chameleon: error: --policy reroute is infeasible")
    )


def test_plain_output_shows_candidates_and_migration():
    result = chameleon("plan", "--dry-run", "-c", ASCEND, "--fail-node", "0", "--plain")
    assert result.returncode == 0, result.stderr
    for needle in (
        "Candidates",
        "reroute",
        "reparallelize",
        "restart",
        "Layout",
        "Migration schedule",
        "naive",
    ):
        assert needle in result.stdout


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["plan", "--dry-run", "-c", "/nonexistent.toml"], 1, "config file not found"),
        (["plan", "-c", TESTBED], 2, "add --dry-run"),
        (["plan", "--dry-run", "-c", TESTBED, "--fail", "99"], 1, "rank 99 is not in the cluster"),
        (["plan", "--dry-run", "-c", TESTBED, "--fail", "x"], 2, "not a rank list"),
        (["plan", "--dry-run", "-c", TESTBED, "--mtbf", "soon"], 2, "not a duration"),
        (["plan", "--bogus"], 2, "No such option: --bogus"),
        (["plan", "--dry-run", "-c", TESTBED, "--slow", "3"], 2, "expected RANK=FACTOR"),
        (["plan", "--dry-run", "-c", TESTBED, "--slow", "3=0.5"], 2, "expected RANK=FACTOR"),
        (["plan", "--dry-run", "-c", TESTBED, "--slow", "99=2"], 1, "rank 99 is not in the job"),
        (["plan", "--dry-run", "-c", TESTBED, "--slow", "3=2", "--fail", "1"], 2, "not both"),
        (["plan", "--dry-run", "-c", TESTBED, "--slow-for", "5m"], 2, "needs --slow"),
        (["frobnicate"], 2, "No such command"),
    ],
)
def test_bad_input_is_one_line_without_traceback(args, code, message):
    result = chameleon(*args)
    assert result.returncode == code
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
    assert "Traceback" not in result.stderr


def test_malformed_config_lists_each_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[cluster]\nname = 'x'\nnum_nodes = 0\n")
    result = chameleon("plan", "--dry-run", "-c", str(bad))
    assert result.returncode == 1
    assert "cluster.num_nodes" in result.stderr and "Traceback" not in result.stderr


def test_debug_shows_the_traceback():
    result = chameleon("--debug", "plan", "--dry-run", "-c", "/nonexistent.toml")
    assert result.returncode == 1
    assert "Traceback" in result.stderr


def test_version_and_help():
    assert chameleon("--version").stdout.startswith("chameleon ")
    help_text = chameleon("--help").stdout
    for command in ("run", "plan", "profile"):
        assert command in help_text


@pytest.mark.slow  # a 1,024-GPU HSDP search: seconds
@pytest.mark.timeout(60)  # 3 s measured
def test_an_hsdp_job_of_1024_gpus_is_described_with_each_candidates_estimates():
    """configs/h100_1024_llama70b_hsdp.toml: 16 replica groups of 64 H100s, Llama 70B
    sharded within each (planner.job.fsdp). A lost GPU breaks its group: rerouting drops
    it (the 16 turns of 64 micro-batches on 15 groups: one runs two, half the
    throughput), and the memory is a shard's."""
    hsdp = str(ROOT / "configs" / "h100_1024_llama70b_hsdp.toml")
    result = chameleon("plan", "--dry-run", "--config", hsdp, "--fail", "5", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    by = {c["policy"]: c for c in out["candidates"]}
    reroute = by["reroute"]
    assert reroute["feasible"]
    assert reroute["label"] == "drop 1 replica group(s) of [0-63]"
    assert reroute["step_time_s"] == pytest.approx(2 * by["restart"]["step_time_s"], rel=0.01)
    gib = 2**30
    # a 64th of 70B parameters' state (18 bytes each) and one layer whole beside it
    assert 20 * gib < reroute["peak_memory_bytes"] < 60 * gib
    assert reroute["transition_s"] > 0
    # re-sharding group 0-63 over its 63 survivors: 1,024 micro-batches are no whole
    # turns of groups of 63 and 64 (each group one turn at least)
    assert (
        "no whole turns of replica groups of [63, 64 x 15] members"
        in (by["reparallelize"]["reason"])
    )
    assert by["restart"]["feasible"]


def test_a_slow_rank_is_planned_around_when_it_lasts_and_waited_for_when_it_does_not():
    """--slow: stay, an uneven deal or leaving it out, by the samples each trains over
    the time the slowdown lasts (planner.choice.stragglers)."""
    long = chameleon("plan", "--dry-run", "-c", TESTBED, "--slow", "3=3", "--json")
    assert long.returncode == 0, long.stderr
    out = json.loads(long.stdout)
    assert out["slow"] == {"3": 3.0} and out["horizon_s"] == 600.0
    stay, uneven, leave, resplit = out["options"]
    assert [o["option"] for o in out["options"]] == [
        "stay", "uneven deal", "leave out", "re-partition",
    ]  # fmt: skip
    assert resplit["step_time_s"] < stay["step_time_s"] and resplit["transition_s"] > 0
    assert stay["step_time_s"] > out["even_step_time_s"]
    assert uneven["step_time_s"] < stay["step_time_s"] and uneven["transition_s"] > 0
    assert out["chosen"] in ("uneven deal", "leave out", "re-partition")
    chosen = next(o for o in out["options"] if o["option"] == out["chosen"])
    assert chosen["samples"] == max(o["samples"] for o in out["options"])
    brief = chameleon(
        "plan", "--dry-run", "-c", TESTBED, "--slow", "3=3", "--slow-for", "100ms", "--plain"
    )
    assert brief.returncode == 0, brief.stderr
    assert "chosen            stay" in brief.stdout
    assert "uneven deal" in brief.stdout and "leave out" in brief.stdout
