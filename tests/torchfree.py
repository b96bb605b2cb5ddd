"""Which test modules torch cannot reach, so that the compatibility run (scripts/compat.sh,
another torch) leaves them out: ``pytest -m "not torch_free"``.

A module is torch-free when everything it imports, and everything the test helpers it
imports (``tests.*``) import, is the standard library, pytest, or the planner and the
packages the planner uses, and when it starts no process (a started ``chameleon`` or
script would import torch). The planner imports no torch (tests/test_architecture.py), so
such a module's tests pass or fail alike on every torch: CI runs them once, on the torch
of the main run. The rule reads imports, not behaviour; a module it cannot read is taken
as torch-facing, so that a mistake runs a test twice rather than not at all.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Beside the standard library: pytest, the planner and what the planner imports
# (pyproject.toml), none of which imports torch.
TORCH_FREE_PACKAGES = frozenset({"planner", "pytest", "networkx", "pydantic", "numpy"})
# Standard-library modules that start processes, which may be ours (and import torch), or
# import by name at run time: what a reading of the imports cannot follow.
UNFOLLOWED_MODULES = frozenset(
    {"subprocess", "multiprocessing", "concurrent", "asyncio", "pty", "runpy", "importlib"}
)
# Calls that do either, found in the source as written.
UNFOLLOWED_CALLS = re.compile(
    r"\b(importorskip|__import__|os\.(system|popen|exec\w*|spawn\w*))\s*\("
)


def _imports(path: Path) -> set[str] | None:
    """The absolute names ``path`` imports; None where the reading cannot follow them (a
    relative import, or a call that starts a process or imports by name)."""
    text = path.read_text()
    if UNFOLLOWED_CALLS.search(text):
        return None
    names: set[str] = set()
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                return None
            if node.module:
                names.add(node.module)
                # ``from tests import references``: the helper module, not the package
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _helper(name: str) -> Path | None:
    """The file of the test helper module ``name`` (``tests.x.y``), if it is one."""
    relative = Path(*name.split("."))
    for candidate in (ROOT / relative.with_suffix(".py"), ROOT / relative / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def torch_free(path: Path) -> bool:
    """Whether the module at ``path`` (a test module or a test helper) cannot reach torch."""
    return _torch_free(path, frozenset())


def _torch_free(path: Path, reading: frozenset[Path]) -> bool:
    # ``reading``: the modules whose imports lead here; one of them imported again (helpers
    # that import each other) adds nothing that its own reading does not judge.
    try:
        names = _imports(path)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return False
    if names is None:
        return False
    for name in names:
        root = name.split(".")[0]
        if root in UNFOLLOWED_MODULES:
            return False
        if root == "tests":
            helper = _helper(name)
            if helper is None or helper == path or helper in reading:
                continue
            if not _torch_free(helper, reading | {path}):
                return False
        elif root not in TORCH_FREE_PACKAGES and root not in sys.stdlib_module_names:
            return False
    return True
