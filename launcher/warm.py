"""The launcher's end of the warm fork server (launcher/forkserver.py): start it, spawn
workers through it, learn their exit codes, close it.

A child of the server is not the launcher's child: its exit code comes from the server,
which reaps it and reports it over the socket. ``ForkedProcess`` wraps that in the parts
of ``subprocess.Popen`` the launcher uses, so launcher/workers.py treats both alike.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from launcher.forkserver import MAX_MESSAGE, PRELOAD, eligible, forked_main, send


class ForkedProcess:
    """A child of the fork server, shaped like the parts of ``subprocess.Popen`` the
    launcher uses (pid, poll, wait, send_signal); its exit code comes from the server."""

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid = pid
        self._server = server
        self._code: int | None = None

    @property
    def returncode(self) -> int | None:
        if self._code is None:
            self._code = self._server.exit_code(self.pid)
            if self._code is not None:
                self._server.forget(self.pid)  # kept here: the server's table stays small
        return self._code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._server.wait_exit(self.pid, timeout)
        code = self.returncode
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)


class ForkedServer:
    """The fork server as a fork of the launcher: the parts of ``subprocess.Popen`` that
    ``ForkServer`` uses (pid, wait, kill) for a child that is not a ``Popen``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    @classmethod
    def start(
        cls,
        theirs: socket.socket,
        ours: socket.socket,
        env: dict[str, str],
        log_file: Path,
        preload: list[str],
    ) -> ForkedServer:
        for stream in (sys.stdout, sys.stderr):  # or the child writes our buffer again
            with contextlib.suppress(Exception):
                stream.flush()
        with contextlib.suppress(Exception):  # (C's stdio too: torch's import may print)
            ctypes.CDLL(None).fflush(None)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns (coverage cannot see it)
            try:
                ours.close()
                forked_main(theirs, parent, env, log_file, preload)
            finally:
                os._exit(1)
        return cls(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone all the same
                self.returncode = -signal.SIGKILL
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _kill_session(pid: int) -> None:
    """SIGKILL to a child of the server and to what it started (its own session)."""
    for kill in (os.kill, os.killpg):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def server_env(environ: Mapping[str, str], nproc_per_node: int) -> dict[str, str]:
    """The environment a node's server runs with: the launcher's, with the workers'
    thread count (launcher/environment.py), which libraries read as they load."""
    env = dict(environ)
    if "OMP_NUM_THREADS" not in env and nproc_per_node > 1:
        env["OMP_NUM_THREADS"] = "1"
    return env


def runs_folder(log_dir: str | None) -> Path:
    """Where a run's folder goes: ``--log-dir``, else $TMPDIR/chameleon."""
    return Path(log_dir) if log_dir else Path(os.environ.get("TMPDIR", "/tmp")) / "chameleon"


class ForkServer:
    """The launcher's handle on its fork server: start it, spawn through it, close it."""

    def __init__(
        self,
        env: dict[str, str],
        log_file: Path,
        preload: Sequence[str] = PRELOAD,
        *,
        fork: bool = False,
    ) -> None:
        """``fork``: the server is a fork of this process, which must have no thread but
        its main one (launcher/early.py: what this process imported, torch first, the
        server need not import again); else a fresh ``python -m launcher.forkserver``."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        self.log_file = log_file
        self.env = env
        self.preload = list(preload)
        if fork and threading.active_count() == 1:
            self._proc: subprocess.Popen | ForkedServer = ForkedServer.start(
                theirs, ours, env, log_file, self.preload
            )
        else:
            with open(log_file, "ab") as log:
                self._proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "launcher.forkserver",
                        str(theirs.fileno()),
                        str(os.getpid()),
                        json.dumps(list(preload)),
                    ],
                    env=env,
                    cwd=str(Path(__file__).resolve().parent.parent),  # where `launcher` imports
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    pass_fds=[theirs.fileno()],
                    start_new_session=True,
                )
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()  # one spawn at a time
        self._changed = threading.Condition()
        self._exits: dict[int, int] = {}
        self._spawned: dict[int, int] = {}  # request id -> pid
        # requests given up on (no answer in time): a child the server forks for one
        # later is killed as its answer comes, or it would run beside its fresh stand-in;
        # its exit is not kept (no one asks for it). Each set empties as the answers come.
        self._abandoned: set[int] = set()
        self._killed: set[int] = set()
        self._next_id = 0
        self._ready = False
        self._dead = False
        self._reader = threading.Thread(target=self._read, name="forkserver", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def forked(self) -> bool:
        """A fork of the launcher (it inherited the launcher's torch), not a fresh process."""
        return isinstance(self._proc, ForkedServer)

    @property
    def alive(self) -> bool:
        """Not known to have gone (ready or still importing)."""
        return not self._dead

    @property
    def ready(self) -> bool:
        return self._ready and not self._dead

    def wait_ready(self, timeout: float) -> bool:
        with self._changed:
            self._changed.wait_for(lambda: self._ready or self._dead, timeout)
        return self.ready

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            with self._changed:
                if not data:
                    self._dead = True
                    self._abandoned.clear()
                    self._killed.clear()
                    self._changed.notify_all()
                    return
                message = json.loads(data)
                op = message.get("op")
                if op == "ready":
                    self._ready = True
                elif op == "spawned":
                    pid = message["pid"]
                    # a pid the kernel gave out again: what ended before is not this child
                    self._exits.pop(pid, None)
                    if message["id"] in self._abandoned:
                        self._abandoned.discard(message["id"])
                        self._killed.add(pid)
                        _kill_session(pid)
                    else:
                        self._spawned[message["id"]] = pid
                elif op == "exited" and message["pid"] in self._killed:
                    self._killed.discard(message["pid"])
                elif op == "exited":
                    self._exits[message["pid"]] = message["code"]
                self._changed.notify_all()

    def spawn(
        self, argv: list[str], env: dict[str, str], cwd: str | None = None, timeout: float = 10.0
    ) -> tuple[ForkedProcess, int, int] | None:
        """A child running ``argv``: (process, its stdout's read end, its stderr's read
        end), or None when the server cannot (not ready, gone): start it fresh instead."""
        if not self.ready or not eligible(argv):
            return None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        proc = self.spawn_into(argv, env, (out_w, err_w), cwd, timeout)
        os.close(out_w)
        os.close(err_w)
        if proc is None:
            os.close(out_r)
            os.close(err_r)
            return None
        return proc, out_r, err_r

    def spawn_into(
        self,
        argv: list[str],
        env: dict[str, str],
        outputs: tuple[int, int],
        cwd: str | None = None,
        timeout: float = 10.0,
    ) -> ForkedProcess | None:
        """A child running ``argv`` with ``outputs`` (descriptors, still the caller's to
        close) as its stdout and stderr, or None when the server cannot."""
        if not self.ready or not eligible(argv):
            return None
        with self._lock:
            self._next_id += 1
            # a fresh process would inherit the launcher's folder; the server's is not it
            where = cwd or os.getcwd()
            request = {"op": "spawn", "id": self._next_id, "argv": argv, "env": env, "cwd": where}
            try:
                send(self._sock, request, list(outputs))
            except OSError:
                return None
            with self._changed:
                self._changed.wait_for(
                    lambda: self._next_id in self._spawned or self._dead, timeout
                )
                pid = self._spawned.pop(self._next_id, None)
                if pid is None and not self._dead:
                    self._abandoned.add(self._next_id)
        return None if pid is None else ForkedProcess(pid, self)

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            if pid in self._exits:
                return self._exits[pid]
            if self._dead:
                return -signal.SIGKILL  # the server went, and its children with it
            return None

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or self._dead, timeout)
        return self.exit_code(pid)

    def forget(self, pid: int) -> None:
        """The launcher is done with ``pid``: drop its exit code (bounded state)."""
        with self._changed:
            self._exits.pop(pid, None)

    def move_log(self, log_file: Path) -> None:
        """Its log is now ``log_file`` (on the same file system: the server keeps writing
        to the file it opened)."""
        log_file.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.log_file, log_file)
        self.log_file = log_file

    def abandon(self) -> None:
        """Never used (launcher/early.py): killed where it is, mid-import perhaps, which
        ``close`` would wait for. It has started no child."""
        self._proc.kill()
        self._proc.wait(timeout=5)
        self.close()

    def close(self) -> None:
        """The launcher is done: the server exits when its socket closes."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        try:
            self._proc.wait(timeout=5)
        except Exception:  # noqa: BLE001 - a server that does not leave is killed
            self._proc.kill()
            self._proc.wait(timeout=5)
        self._reader.join(timeout=2)
