"""Running ``chameleon run`` as a user would: a real process in a temporary folder."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterable
from pathlib import Path

from tests import prefork
from tests.clock import budget

ROOT = Path(__file__).resolve().parents[2]


def write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chameleon_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "chameleon_cli", *args]


def env() -> dict[str, str]:
    return prefork.server_env()


_env = env  # ``start`` takes an ``env`` argument of its own


def _log_path(cwd: Path, stem: str) -> Path:
    """A new file for a process's output in its working folder, where tests/conftest.py
    finds it when the test fails: ``chameleon-run.1.log``, ``chameleon-run.2.log``, ..."""
    n = 1
    while (cwd / f"{stem}.{n}.log").exists():
        n += 1
    return cwd / f"{stem}.{n}.log"


def run(
    *args: str,
    cwd: Path,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """``chameleon ARGS`` to its end. Its stdout and stderr are kept in files in ``cwd`` as
    well as returned, so that a run cut short still leaves its log. ``timeout`` is cut to
    the test's budget (tests/clock.py); a run past it is killed (its launcher's guard
    kills the workers) and fails the test with its log's tail. The process is forked
    from the suite's warm server unless ``fresh`` (tests/prefork.py)."""
    out_path, err_path = _log_path(cwd, "chameleon-run.out"), _log_path(cwd, "chameleon-run.err")
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = prefork.popen(
            chameleon_cmd(*args), cwd=cwd, env={**_env(), **(env or {})}, stdout=out,
            stderr=err, fresh=fresh,
        )  # fmt: skip
        limit = budget(timeout)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            before = err_path.stat().st_size
            ask_for_stacks(proc.pid)
            proc.kill()
            proc.wait()
            tail = (out_path.read_text()[-3000:], err_path.read_text()[-3000:])
            raise AssertionError(
                f"chameleon {' '.join(args)} still running after {limit:.0f} s, killed;\n"
                f"{_timeline(args, cwd)}{_launcher_stack(err_path, before)}"
                f"stdout: ...{tail[0]}\nstderr: ...{tail[1]}"
            ) from None
    return subprocess.CompletedProcess(proc.args, code, out_path.read_text(), err_path.read_text())


# What a run's timeline line keeps of an event: enough to say which phase it stood in.
_TIMELINE_FIELDS = (
    "rank", "ranks", "generation", "phase", "recovery_phase", "worker_phase", "action",
    "label", "reason", "detail", "exit_code",
)  # fmt: skip


def _timeline(args: tuple[str, ...], cwd: Path, last: int = 30) -> str:
    """The last events of a run killed past its budget (``--events`` of ``args``), one line
    each: on a CI machine its files are gone with it, and its stacks say where each
    process waited but not what the launcher had decided."""
    if "--events" not in args:
        return ""
    path = Path(args[args.index("--events") + 1])
    path = path if path.is_absolute() else cwd / path
    evs = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # (a line cut short by the kill)
                evs.append(json.loads(line))
    lines, t0 = [], evs[0].get("t", 0.0) if evs else 0.0
    for e in evs[-last:]:
        fields = " ".join(f"{k}={e[k]}" for k in _TIMELINE_FIELDS if e.get(k) is not None)
        lines.append(f"  {e.get('t', t0) - t0:7.3f} s  {e.get('event')} {fields}"[:240])
    return f"its last {len(lines)} of {len(evs)} events:\n" + "\n".join(lines) + "\n"


def _launcher_stack(err: Path, since: int) -> str:
    """The launcher's own thread stacks of those ``ask_for_stacks`` had written to ``err``
    from byte ``since``: the lines no ``[rank N]`` prefix marks as a worker's. The log's
    tail holds the last workers' stacks; the launcher's say what it waited on."""
    with open(err, "rb") as f:
        f.seek(since)
        said = f.read().decode(errors="replace").splitlines()
    own = [line for line in said if not line.startswith("[rank")]
    return "the launcher's stacks:\n" + "\n".join(own)[:4000] + "\n" if own else ""


def start(
    *args: str, cwd: Path, log: Path, env: dict[str, str] | None = None, fresh: bool = False
) -> subprocess.Popen | prefork.Launched:
    """``chameleon ARGS`` started, its output to ``log``: forked from the suite's warm
    server unless ``fresh`` (tests/prefork.py)."""
    with open(log, "w") as out:  # (the child has its own descriptor of it)
        return prefork.popen(
            chameleon_cmd(*args), cwd=cwd, env={**_env(), **(env or {})}, stdout=out,
            stderr=subprocess.STDOUT, fresh=fresh,
        )  # fmt: skip


