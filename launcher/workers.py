"""Worker processes: start, log, poll and stop them (torch.distributed.elastic's
"multiprocessing" part).

Nothing outlives the launcher. Each worker starts in a session of its own (so a signal
reaches it and anything it forks) with the kernel's parent-death signal set to SIGKILL
(prctl PR_SET_PDEATHSIG): if the launcher is killed, even by SIGKILL, the kernel kills the
workers, and ``launcher.reaper`` kills what they started. torchrun leaves them running
under PID 1. Stopping is SIGTERM (or the signal being forwarded) to the whole session, a
bounded grace period, then SIGKILL.

Output: each worker's stdout and stderr are read line by line. Per torchrun's
-r/--redirects and -t/--tee (0 none, 1 stdout, 2 stderr, 3 both) a stream goes to its file
under the attempt's log folder, to the console, or both; console lines carry a
``[rank N]`` prefix, and --local-ranks-filter limits which ranks reach the console.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from launcher.forkserver import STACKS_SIGNAL, die_with_parent
from launcher.warm import ForkedProcess, ForkServer


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    return lambda: die_with_parent(parent_pid)


# A worker's files in its log folder: named here once, for its environment and our reads.
ERROR_FILE = "error.json"  # TORCHELASTIC_ERROR_FILE (launcher/rootcause.py)
BEAT_FILE = "heartbeat"  # CHAMELEON_BEAT_FILE (chameleon_runtime/scriptbeat.py)


class Reaper:
    """The launcher's end of ``launcher.reaper``: sessions to kill if the launcher dies."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.reaper"],
            stdin=subprocess.PIPE,
            start_new_session=True,
            cwd=str(Path(__file__).resolve().parent.parent),
            text=True,
        )

    def _send(self, line: str) -> None:
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def hold(self, pgid: int) -> None:
        self._send(f"+{pgid}")

    def release(self, pgid: int) -> None:
        self._send(f"-{pgid}")

    def close(self) -> None:
        """Normal exit: everything was stopped already; let the guard finish."""
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(timeout=10)


class Console:
    """Where worker lines meet the launcher's own output: one lock, swappable sink (the
    live view replaces it while it runs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.write: Callable[[str, bool], None] = self._plain
        # chameleon run --json: stdout carries the outcome object alone
        self.stdout_to_stderr = False
        # Set while the job is being interrupted: workers' stderr (each one's
        # KeyboardInterrupt traceback) stays in their logs; the agent says one line per rank.
        self.quiet_errors = False

    @staticmethod
    def _plain(line: str, is_err: bool) -> None:
        stream = sys.stderr if is_err else sys.stdout
        stream.write(line + "\n")
        stream.flush()

    def emit(self, line: str, *, is_err: bool) -> None:
        if is_err and self.quiet_errors:
            return
        with self._lock:
            self.write(line, is_err or self.stdout_to_stderr)

    def say(self, line: str) -> None:
        """The launcher's own line, on stderr, even while workers' stderr is quiet."""
        with self._lock:
            self.write(line, True)


@dataclass
class StreamPlan:
    to_file: Path | None
    to_console: bool


@dataclass
class Worker:
    rank: int
    local_rank: int
    popen: subprocess.Popen | ForkedProcess
    # time.monotonic() at spawn: the startup timeout is a duration, and a wall clock that
    # steps (an NTP correction) would make a worker starting normally look hung
    started_at: float
    log_dir: Path
    stdout: StreamPlan
    stderr: StreamPlan
    stderr_tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))
    pumps: list[threading.Thread] = field(default_factory=list)
    warm: bool = False  # forked from the warm server, not a fresh interpreter

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    @property
    def error_file(self) -> Path:
        return self.log_dir / ERROR_FILE

    @property
    def beat_file(self) -> Path:
        return self.log_dir / BEAT_FILE

    def log_files(self) -> list[Path]:
        return [p for p in (self.stdout.to_file, self.stderr.to_file) if p is not None]


def stream_plans(log_dir: Path, redirect: int, tee: int) -> tuple[StreamPlan, StreamPlan]:
    """torchrun's bits: 1 = stdout, 2 = stderr. Redirect: file only; tee: file and console."""

    def plan(bit: int, name: str) -> StreamPlan:
        to_file = log_dir / f"{name}.log" if (redirect | tee) & bit else None
        return StreamPlan(to_file=to_file, to_console=not (redirect & bit) or bool(tee & bit))

    return plan(1, "stdout"), plan(2, "stderr")


