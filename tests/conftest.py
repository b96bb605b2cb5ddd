"""What every test gets from the suite: nothing it starts outlives it, a budget its waits
end within, and, when it fails, the tail of its job's logs where CI's last lines show it.

- **Processes.** pytest is the child subreaper of everything a test starts (Linux
  ``PR_SET_CHILD_SUBREAPER``): a worker whose launcher was killed is re-parented to pytest,
  not to init, so every process a test started, however deep and in whatever session, is
  one of pytest's descendants. After each test, whatever it started and left running gets
  a few seconds to exit (a killed launcher's workers die of it a moment later), then is
  sent SIGCONT (a test that froze a node may leave it stopped) and SIGKILL, and the test
  fails naming each process. A test that already failed gets the kill and a note instead
  of a second failure.
- **Network namespaces and bridges** (tests/netns.py names them ``ch*`` with the making
  pytest process's id, so that pytest-xdist's workers each check their own; checked for
  the tests that use its ``net`` fixture) and **etcd data folders** (tests/etcd/cluster.py
  puts them on tmpfs) left by a test are removed, and the test fails naming them.
- **The budget.** tests/clock.py learns when the test's pytest timeout fires, so that the
  helpers' waits end first and a job that ran out fails with its log.
- **Temporary files.** A run's folder goes to ``$TMPDIR/chameleon`` unless ``--log-dir``
  says otherwise, and torchrun's to ``$TMPDIR/torchelastic_*``: the suite points
  ``TMPDIR`` at a folder of its own for everything it starts and removes it when the
  suite passed (a failed suite's stays, for its workers' logs, until the next suite
  starts), so that runs of the suite do not pile up folders in /tmp.
- **Logs.** A failed test's report carries the tails of the newest logs in its
  ``tmp_path`` (launcher output, event logs); the run's summary repeats them just before
  pytest's short summary, the last lines CI prints.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tests import clock, netns, prefork, references
from tests.locks import locked
from tests.torchfree import torch_free

pytest_plugins = ("pytester",)  # tests/test_conftest.py runs the suite's rules in a pytest

_PR_SET_CHILD_SUBREAPER = 36
# How long a test's processes may take to exit on their own once it ended: a launcher
# killed by the test takes its workers down through PR_SET_PDEATHSIG and its reaper
# guard, which is milliseconds on an idle machine.
EXIT_GRACE_S = clock.slack(2.0)
LOG_SUFFIXES = (".log", ".jsonl", ".events", ".out", ".err")
JOB_LOG = "job log of the test:"  # a report section's title: "job log of the test: PATH (tail)"
_failed_logs: list[tuple[str, list[tuple[str, str]]]] = []  # (test, [(log, tail)])
ETCD_TMPFS = Path("/dev/shm")
ETCD_PREFIX = "chameleon-etcd-"
SCRATCH_PREFIX = "chameleon-test-tmp-"  # TMPDIR of what the suite starts: tempdir/<this><pid>-*


def pytest_configure(config: pytest.Config) -> None:
    # The tests of Ctrl-C send SIGINT as a terminal would. A suite started in the
    # background of a shell without job control (`bash .ci/run &` in a script, nohup)
    # inherits SIGINT ignored, and so would everything it starts: its workers never saw
    # the signal (seen in CI: "stopped by signal 2: signal 9"). What a terminal gives, then.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    if not os.environ.get("PYTEST_XDIST_WORKER") and LOCKS_ENV not in os.environ:
        # the controller (or a plain run): the lock files its xdist workers share, and a
        # suite run beside it shares too where one is named (.ci/run: the compatibility
        # run's tests, so that no solo test overlaps one of them either)
        folder = os.environ.get(SHARED_LOCKS_ENV)
        if not folder:
            folder = tempfile.mkdtemp(prefix="chameleon-test-locks-")
            config._chameleon_locks = folder  # type: ignore[attr-defined]
        os.environ[LOCKS_ENV] = folder
        # (after mkdtemp: this process's own tempdir, pytest's basetemp with it, stays
        # where it was; its workers get their basetemp from it, and the rest inherit this)
        _remove_old_scratch()
        scratch = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
        config._chameleon_scratch = (scratch, os.environ.get("TMPDIR"))  # type: ignore[attr-defined]
        os.environ["TMPDIR"] = scratch
    prefork.remember_env()  # (after TMPDIR: what the suite starts runs with its own)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Tests that torch cannot reach are marked so, for the compatibility run to leave out
    # (tests/torchfree.py).
    for item in items:
        if torch_free(Path(item.path).resolve()):
            item.add_marker(pytest.mark.torch_free)


def _remove_old_scratch() -> None:
    """The folders of earlier suites that failed (kept for their logs), once the suite
    that made each is gone."""
    for folder in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        pid = folder.name[len(SCRATCH_PREFIX) :].split("-")[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config._chameleon_passed = exitstatus == 0  # type: ignore[attr-defined]


def pytest_unconfigure(config: pytest.Config) -> None:
    prefork.close()
    folder = getattr(config, "_chameleon_locks", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    scratch = getattr(config, "_chameleon_scratch", None)
    if scratch is not None:  # (the controller: it set both)
        os.environ.pop(LOCKS_ENV, None)
        if getattr(config, "_chameleon_passed", False):
            shutil.rmtree(scratch[0], ignore_errors=True)
        else:  # (the failed runs' worker logs: until the next suite starts)
            print(f"runs' folders (worker logs) kept in {scratch[0]}", file=sys.stderr)
        if scratch[1] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = scratch[1]


# -- the order files are handed out in -------------------------------------------------------
#
# pytest-xdist's ``--dist loadfile`` hands whole files to its two workers, each to the
# first worker free, most tests first (its default reorder: a collection order set here
# is not kept). Tried on 2026-12-02 and measured: files longest first by their measured
# time (``--no-loadscope-reorder``), which ran the heaviest jobs against each other
# (two 4-worker jobs on 2 cores: a fork server 5.3 s to be ready, a clock-timed kill
# before the first step): `bash .ci/run` 23:03 against 21:56 with xdist's own order the
# same day. Reverted; what is worth more is less work per test.


# -- tests that need the machine to themselves ----------------------------------------------
#
# The suite runs on pytest-xdist's workers, two tests at once: most tests wait on
# timeouts and heartbeats as much as they compute, and share the cores well. A test
# marked ``solo`` asserts what relative speed decides (a slowed worker found and planned
# around within so many steps, steps as fast after a slowdown as before): another test's
# load on the same cores would decide it instead. It runs when no other test does, and
# no other test starts until it ends.

LOCKS_ENV = "CHAMELEON_TEST_LOCKS"
SHARED_LOCKS_ENV = "CHAMELEON_TEST_SHARED_LOCKS"  # made and removed by whoever sets it


def _enter(folder: str, solo: bool) -> contextlib.ExitStack:
    """The room: shared by ordinary tests, exclusive for a solo one. The gate before it
    keeps a waiting solo test from being overtaken forever (a worker that ends a test
    takes the room again at once otherwise)."""
    room = contextlib.ExitStack()
    with locked(os.path.join(folder, "gate")):
        room.enter_context(locked(os.path.join(folder, "room"), shared=not solo))
    return room


def _solo(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("solo") is not None


# A solo test followed by another keeps the room for it: given back in between, the
# other worker takes it for one of its tests, which the next solo test waits out idle.
_kept: list[contextlib.ExitStack] = []


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    # tryfirst: outside pytest-timeout's wrapper, so that the wait for the room is not
    # counted against the test's timeout
    folder = os.environ.get(LOCKS_ENV)
    if not folder or not os.environ.get("PYTEST_XDIST_WORKER"):
        return (yield)
    room = _kept.pop() if _kept else _enter(folder, _solo(item))
    try:
        return (yield)
    finally:
        if _solo(item) and _solo(nextitem):
            _kept.append(room)
        else:
            room.close()


@pytest.fixture(scope="session", autouse=True)
def _reference_folder(tmp_path_factory: pytest.TempPathFactory) -> None:
    # Under pytest-xdist each worker's base folder is popen-gwN inside the run's: the
    # references live beside them, one set for the whole run (tests/references.py)
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = shared / "references"
    folder.mkdir(exist_ok=True)
    references.set_root(folder)


# -- what a test leaves behind -------------------------------------------------------------


def _descendants() -> dict[int, psutil.Process]:
    try:
        return {p.pid: p for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return {}


# The standard library's helpers of the pytest process itself (torch.multiprocessing's
# spawn starts multiprocessing's resource tracker, which serves pytest until it exits):
# pytest's, not the test's.
PYTEST_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _alive(p: psutil.Process) -> bool:
    try:
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        if p.ppid() == os.getpid():
            cmdline = " ".join(p.cmdline())
            if any(helper in cmdline for helper in PYTEST_HELPERS):
                return False
        return p.is_running()
    except psutil.Error:
        return False


def _describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid} ({' '.join(p.cmdline())[:160] or p.name()})"
    except psutil.Error:
        return f"pid {p.pid}"


def _reap(skip: set[int]) -> None:
    """Collect the exit status of pytest's exited children (re-parented orphans among
    them), except those a longer-lived fixture may still wait for."""
    for p in _descendants().values():
        if p.pid in skip:
            continue
        try:
            if p.ppid() == os.getpid() and p.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(p.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            pass


def _kill(procs: list[psutil.Process]) -> None:
    for sig in (signal.SIGCONT, signal.SIGKILL):
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
    psutil.wait_procs(procs, timeout=5)


def _namespaces() -> set[str]:
    if shutil.which("ip") is None or os.geteuid() != 0:
        return set()
    found = set()
    for args in (["netns", "list"], ["-o", "link", "show", "type", "bridge"]):
        done = subprocess.run(["ip", *args], capture_output=True, text=True)
        for line in done.stdout.splitlines():
            words = line.replace(":", " ").split()
            name = words[0] if args[0] == "netns" else (words[1] if len(words) > 1 else "")
            if netns.mine(name):  # (another xdist worker's are its own business)
                found.add(("netns " if args[0] == "netns" else "link ") + name)
    return found


def _remove_namespace(kind_name: str) -> None:
    kind, name = kind_name.split(" ", 1)
    cmd = ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name]
    subprocess.run(cmd, capture_output=True)


def _etcd_folders() -> set[Path]:
    """This pytest's etcd data folders (tests/etcd/cluster.py names them by its pid)."""
    mine = f"{ETCD_PREFIX}{os.getpid()}-*"
    return set(ETCD_TMPFS.glob(mine)) if ETCD_TMPFS.is_dir() else set()


