"""Warm interpreters for restarts: a fork server that has imported torch.

Most of a plain script's restart is fresh interpreters importing torch again (1-2 s each
here, every worker at once on the same cores). Each agent starts one server process
first, which imports torch (and what scripts import lazily, ``PRELOAD``) once and waits;
a script whose top-level imports are all the standard library's gets a server that
imports nothing (launcher/preload.py), so that its workers start at once.
Every worker (the first round's, a restart's, a replacement rank) is a child of it: the server forks, and the child takes the worker's argv,
environment, working folder and output pipes and runs the script as ``python -u SCRIPT``
would (``__main__``, ``sys.argv``, ``sys.path[0]``, exit code, traceback on stderr).

Differences from a fresh interpreter, and what is done about them:
- Threads do not survive a fork. The server starts none (torch's pools start lazily;
  OpenBLAS's obeys the workers' OMP_NUM_THREADS, which the server is started with).
- State read when a library loads (libgomp's OMP_NUM_THREADS) is the server's: it runs
  with the workers' value, and the child sets torch's thread count from its own env.
- Random state: Python's ``random`` reseeds at fork by itself; numpy's global generator,
  when loaded, is reseeded in the child. Children share the server's string hash seed.
- CUDA must not be initialised before a fork: the server never touches a device.
- Output: written through under ``-u`` (every worker's command), else buffered as
  Python buffers it (stdout by the block off a terminal, stderr by the line).
- Our own modules are dropped from ``sys.modules`` in the child, so a script's own
  ``launcher`` package is imported as it would be in a fresh interpreter.
- ``ps`` would show a child with the server's command line (a fork does not exec): the
  child sets its title to the worker's command (setproctitle). Its /proc environ still
  shows the server's environment; ``os.environ`` is the worker's.
Anything the server cannot do (not ready within 120 s, died, a ``--no-python`` command)
falls back to a fresh process (launcher/workers.py); ``--no-warm-start`` turns the server off.

Launcher and server talk over a SOCK_SEQPACKET socket pair (message boundaries kept, file
descriptors passed with SCM_RIGHTS): one JSON object per message, never pickle.
Nothing outlives the launcher: the server dies with it (PR_SET_PDEATHSIG) and each child
with the server, and the launcher's reaper holds every child's session.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import select
import signal
import socket
import sys
from dataclasses import dataclass
from typing import NoReturn

# A worker's Python stacks, every thread's, written to its stderr (faulthandler, from C:
# it works while the main thread is blocked in gloo or a store wait) when the launcher
# is about to kill it as hung, so that its log says where it was stuck. A real-time
# signal: SIGUSR1 and SIGUSR2 belong to scripts (Slurm's --signal, submitit's requeue).
# A worker that did not register it (not forked here) dies of it, as it was to anyway.
STACKS_SIGNAL = signal.SIGRTMIN + 4

_PR_SET_PDEATHSIG = 1
MAX_MESSAGE = 1 << 20
# What the server imports once so that no restarted worker does: torch, and what a
# training script's first steps pull in lazily. Measured on torch 2.13 (CPU): DDP's
# constructor imports ~830 modules through torch._dynamo (sympy included), 1.7 s of a
# 2.4 s warm restart before this list had it.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.nn.parallel.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
)
# The launcher's own packages: a worker forked from the server drops them, so that a
# script's own ``launcher`` imports as in a fresh interpreter; chameleon_runtime and the
# planner stay, and may be preloaded (what they read from the environment, they read
# per worker).
OURS = frozenset({"chameleon_cli", "launcher"})


def die_with_parent(parent_pid: int) -> None:
    """In a child: SIGKILL when the parent goes; exit now if it went before this call."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:  # type: ignore[assignment]
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


# -- the server ---------------------------------------------------------------------------


