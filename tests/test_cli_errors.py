"""Malformed invocations, one per class of input a fuzzing pass found mishandled: each is
one line on stderr naming what is wrong, the documented exit code, no traceback."""

from __future__ import annotations

import pytest

from tests.cli import ROOT, chameleon

TESTBED = str(ROOT / "configs" / "cpu_testbed.toml")
SCRIPT = str(ROOT / "tests" / "stdlib_script.py")  # (flags are the subject: no torch)


def one_line(result, code: int, *needles: str) -> None:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("chameleon")]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([], "a command is needed"),
        (["run"], "no training script given"),
        (["profile"], "--out TABLE.json and a training script"),
        (
            ["plan", "--dry-run", "-c", "configs/cpu_testbed.toml"],
            "name the failure to plan for: --fail RANKS or --fail-node NODE",
        ),
    ],
)
def test_a_command_without_its_arguments_is_a_usage_error(args, needle):
    one_line(chameleon(*args), 2, "usage error", needle)


def test_help_asked_for_is_not_an_error():
    for args in (["run", "--help"], ["profile", "--help"]):
        result = chameleon(*args)
        assert result.returncode == 0 and "usage: chameleon" in result.stdout


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (
            ["--nproc-per-node", "2", "--inject-fault", "kill:rank=99,step=3"],
            ["rank 99 is not in this job", "0..1"],
        ),
        (
            ["--nnodes", "2", "--nproc-per-node", "2", "--inject-fault", "kill:rank=4,at=1"],
            ["rank 4 is not in this job", "0..3"],
        ),
        (
            ["--nproc-per-node", "2", "--inject-fault", "kill:rank=-1,step=3"],
            ["rank must be 0 or more, or any"],
        ),
        (
            ["--inject-fault", "kill:rank=0,step=3,attempt=-2"],
            ["attempt must be 0 or more, or any"],
        ),
        (["--master-port", "99999"], ["--master-port 99999 is not a port"]),
        (["--master-port", "-1"], ["--master-port -1 is not a port"]),
        (
            ["--rdzv-backend", "c10d", "--rdzv-endpoint", "host:http"],
            ["--rdzv-endpoint must be HOST:PORT"],
        ),
    ],
)
def test_flags_out_of_range_are_usage_errors(args, needles):
    one_line(chameleon("run", *args, SCRIPT, "5"), 2, "usage error", *needles)


def test_a_folder_given_as_a_file_is_named_a_folder(tmp_path):
    one_line(chameleon("run", str(tmp_path)), 1, "training script is a directory")
    one_line(chameleon("profile", "--out", str(tmp_path / "t.json"), str(tmp_path)), 1, "directory")
    one_line(chameleon("timeline", str(tmp_path)), 1, "event log is a directory")
    one_line(chameleon("profile", "--out", str(tmp_path), SCRIPT), 1, "--out", "is a folder")


def test_a_binary_event_log_is_named(tmp_path):
    binary = tmp_path / "events.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    one_line(chameleon("timeline", str(binary)), 1, str(binary), "not an event log")


@pytest.mark.parametrize("flag", ["--log-dir", "--events"])
def test_a_folder_that_cannot_be_made_names_its_flag(flag):
    target = "/proc/chameleon-nowhere/" + ("e.jsonl" if flag == "--events" else "logs")
    one_line(chameleon("run", flag, target, SCRIPT, "5"), 1, flag, "cannot create")


def test_profile_out_that_cannot_be_written_blames_out_not_the_script():
    result = chameleon("profile", "--out", "/proc/chameleon-nowhere/t.json", SCRIPT)
    one_line(result, 1, "--out", "cannot create")


@pytest.mark.parametrize("flag", ["--fail", "--fail-node"])
def test_a_negative_rank_or_node_is_a_usage_error_for_both_flags(flag):
    one_line(chameleon("plan", "--dry-run", "-c", TESTBED, flag, "-1"), 2, "usage error", flag)


@pytest.mark.parametrize(("flag", "value"), [("--fail", "99"), ("--fail-node", "9")])
def test_a_rank_or_node_outside_the_cluster_is_a_user_error_for_both(flag, value):
    one_line(chameleon("plan", "--dry-run", "-c", TESTBED, flag, value), 1, "not in the cluster")