def _timeout_s(request: pytest.FixtureRequest) -> float | None:
    """The test's pytest-timeout: its marker's, else --timeout's, else the ini's."""
    marker = request.node.get_closest_marker("timeout")
    value = None
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    if value is None:
        value = request.config.getoption("timeout", None) or request.config.getini("timeout")
    return float(value) if value else None


@pytest.fixture(autouse=True)
def _nothing_outlives_the_test(request: pytest.FixtureRequest):
    before = set(_descendants())
    # (namespaces take two `ip` commands to list: only for the tests that make them)
    makes_namespaces = "net" in request.fixturenames
    spaces = _namespaces() if makes_namespaces else set()
    folders = _etcd_folders()
    clock.set_deadline(_timeout_s(request))
    yield
    clock.set_deadline(None)
    left: list[psutil.Process] = []
    deadline = time.monotonic() + EXIT_GRACE_S
    before.add(prefork.server_pid())  # (the run's, started by this test's first launch)
    while True:
        left = [p for pid, p in _descendants().items() if pid not in before and _alive(p)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    problems = [f"left running: {_describe(p)}" for p in left]
    for _ in range(3):  # (what they started in the meantime goes too)
        if not left:
            break
        _kill(left)
        left = [p for pid, p in _descendants().items() if pid not in before and _alive(p)]
    _reap(before)
    for name in sorted((_namespaces() if makes_namespaces else set()) - spaces):
        problems.append(f"left behind: {name}")
        _remove_namespace(name)
    for folder in sorted(_etcd_folders() - folders):
        problems.append(f"left behind: {folder}")
        shutil.rmtree(folder, ignore_errors=True)
    if not problems:
        return
    failed = getattr(request.node, "_chameleon_failed", False)
    if failed:  # said beside the test's own failure, not as a second one
        request.node._chameleon_leftovers = problems
    else:
        pytest.fail("the test left things behind (removed now):\n  " + "\n  ".join(problems))


# -- a failed test's logs ------------------------------------------------------------------


def _tail(path: Path, lines: int) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - 200 * lines))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _logs(folder: Path, *, count: int) -> list[Path]:
    """The newest log files under a test's folder, the job's own (launcher output, event
    logs) before etcd members'."""
    try:
        found = [p for p in folder.rglob("*") if p.suffix in LOG_SUFFIXES and p.is_file()]
    except OSError:
        return []
    found.sort(key=lambda p: ("etcd" in str(p.relative_to(folder)), -p.stat().st_mtime))
    return found[:count]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report: pytest.TestReport = yield
    if report.failed:
        item._chameleon_failed = True  # type: ignore[attr-defined]
    folder = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and report.when in ("setup", "call") and isinstance(folder, Path):
        for path in _logs(folder, count=4):
            report.sections.append((f"{JOB_LOG} {path} (tail)", _tail(path, 40)))
    if report.when == "teardown":
        leftovers = getattr(item, "_chameleon_leftovers", None)
        if leftovers:
            report.sections.append(
                ("left behind by the failed test (removed)", "\n".join(leftovers))
            )
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Where reports arrive (the controller, under pytest-xdist): a failed test's log
    tails, for the summary."""
    if report.failed and report.when in ("setup", "call"):
        tails = [
            (title[len(JOB_LOG) + 1 :].rsplit(" (tail)", 1)[0], "\n".join(text.splitlines()[-12:]))
            for title, text in report.sections
            if title.startswith(JOB_LOG + " ")
        ]
        _failed_logs.append((report.nodeid, tails))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    failed = _failed_logs
    if not failed:
        return
    terminalreporter.section("job logs of the failed tests (tails; whole in each failure above)")
    for nodeid, tails in failed:
        terminalreporter.write_line(f"FAILED {nodeid}")
        if not tails:
            terminalreporter.write_line("    (no log in its tmp_path)")
        for path, text in tails:
            terminalreporter.write_line(f"  -- {path}")
            for line in text.splitlines():
                terminalreporter.write_line(f"    {line[:200]}")