@dataclass
class ChildSpec:
    argv: list[str]
    env: dict[str, str]
    cwd: str | None


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        send(sock, {"op": "exited", "pid": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(sock: socket.socket, modules: list[str] = PRELOAD) -> ChildSpec | None:  # type: ignore[assignment]
    """The server's loop. Returns in a forked child (what it is to run), or None in the
    server once the launcher has closed its end. ``modules``: what to import first
    (launcher/preload.py decides: PRELOAD and the script's own imports)."""
    import importlib
    import threading

    for name in modules:
        module, _, attr = name.partition(":")  # module:name, what `from module import name` loads
        try:
            loaded = importlib.import_module(module)
            if attr:
                getattr(loaded, attr)
        except BaseException as exc:  # noqa: BLE001 - the child imports its own (and says why)
            print(f"preload: {name} not imported ({type(exc).__name__}: {exc})", flush=True)
            continue
    if threading.active_count() > 1:
        # A thread does not survive a fork, and a lock it held stays held in the child.
        print(f"preload: the imports started threads: {threading.enumerate()}", flush=True)
    with contextlib.suppress(ImportError):
        # set up here, while argv and environ are the process's own: it finds their memory
        # by them (its set-up is lazy, hence the call), and children inherit the set-up
        import setproctitle

        setproctitle.getproctitle()

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears it
    me = os.getpid()
    send(sock, {"op": "ready", "pid": me})
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
            _reap(sock)
        if sock not in ready:
            continue
        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 4)
        if not data:
            return None
        request = json.loads(data)
        if request.get("op") != "spawn" or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            sock.close()
            os.close(wake_r)
            os.close(wake_w)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()  # its own session: the launcher signals it and what it forks
            die_with_parent(me)
            null = os.open(os.devnull, os.O_RDONLY)
            for source, target in ((null, 0), (fds[0], 1), (fds[1], 2)):
                os.dup2(source, target)
                os.close(source)
            return ChildSpec(request["argv"], request["env"], request.get("cwd"))
        for fd in fds:
            os.close(fd)
        send(sock, {"op": "spawned", "id": request.get("id"), "pid": pid})


def _become(spec: ChildSpec) -> None:
    """In the child: be ``python -u ...`` as ``spec.argv`` says, then return to exit."""
    import runpy

    os.environ.clear()
    os.environ.update(spec.env)
    if spec.cwd:
        os.chdir(spec.cwd)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - the process's stdin for good
    sys.stdout, sys.stderr = _stdio(spec)
    import faulthandler

    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)
    threads = spec.env.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")  # a server for a script of the standard library has none
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    for name in [n for n in sys.modules if n.split(".", 1)[0] in OURS]:
        del sys.modules[name]
    try:  # ps shows the worker's command, not the server's (a fork does not exec)
        import setproctitle

        setproctitle.setproctitle(" ".join(spec.argv))
    except ImportError:
        pass
    rest = spec.argv[1:]
    while rest and rest[0] == "-u":
        rest = rest[1:]
    if rest[:1] == ["-m"]:
        sys.argv = ["-m", *rest[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    elif rest[:1] == ["-c"]:
        sys.argv = ["-c", *rest[2:]]
        sys.path[0] = ""
        exec(compile(rest[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
    else:
        _run_script(rest[0], rest)


def _stdio(spec: ChildSpec) -> tuple[io.TextIOWrapper, io.TextIOWrapper]:
    """stdout and stderr as the command's interpreter would have them: written through
    under ``-u`` (every worker's command; the only flag ``eligible`` admits) or
    PYTHONUNBUFFERED; else buffered, stdout by the line on a terminal only and stderr
    always by the line, as Python 3.9+ does."""
    unbuffered = spec.argv[1:2] == ["-u"] or bool(spec.env.get("PYTHONUNBUFFERED"))

    def stream(fd: int, by_line: bool, **kwargs: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        if unbuffered:
            return io.TextIOWrapper(raw, write_through=True, **kwargs)
        return io.TextIOWrapper(io.BufferedWriter(raw), line_buffering=by_line, **kwargs)

    return stream(1, os.isatty(1)), stream(2, True, errors="backslashreplace")


def _run_script(script: str, argv: list[str]) -> None:
    """As ``python SCRIPT`` does: the script is module ``__main__`` (for good, so that
    pickling its classes works), ``__file__`` absolute, ``sys.argv[0]`` as given."""
    import builtins
    import importlib.machinery
    import types

    path = os.path.abspath(script)
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = builtins
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main.__spec__ = None
    main.__cached__ = None
    sys.modules["__main__"] = main
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(path)
    with open(path, "rb") as f:  # bytes: compile honours the file's encoding line
        code = compile(f.read(), path, "exec")
    exec(code, main.__dict__)  # noqa: S102 - running the user's script is the point


def eligible(argv: list[str]) -> bool:
    """Commands a child of the server can run: this interpreter, with no flag but -u."""
    if not argv or argv[0] != sys.executable:
        return False
    rest = argv[1:]
    while rest and rest[0] == "-u":
        rest = rest[1:]
    if rest[:1] in (["-m"], ["-c"]):
        return len(rest) >= 2
    return bool(rest) and not rest[0].startswith("-")


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    die_with_parent(int(sys.argv[2]))
    _run(sock, json.loads(sys.argv[3]) if len(sys.argv) > 3 else list(PRELOAD))


def forked_main(
    sock: socket.socket, parent: int, env: dict[str, str], log_file: os.PathLike, modules: list[str]
) -> NoReturn:
    """The server as a fork of the launcher (launcher/warm.py ``fork=True``), made what
    ``python -m launcher.forkserver`` would be: its own session, the server's environment,
    stdin from /dev/null, output to its log, no descriptor of the launcher's but the
    socket, and the launcher's modules dropped where a child runs a script (``_become``).
    The exit handlers registered so far stay: they are those of the modules imported
    (logging, multiprocessing, weakref.finalize for torch's), which a fresh server would
    have registered too and which its children run as they end (``_end``); the launcher
    registers none of its own before this fork."""
    os.setsid()
    die_with_parent(parent)
    with contextlib.suppress(ImportError):  # before the environment changes (see serve)
        import setproctitle

        setproctitle.setproctitle(f"{sys.executable} -m launcher.forkserver")
    os.environ.clear()
    os.environ.update(env)
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for source, target in ((null, 0), (log, 1), (log, 2)):
        os.dup2(source, target)
    keep = sock.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
    _run(sock, modules)


def _run(sock: socket.socket, modules: list[str]) -> NoReturn:
    spec = serve(sock, modules)
    if spec is None:
        # The launcher is done with us. An interpreter that imported torch, dynamo and
        # FSDP takes about half a second to tear down, and the launcher waits for it at
        # every exit; there is nothing to flush but our own output.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    interrupted = False
    try:
        _become(spec)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:  # the script's: printed as Python would, from its frames
        _report(exc)
        interrupted = isinstance(exc, KeyboardInterrupt)
        code = 1
    _end(code, interrupted)


def _exit_code(exc: SystemExit) -> int:
    """The exit status Python gives ``sys.exit(exc.code)``."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    with contextlib.suppress(Exception):
        print(exc.code, file=sys.stderr)
    return 1


# What the child flushes before it ends: the buffered file objects the script left open
# (Python's teardown would close them as it freed them). By exact type: a test of each
# of ~200,000 objects with isinstance would take as long as the teardown it replaces,
# and some of torch's objects warn when asked their class.
_BUFFERED = frozenset({io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair})


def _end(code: int, interrupted: bool = False) -> NoReturn:
    """End the worker as Python ends at exit, less the teardown of the interpreter.

    A worker forked from this server has torch and what the script imported loaded;
    freeing all of it took 0.3-0.8 s of CPU per worker, on every worker's exit, with
    nothing to show for it (measured: 0.84 s between a worker's last atexit handler and
    its exit, two workers on two cores). multiprocessing's forked children end with
    ``os._exit`` for the same reason. What Python does before its teardown happens here
    too, in its order: the script's non-daemon threads are joined, the atexit handlers
    run (logging's shutdown, ``weakref.finalize``, multiprocessing's children), and
    every buffer is written: Python's open file objects and C's stdio. What is left out
    is ``__del__`` of objects still referenced at exit; a script that needs that runs
    with ``--no-warm-start``."""
    import atexit
    import gc
    import threading

    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]  # as Py_FinalizeEx does first
    atexit._run_exitfuncs()  # prints what a handler raises, as Python does
    for obj in gc.get_objects():
        if type(obj) in _BUFFERED:
            with contextlib.suppress(Exception):
                if not obj.closed:
                    obj.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)  # printf's buffers, from C and C++ code
    if interrupted:  # as Python ends on one: by the signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _report(exc: BaseException) -> None:
    """Print ``exc`` through ``sys.excepthook`` (the script may have set its own) with
    this module's frames left out: a user reads their script's traceback, as under
    ``python SCRIPT`` or torchrun, not the fork server's."""
    tb = exc.__traceback__
    here = _report.__code__.co_filename
    while tb is not None and tb.tb_frame.f_code.co_filename == here:
        tb = tb.tb_next
    # (the hook prints the exception's own __traceback__ whatever it is given)
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)
    sys.stderr.flush()


if __name__ == "__main__":
    main()
