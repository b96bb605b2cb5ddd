"""Dependencies point one way (STYLE.md habit 1), at three scales.

- Packages: chameleon_cli -> launcher, planner; launcher -> planner and the protocol
  (chameleon_runtime.protocol, torch-free: the one part of the runtime the launcher
  imports); chameleon_runtime -> planner and the protocol; planner -> nothing of ours, no torch, no
  processes or sockets; nothing imports chameleon_cli.
- The planner's stages: job -> plans -> estimator -> search -> choice -> simulation, each
  importing only those before it (``planner.config``, outside them, may import any).
- Modules: no import cycle among our modules, counting imports inside functions and
  under ``TYPE_CHECKING`` (a cycle is two modules that cannot be read apart).
"""

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("chameleon_cli", "launcher", "planner", "chameleon_runtime")
PROTOCOL = "chameleon_runtime.protocol"
# What each unit may import of ours (a unit: a package, or the protocol within the runtime).
ALLOWED = {
    "chameleon_cli": {"chameleon_cli", "launcher", "planner", PROTOCOL},
    "launcher": {"launcher", "planner", PROTOCOL},
    "planner": {"planner"},
    "chameleon_runtime": {"chameleon_runtime", "planner", PROTOCOL},
    PROTOCOL: {PROTOCOL, "planner"},
}
STAGES = ("job", "plans", "estimator", "search", "choice", "simulation")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path] = MODULES) -> set[str]:
    """Every module ``path`` imports, anywhere in it (functions, TYPE_CHECKING blocks):
    ``from a import b`` is ``a.b`` where that is one of ``modules``, else ``a``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{alias.name}" for alias in node.names]
            ours = [s for s in subs if s in modules]
            names.update(ours)
            if len(ours) < len(subs):
                names.add(node.module)
    return names


def _unit(module: str) -> str:
    if module == PROTOCOL or module.startswith(PROTOCOL + "."):
        return PROTOCOL
    return module.split(".")[0]


def test_dependencies_point_one_way():
    offences = []
    for module, path in MODULES.items():
        for name in _imports(path):
            if name.split(".")[0] in PACKAGES and _unit(name) not in ALLOWED[_unit(module)]:
                offences.append(f"{module} imports {name}")
    assert not offences, offences


def test_the_planners_stages_import_only_the_stages_before_them():
    offences = []
    for module, path in MODULES.items():
        parts = module.split(".")
        if parts[0] != "planner" or len(parts) < 3:
            continue  # planner.config and the package itself may import any stage
        mine = STAGES.index(parts[1])
        for name in _imports(path):
            other = name.split(".")
            if other[0] != "planner":
                continue
            if len(other) < 2 or other[1] not in STAGES:
                offences.append(f"{module} imports {name} (outside the stages)")
            elif STAGES.index(other[1]) > mine:
                offences.append(f"{module} imports {name} (a later stage)")
    assert not offences, offences
    assert {
        p.name for p in (ROOT / "planner").iterdir() if p.is_dir() and p.name != "__pycache__"
    } == set(STAGES)


def _cycles(modules: dict[str, Path]) -> set[frozenset[str]]:
    graph = nx.DiGraph()
    for module, path in modules.items():
        graph.add_node(module)
        for name in _imports(path, modules):
            if name in modules and name != module:
                graph.add_edge(module, name)
    return {frozenset(c) for c in nx.strongly_connected_components(graph) if len(c) > 1}


def test_no_import_cycles_between_our_modules():
    cycles = _cycles(MODULES)
    assert not cycles, [sorted(c) for c in cycles]


def test_the_planner_and_the_protocol_are_pure():
    for module, path in MODULES.items():
        if _unit(module) not in ("planner", PROTOCOL):
            continue
        for name in _imports(path):
            assert not name.startswith("torch"), f"{module} imports {name}"
            if module.startswith("planner"):
                assert name not in {"subprocess", "socket", "psutil"}, f"{module} imports {name}"


def test_the_cycle_check_sees_cycles_hidden_in_functions_and_type_checking(tmp_path):
    files = {
        "pkg.a": "def f():\n    from pkg.b import g\n",
        "pkg.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n",
        "pkg.c": "from pkg.a import f\n",  # into the cycle, not part of it
    }
    modules = {}
    for name, text in files.items():
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        modules[name] = path
    assert _cycles(modules) == {frozenset({"pkg.a", "pkg.b"})}


def _classes() -> dict[tuple[str, str], tuple[Path, ast.ClassDef, list[tuple[str, str]]]]:
    """Our classes by (module, name), each with its bases that are ours (a base named in
    its module or imported from one of ours: ``typing.Protocol`` is not our Protocol)."""
    defined = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                defined[(module, node.name)] = (path, node, tree)
    found = {}
    for (module, name), (path, cls, tree) in defined.items():
        source = {n: module for (m, n) in defined if m == module}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in MODULES:
                source.update({a.asname or a.name: node.module for a in node.names})
        bases = [
            (source[b.id], b.id)
            for b in cls.bases
            if isinstance(b, ast.Name) and (source.get(b.id), b.id) in defined
        ]
        found[(module, name)] = (path, cls, bases)
    return found


def _reads_unowned(cls: ast.ClassDef) -> set[str]:
    """Attributes ``cls``'s methods read from ``self`` that nothing in ``cls`` defines: a
    method, a class attribute, or an assignment ``self.x = ...`` in one of its methods."""
    owned = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            owned.add(node.name)
        elif isinstance(node, ast.Assign):
            owned.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            owned.add(node.target.id)  # type: ignore[union-attr]
    read = set()
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            (owned if isinstance(node.ctx, ast.Store) else read).add(node.attr)
    return read - owned


def test_no_mixins():
    """A class of ours that another of ours inherits from owns the state its methods use:
    a mixin (methods over attributes some other class sets: one class in several rooms)
    hides which object owns which state. Model bases (pydantic, Protocol, exceptions)
    carry no such state: their fields are declared, and they are left out."""
    classes = _classes()
    mixins = []
    for (_, name), (path, _cls, ours) in sorted(classes.items()):
        if name.endswith("Mixin") or len(ours) > 1:
            mixins.append(f"{path.relative_to(ROOT)}: {name}")
        for base in ours:
            base_path, base_cls, _ = classes[base]
            outside = {ast.unparse(b).split(".")[-1] for b in base_cls.bases}
            if outside & {"BaseModel", "Protocol", "Exception", "NamedTuple"}:
                continue
            unowned = _reads_unowned(base_cls)
            if unowned:
                mixins.append(f"{base_path.relative_to(ROOT)}: {base[1]} uses {sorted(unowned)}")
    assert not mixins, mixins