def start_worker(
    cmd: Sequence[str],
    env: dict[str, str],
    *,
    rank: int,
    local_rank: int,
    log_dir: Path,
    redirect: int,
    tee: int,
    console: Console,
    show_on_console: bool,
    reaper: Reaper | None = None,
    cwd: str | None = None,
    forkserver: ForkServer | None = None,
) -> Worker:
    """Start one worker: a child of the warm fork server when one is given and ready
    (launcher/forkserver.py), else a fresh process."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out_plan, err_plan = stream_plans(log_dir, redirect, tee)
    if not show_on_console:
        out_plan.to_console = err_plan.to_console = False
    forked = forkserver.spawn(list(cmd), env, cwd) if forkserver is not None else None
    popen: subprocess.Popen | ForkedProcess
    if forked is not None:
        popen, out_fd, err_fd = forked
        pipes: tuple[IO[bytes], IO[bytes]] = (os.fdopen(out_fd, "rb"), os.fdopen(err_fd, "rb"))
    else:
        popen = subprocess.Popen(
            list(cmd),
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_die_with_parent(os.getpid()),
        )
        pipes = (popen.stdout, popen.stderr)  # type: ignore[assignment]
    if reaper is not None:
        reaper.hold(popen.pid)  # the worker leads its own session: pgid == pid
    worker = Worker(rank, local_rank, popen, time.monotonic(), log_dir, out_plan, err_plan)
    worker.warm = forked is not None
    for pipe, plan, is_err in ((pipes[0], out_plan, False), (pipes[1], err_plan, True)):
        thread = threading.Thread(
            target=_pump,
            args=(pipe, plan, is_err, worker, console),
            name=f"log-{rank}-{int(is_err)}",
            daemon=True,
        )
        thread.start()
        worker.pumps.append(thread)
    return worker


def _pump(
    pipe: IO[bytes], plan: StreamPlan, is_err: bool, worker: Worker, console: Console
) -> None:
    prefix = f"[rank {worker.rank}]: "
    sink = open(plan.to_file, "ab") if plan.to_file else None  # noqa: SIM115 - closed below
    try:
        for raw in iter(pipe.readline, b""):
            if sink is not None:
                sink.write(raw)
                sink.flush()
            line = raw.decode(errors="replace").rstrip("\n")
            if is_err:
                worker.stderr_tail.append(line)
            if plan.to_console:
                console.emit(prefix + line, is_err=is_err)
    finally:
        if sink is not None:
            sink.close()
        pipe.close()


def signal_worker(worker: Worker, signum: int) -> None:
    """Signal the worker's whole session (it and whatever it forked)."""
    try:
        os.killpg(worker.pid, signum)
    except ProcessLookupError:
        pass
    except PermissionError:  # the session leader is gone and its id reused: signal only it
        with contextlib.suppress(ProcessLookupError):
            worker.popen.send_signal(signum)


# How long a worker about to be killed as hung has to write its stacks (one scheduling
# slice on a loaded host; faulthandler's write itself takes microseconds).
STACKS_GRACE_S = 0.3


def ask_for_stacks(worker: Worker) -> None:
    """Have ``worker`` write every thread's Python stack to its stderr (its log and the
    console): the launcher kills it as hung ``STACKS_GRACE_S`` later."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(worker.pid, STACKS_SIGNAL)


def stop_workers(
    workers: Sequence[Worker],
    *,
    signum: int = signal.SIGTERM,
    grace_s: float = 5.0,
    reaper: Reaper | None = None,
) -> None:
    """Signal, wait up to ``grace_s`` for them to exit, then SIGKILL what is left; reap all."""
    live = [w for w in workers if w.poll() is None]
    for w in live:
        signal_worker(w, signum)
        if signum != signal.SIGKILL:
            signal_worker(w, signal.SIGCONT)  # a stopped (hung) worker cannot act on SIGTERM
    deadline = time.monotonic() + grace_s
    while live and time.monotonic() < deadline:
        live = [w for w in live if w.poll() is None]
        if live:
            time.sleep(0.02)
    for w in live:
        signal_worker(w, signal.SIGKILL)
    for w in workers:
        # Kill the session's leftovers too (a worker that exited but left children).
        signal_worker(w, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.popen.wait(timeout=10)
    for w in workers:
        for thread in w.pumps:
            thread.join(timeout=2)
        if reaper is not None:
            reaper.release(w.pid)
