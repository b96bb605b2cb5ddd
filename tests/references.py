"""Failure-free reference runs, each trained once per test run and shared by every test
that compares against it (keyed by script, workers, steps and arguments): a reference is
a real job of seconds, and a dozen tests compare with the same one.

tests/conftest.py gives the cache its folder (a session's temporary folder); a
reference's own run is checked as any job is (exit 0, nothing left running).
"""

from __future__ import annotations

from pathlib import Path

_root: list[Path] = []
_made: dict[tuple, dict] = {}


def set_root(folder: Path) -> None:
    _root[:] = [folder]


def mlp(*, workers: int, steps: int, args: tuple[str, ...] = ("--stages", "1")) -> dict:
    """tests/runtime/mlp.py's per-layer checksums (one per holder) after ``steps`` steps on
    ``workers`` workers, without a failure."""
    key = ("mlp", workers, steps, tuple(args))
    if key not in _made:
        from tests.runtime.test_liveness import run_mlp

        name = f"mlp-{workers}w-{steps}s-{len(_made)}"
        result, _evs, checks = run_mlp(_root[0], name, workers=workers, steps=steps, args=args)
        assert result.returncode == 0, result.stderr[-3000:]
        assert checks, "the reference run wrote no checksums"
        _made[key] = checks
    return _made[key]
