"""What the warm fork server imports for a script, beyond torch (launcher/forkserver.py).

A restarted worker that imports a large library again pays for it on every restart:
`transformers` took a Hugging Face script's warm restart from about 0.3 s (torch only)
to 2.3 s. The server imports, once, the packages the script imports at its top level
(read from its source, never run), so every worker forked from it has them.

Only installed third-party packages are taken: not the standard library (cheap, and
already partly loaded), not the script's own modules (a file or folder beside it, whose
import may do anything), not the launcher's own packages (chameleon_runtime and the
planner are fine: what they read from the environment they read per worker), and only
statements at module level (an import inside a function may be one the script never
reaches). ``--preload`` adds modules by name or turns this off (``none``).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

from launcher.forkserver import OURS, PRELOAD


def script_imports(script: Path) -> list[str]:
    """The modules ``script`` imports at module level (in ``try`` and ``if`` blocks too),
    as dotted names, in order, each once; [] when it cannot be read or parsed."""
    try:
        tree = ast.parse(script.read_bytes(), filename=str(script))
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level == 0 and node.module:
                    # ``from transformers import GPT2LMHeadModel``: the name too, as
                    # ``module:name`` (transformers loads its models lazily, on first use
                    # of the name: in every restarted worker, unless the server has)
                    names.append(node.module)
                    names.extend(f"{node.module}:{a.name}" for a in node.names if a.name != "*")
            elif isinstance(node, ast.Try):
                visit(node.body)
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)

    visit(tree.body)
    return list(dict.fromkeys(names))


def package_of(name: str) -> str:
    """The top-level package of an import as ``script_imports`` gives it (``a.b:name``)."""
    return name.split(":", 1)[0].split(".", 1)[0]


def third_party(names: list[str], script_dir: Path) -> list[str]:
    """Of ``names``, the installed packages that are neither the standard library, ours,
    nor the script's own (found in its folder)."""
    local: set[str] = set()
    if script_dir.is_dir():
        local = {p.stem for p in script_dir.glob("*.py")}
        local |= {p.name for p in script_dir.iterdir() if (p / "__init__.py").exists()}
    kept = []
    for name in names:
        top = package_of(name)
        if top in sys.stdlib_module_names or top in OURS or top in local:
            continue
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            continue
        if spec is None or spec.origin is None and not spec.submodule_search_locations:
            continue
        kept.append(name)
    return kept


def modules_for(script: str, flag: str, module_mode: bool) -> list[str]:
    """What the server imports for this job: torch and what training scripts pull in
    lazily (``PRELOAD``), then ``flag``'s modules. ``flag`` is ``--preload``: ``auto``, the
    default (the script's third-party imports; and no torch at all for a script whose
    top-level imports are all the standard library's: preloading torch would hold its
    first workers back by seconds for nothing), ``none`` (torch only), or comma-separated
    names, which may include ``auto``."""
    wanted = [w.strip() for w in flag.split(",") if w.strip()]
    if "none" in wanted:
        return list(PRELOAD)
    out = [w for w in wanted if w != "auto"]
    base = list(PRELOAD)
    if "auto" in wanted and not module_mode:
        path = Path(script)
        names = script_imports(path)
        out += third_party(names, path.resolve().parent)
        if not out and path.is_file() and _stdlib_only(names):
            base = []
    return list(dict.fromkeys([*base, *out]))


def _stdlib_only(names: list[str]) -> bool:
    """Every one of ``names`` (a script's top-level imports, read from a file that was
    there to read) is the standard library's: the script imports no torch before its
    first line runs, whatever it does later."""
    return all(package_of(n) in sys.stdlib_module_names for n in names)