def _catches(pid: int, signum: int) -> bool:
    """Whether ``pid`` has a handler for ``signum`` (Linux: SigCgt in /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(
        (line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0"
    )
    return bool(int(caught, 16) >> (signum - 1) & 1)


def ask_for_stacks(pid: int, grace_s: float = 1.0) -> None:
    """Before a run past its budget is killed: every process of it that registered the
    stacks signal (the launcher, its workers: faulthandler) writes each thread's Python
    stack to its stderr, so the failure's log says where each one waited. A process
    without the handler is skipped (the signal's default action would kill it)."""
    import psutil

    from launcher.forkserver import STACKS_SIGNAL

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return
    asked = 0
    for p in procs:
        if _catches(p.pid, STACKS_SIGNAL):
            with contextlib.suppress(psutil.Error):
                p.send_signal(STACKS_SIGNAL)
                asked += 1
    if asked:
        time.sleep(grace_s)


def node_processes(agent_pid: int, workers: Iterable[int]) -> list:
    """A node's processes: its agent first, then everything it started, and its workers
    (each in a session of its own)."""
    import psutil

    root = psutil.Process(agent_pid)
    found = {p.pid: p for p in [root, *root.children(recursive=True)]}
    for pid in workers:
        found.setdefault(pid, psutil.Process(pid))
    return list(found.values())


def freeze(procs: list, seconds: float) -> float:
    """Stop ``procs`` (SIGSTOP) for ``seconds``, then continue them, in their order (a node
    frozen whole: its agent first, ``node_processes``); when they were stopped. None is
    left stopped, whatever happens. A child that was exiting as it was stopped is reaped
    by its parent, continued before it (seen, one run in three): gone, not an error."""
    import psutil

    stopped = []
    try:
        for p in procs:
            p.send_signal(signal.SIGSTOP)
            stopped.append(p)
        frozen_at = time.time()
        time.sleep(seconds)
    finally:
        for p in stopped:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGCONT)
    return frozen_at


def running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie has ended): a process can end between any two
    questions about it."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def leftovers(folder: Path) -> list:
    """Processes whose command line names ``folder``: a run's workers still alive."""
    import psutil

    return [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(folder) in " ".join(p.info["cmdline"] or [])
    ]


def events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for_event(path: Path, name: str, timeout: float = 60, **match) -> dict:
    timeout = budget(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in events(path):
            if e["event"] == name and all(e.get(k) == v for k, v in match.items()):
                return e
        time.sleep(0.05)
    raise AssertionError(f"no {name} event within {timeout} s in {path}: {events(path)}")


def stacks(output: str) -> str:
    """The stacks in a launcher's output (a worker killed as hung writes every thread's
    first, launcher/workers.py; a traceback's frames too), for a failing test's message:
    where a hang was, which a CI run's summary table alone does not say."""
    kept = [
        line for line in output.splitlines() if "most recent call first" in line or 'File "' in line
    ]
    return "\n" + "\n".join(kept)[-8000:]


def devices_config(tmp: Path) -> Path:
    """The CPU test bed's config, planned as if each worker had a device of its own
    (host_cores = 0): a larger layout is then faster, and replacements are taken in."""
    config = tmp / "devices.toml"
    testbed = (ROOT / "configs" / "cpu_testbed.toml").read_text()
    config.write_text(testbed.replace("host_cores = 2", "host_cores = 0"))
    return config


def rank_outputs(folder: Path, name: str) -> dict[int, dict]:
    """What each rank wrote to ``folder/name.rank<R>.json``, by rank."""
    return {
        int(f.name.split(".rank")[1].split(".")[0]): json.loads(f.read_text())
        for f in folder.glob(f"{name}.rank*.json")
    }


def lose_node_1(
    tmp: Path,
    args: list[str],
    *,
    after_step: int = 10,
    flags: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    timeout: float = 120,
) -> list[dict]:
    """Two agents on 127.0.0.1 (``--nproc-per-node 2`` each, ``flags`` besides) run
    ``args``; once node 0 reports step ``after_step``, node 1's agent is SIGKILLed (its
    workers die with it). Node 0 must then exit 0; its events are returned. A failed run
    leaves no launcher behind."""
    common = [
        "run", "--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), "--heartbeat-timeout", "3", *flags,
    ]  # fmt: skip
    node1 = start(*common, "--node-rank", "1", *args, cwd=tmp, log=tmp / "n1.log", env=env)
    log0 = tmp / "n0.jsonl"
    node0 = start(
        *common, "--node-rank", "0", "--events", str(log0), *args, cwd=tmp,
        log=tmp / "n0.log", env=env,
    )  # fmt: skip
    try:
        timeout = budget(timeout)
        deadline = time.monotonic() + timeout
        while not any(e["event"] == "step" and e["step"] >= after_step for e in events(log0)):
            assert time.monotonic() < deadline and node0.poll() is None
            time.sleep(0.05)
        node1.kill()
        node1.wait()
        assert node0.wait(timeout=budget(timeout)) == 0, (tmp / "n0.log").read_text()[-3000:]
    finally:
        for node in (node0, node1):
            if node.poll() is None:
                node.kill()
                node.wait()
    return events(log0)
