"""The warm fork server started first thing, before the launcher imports itself.

``chameleon run`` spends its first 0.7-1 s importing itself (typer, rich, pydantic, the
planner), then imports torch to host the stores; the fork server's own import of torch
and of the script's packages (1.5 s for torch alone, 5 s with transformers, here) only
began after the first of those. ``python -m chameleon_cli`` (the ``chameleon`` command)
reads the flags once, as the launcher will, with the standard library alone, and starts
the server before anything else, so that it imports on another core meanwhile. The agent
takes it where it would start its own (launcher/agent.py), only if it is the server it
would have started: the same environment and the same imports. Otherwise, or when this
first reading cannot tell (a flag it cannot parse: the launcher's own parse then says
what is wrong), the agent closes it and starts its own, as before.

The launcher needs torch itself (its stores are torch's TCPStore), so when the server is
to import torch, the launcher imports it first and the server is a fork of the launcher
made then (no thread yet but the main one): the server inherits torch instead of
importing it a second time, and goes on with the rest of its imports (dynamo, FSDP, the
script's packages) while the launcher imports itself. That was 1.7 s of CPU per launch,
the most of any one part of a test's launch on 2 cores; the server is ready no later for
it (torch came first in its own imports too).

Until the agent takes it, the server's log is a hidden file in the folder the run's own
folder will be made in (the same file system: it is moved, not copied, into the run's
folder).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from launcher.flags import parser
from launcher.preload import modules_for
from launcher.warm import ForkServer, runs_folder, server_env

_started: list[ForkServer] = []


def start(argv: list[str]) -> None:
    """``argv``: what follows ``chameleon run``. Starts the server where the flags ask for
    one; never raises (a launch without it is only slower)."""
    try:
        ns = parser(os.environ).parse_args(argv)
        if not ns.warm_start or ns.no_python or not str(ns.nproc_per_node).isdigit():
            return
        if not ns.module and not os.path.isfile(ns.training_script):
            return  # refused as soon as the launcher looks (chameleon_cli/errors.py)
        env = server_env(os.environ, int(ns.nproc_per_node))
        preload = modules_for(ns.training_script, ns.preload, ns.module)
        folder = runs_folder(ns.log_dir)
        folder.mkdir(parents=True, exist_ok=True)
        fd, log = tempfile.mkstemp(dir=folder, prefix=".forkserver-", suffix=".log")
        os.close(fd)
        if "torch" in preload:
            _import_torch(env)
        _started.append(ForkServer(env, Path(log), preload, fork=True))
    except (Exception, SystemExit):  # noqa: BLE001 - the launcher's parse reports it
        return


def _import_torch(env: dict[str, str]) -> None:
    """The launcher's own import of torch (its stores are torch's TCPStore), done before
    the server is forked so that the server inherits it instead of importing it again:
    1.7 s of CPU per launch here. Under the server's thread count: libgomp reads
    OMP_NUM_THREADS as it loads, and the server's children get what it read."""
    before = os.environ.get("OMP_NUM_THREADS")
    if env.get("OMP_NUM_THREADS") is not None:
        os.environ["OMP_NUM_THREADS"] = env["OMP_NUM_THREADS"]
    try:
        import torch.distributed  # noqa: F401
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before


def take(env: dict[str, str], preload: list[str], log_file: Path) -> ForkServer | None:
    """The server started early, if it is the one the agent would start now (its log
    moved to ``log_file``); None otherwise (and it is closed)."""
    if not _started:
        return None
    server = _started.pop()
    if server.env == env and server.preload == list(preload) and server.alive:
        with contextlib.suppress(OSError):  # its log stays where it is; the server is as good
            server.move_log(log_file)
        return server
    _close(server)
    return None


def discard() -> None:
    """At the launcher's exit: a server nobody took (a usage error, ``--help``)."""
    while _started:
        _close(_started.pop())


def _close(server: ForkServer) -> None:
    server.abandon()
    with contextlib.suppress(OSError):
        server.log_file.unlink()
