"""Process helpers the launcher benchmarks share (run as scripts: this folder is on
sys.path)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from pathlib import Path

import psutil


def importable(name: str) -> bool:
    """Whether a module is installed (an optional side of a benchmark)."""
    import importlib.util

    return importlib.util.find_spec(name) is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_everything(proc: subprocess.Popen, work: Path) -> None:
    """The launcher's process group and every process running in ``work``: torchrun's
    workers outlive it (they would also hold the benchmark's stdout pipe open forever)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for p in psutil.process_iter():
        try:
            if p.cwd() == str(work) or str(work) in " ".join(p.cmdline()):
                p.kill()
        except psutil.Error:
            continue
