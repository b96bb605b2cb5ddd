"""The suite's ``chameleon`` processes, forked from a server that has imported torch.

Every ``chameleon run`` a test starts is a real process running the real command, with its
own pid, environment, folder and output files, and real signals. But a fresh interpreter
spends about 5 CPU-s importing torch, dynamo and the launcher's libraries before it does
anything (the launcher imports torch for its stores, its fork server dynamo: 2.3 CPU-s
each here), and the suite starts a few hundred of them on 2 cores: most of CI's CPU.

So a test's ``chameleon`` is a child of the launcher's own warm fork server
(launcher/forkserver.py, the one that starts every restarted worker), started once per
pytest process with those imported. The child drops our packages from ``sys.modules`` and
runs ``python -m chameleon_cli`` as a fresh interpreter would; the server's docstring lists
what a fork still shares with its server and what is done about each.

Started fresh instead (``subprocess.Popen``, as before):
- a command that is not ``python -m chameleon_cli`` of this interpreter;
- an environment that differs from the server's in a variable read as a library loads
  (``LOADED``: the interpreter's, the C library's, torch's, OpenMP's): the server read
  its own;
- a test that asks (``fresh=True``: the CLI's own tests, a comparison with torchrun's
  environment), and a whole run with CHAMELEON_TEST_FRESH=1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

FRESH_ENV = "CHAMELEON_TEST_FRESH"
# Variables a process reads as it starts or as a library loads; a command whose
# environment changes one of them from the server's gets a fresh interpreter.
LOADED = (
    "PYTHON", "LD_", "MALLOC_", "GLIBC_", "TORCH", "PYTORCH", "OMP_", "KMP_", "MKL_",
    "OPENBLAS_", "CUDA", "TMPDIR", "LANG", "LC_", "TYPER_", "_TYPER",
)  # fmt: skip
# What ``chameleon run`` imports besides torch: its command line and its output layer.
PRELOAD_LAUNCHER = (
    "typer",
    "rich.console",
    "rich.table",
    "rich.live",
    "pydantic",
    "networkx",
    "psutil",
)

ROOT = Path(__file__).resolve().parent.parent


class Launched:
    """A ``chameleon`` forked by the suite's server: the parts of ``subprocess.Popen`` the
    tests use, its exit code reported by the server (its parent)."""

    def __init__(self, proc, args: list[str]) -> None:  # proc: launcher.warm.ForkedProcess
        self._proc = proc
        self.pid = proc.pid
        self.args = args

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def poll(self) -> int | None:
        return self._proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        try:
            return self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired(self.args, timeout or 0) from None

    def send_signal(self, signum: int) -> None:
        self._proc.send_signal(signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> Launched:
        return self

    def __exit__(self, *exc) -> None:
        self.wait()


_lock = threading.Lock()
_server: list = []  # [launcher.warm.ForkServer] once started; [None] where it cannot be
_base: dict[str, str] = {}  # the environment the server is started with


def remember_env() -> None:
    """The server's environment: the suite's, as it is before any test changes it
    (tests/conftest.py, at configure), not that of whichever test launches first."""
    _base.clear()
    _base.update(server_env())


def _start():
    """The server, started by the first launch that can use it; None where it cannot be.
    Its start (a few seconds: torch and dynamo) is that test's; cut short there (the
    test's timeout), it is closed and the next launch starts another."""
    with _lock:
        if not _server:
            if threading.current_thread() is not threading.main_thread():
                # (its parent-death signal is a thread's: it would die with this one)
                return None
            server = _new_server()
            _server.append(server)
            try:
                ready = server.wait_ready(120)
            except BaseException:  # (the test's timeout): the next launch tries again
                server.close()
                _server.clear()
                raise
            if not ready:
                server.close()
                _server[0] = None
                print(f"tests/prefork.py: no server ({server.log_file}); fresh processes")
        return _server[0]


def _new_server():
    from launcher.forkserver import PRELOAD
    from launcher.warm import ForkServer

    env = dict(_base or server_env())
    folder = Path(env.get("TMPDIR", "/tmp"))
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / f"chameleon-test-prefork-{os.getpid()}.log"
    return ForkServer(env, log, [*PRELOAD, *PRELOAD_LAUNCHER])


def server_env() -> dict[str, str]:
    """The environment tests give ``chameleon`` (tests/launcher/helpers.py's ``env``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def server_pid() -> int | None:
    """The server's pid once started (tests/conftest.py: the run's, not a test's)."""
    return _server[0].pid if _server and _server[0] is not None else None


def close() -> None:
    with _lock:
        if _server and _server[0] is not None:
            _server[0].close()
        _server.clear()


# ... but for these: importing torch._dynamo sets TORCHINDUCTOR_CACHE_DIR in the importing
# process (the pytest process, once an in-process test has stepped an optimizer), to the
# default a process works out for itself; it is read as a compile caches, not at load.
LOADED_NOT = frozenset({"TORCHINDUCTOR_CACHE_DIR"})


def _loads_the_same(env: dict[str, str], base: dict[str, str]) -> bool:
    changed = {k for k in env.keys() | base.keys() if env.get(k) != base.get(k)}
    return not any(k.startswith(LOADED) for k in changed - LOADED_NOT)


def forkable(argv: list[str], env: dict[str, str]) -> bool:
    return (
        os.environ.get(FRESH_ENV) != "1"
        and argv[:3] == [sys.executable, "-m", "chameleon_cli"]
        and _loads_the_same(env, _base or server_env())
    )


def popen(
    argv: list[str],
    *,
    cwd: Path | str,
    env: dict[str, str],
    stdout,
    stderr,
    fresh: bool = False,
):
    """``subprocess.Popen(argv, cwd=, env=, stdout=, stderr=)`` for a ``chameleon``
    command: a child of the server where it can be (``stdout`` and ``stderr``: open files,
    or ``subprocess.STDOUT`` for ``stderr``), else a fresh process."""
    if not fresh and forkable(argv, env):
        server = _start()
        if server is not None:
            out = stdout.fileno()
            err = out if stderr == subprocess.STDOUT else stderr.fileno()
            proc = server.spawn_into(list(argv), env, (out, err), str(cwd))
            if proc is not None:
                return Launched(proc, list(argv))
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=stdout, stderr=stderr)


def run(argv: list[str], *, cwd: Path | str, env: dict[str, str], timeout: float, fresh=False):
    """``subprocess.run(argv, capture_output=True, text=True, ...)`` through ``popen``;
    ``forked`` on the result says which it was."""
    import tempfile

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = popen(argv, cwd=cwd, env=env, stdout=out, stderr=err, fresh=fresh)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
    done = subprocess.CompletedProcess(argv, code, texts[0], texts[1])
    done.forked = isinstance(proc, Launched)  # type: ignore[attr-defined]
    return done
