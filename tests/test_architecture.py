"""Dependencies point one way (STYLE.md habit 1): chameleon_cli -> launcher, planner;
launcher -> planner; chameleon_runtime -> planner's plan types; planner -> nothing of ours
and no torch.distributed; nothing imports chameleon_cli."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("chameleon_cli", "launcher", "planner", "chameleon_runtime")
ALLOWED = {
    "chameleon_cli": {"chameleon_cli", "launcher", "planner"},
    "launcher": {"launcher", "planner"},
    "planner": {"planner"},
    "chameleon_runtime": {"chameleon_runtime", "planner"},
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_dependencies_point_one_way():
    offences = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for name in _imports(path):
                top = name.split(".")[0]
                if top in PACKAGES and top not in ALLOWED[package]:
                    offences.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offences, offences


def test_planner_is_pure():
    for path in (ROOT / "planner").rglob("*.py"):
        for name in _imports(path):
            assert not name.startswith("torch"), f"{path.name} imports {name}"
            assert name not in {"subprocess", "socket", "psutil"}, f"{path.name} imports {name}"
