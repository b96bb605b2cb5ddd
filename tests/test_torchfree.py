"""The mark the compatibility run selects by (tests/torchfree.py): a test module is
torch-free only if nothing it imports, directly or through the test helpers, can reach
torch, and it starts no process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.torchfree import torch_free

ROOT = Path(__file__).resolve().parent.parent


def module(folder: Path, name: str, text: str) -> Path:
    path = folder / f"{name}.py"
    path.write_text(text)
    return path


def test_the_planners_tests_are_torch_free_and_the_runtimes_are_not():
    assert torch_free(ROOT / "tests" / "test_simulate.py")  # the planner and pytest alone
    assert not torch_free(ROOT / "tests" / "test_device.py")  # imports torch
    # through a helper: tests.launcher.helpers starts `chameleon`
    assert not torch_free(ROOT / "tests" / "runtime" / "test_recovery.py")


@pytest.mark.parametrize(
    ("text", "free"),
    [
        ("import json\nfrom planner.config import load_job\nimport pytest\n", True),
        ("import torch\n", False),
        ("from chameleon_runtime import shard\n", False),
        ("import subprocess\n", False),  # a started process may be ours
        ("from concurrent.futures import ProcessPoolExecutor\n", False),
        ("import not_a_known_package\n", False),
        ("def broken(:\n", False),  # unreadable: taken as torch-facing
        ("from .helpers import x\n", False),  # relative: not followed
        ("import importlib\n", False),  # imports by name at run time
        # (the calls split: this module's own text must not read as making them)
        ("import pytest\ntorch = pytest.import" + "orskip('torch')\n", False),
        ("import os\nos.sys" + "tem('chameleon run x.py')\n", False),
    ],
)
def test_what_a_module_imports_decides(tmp_path, text, free):
    assert torch_free(module(tmp_path, "test_x", text)) is free


def test_a_helper_that_reaches_torch_makes_its_importer_torch_facing():
    # tests.synthetic is the planner's; tests.references builds references with torch
    assert torch_free(ROOT / "tests" / "synthetic.py")
    assert not torch_free(ROOT / "tests" / "references.py")
    assert not torch_free(ROOT / "tests" / "test_conftest.py")  # via tests.launcher.helpers


def test_the_mark_is_on_the_torch_free_tests_of_a_run(request):
    # this module imports tests.torchfree, whose imports are the standard library's
    assert request.node.get_closest_marker("torch_free") is not None
