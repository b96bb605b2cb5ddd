"""Failure-free reference runs, each trained once per test run and shared by every test
that compares against it (keyed by script, workers, steps and arguments): a reference is
a real job of seconds, and a dozen tests compare with the same one.

tests/conftest.py gives the cache its folder (the run's temporary folder, which the
pytest-xdist workers of one run share): the first worker to need a reference trains it
under a lock, the others wait and read its file. A reference's own run is checked as any
job is (exit 0, nothing left running).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tests.locks import locked

_root: list[Path] = []
_made: dict[tuple, dict] = {}


def set_root(folder: Path) -> None:
    _root[:] = [folder]


def mlp(*, workers: int, steps: int, args: tuple[str, ...] = ("--stages", "1")) -> dict:
    """tests/runtime/mlp.py's per-layer checksums (one per holder) after ``steps`` steps on
    ``workers`` workers, without a failure."""
    key = ("mlp", workers, steps, tuple(args))
    if key not in _made:
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:12]
        name = f"mlp-{workers}w-{steps}s-{digest}"
        with locked(_root[0] / f"{name}.lock"):
            saved = _root[0] / f"{name}.json"
            if saved.exists():
                checks = {int(k): v for k, v in json.loads(saved.read_text()).items()}
            else:
                from tests.runtime.test_liveness import run_mlp

                result, _evs, checks = run_mlp(
                    _root[0], name, workers=workers, steps=steps, args=args
                )
                assert result.returncode == 0, result.stderr[-3000:]
                assert checks, "the reference run wrote no checksums"
                partial = saved.with_suffix(".partial")
                partial.write_text(json.dumps(checks))
                os.replace(partial, saved)  # whole or absent, for the next reader
        _made[key] = checks
    return _made[key]
