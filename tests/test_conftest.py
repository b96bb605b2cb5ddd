"""The suite's own rules (tests/conftest.py), tested as pytest runs them: a test that
leaves a process running fails, naming it, and the process is gone afterwards, however
it was left (a child, an orphan re-parented by the subreaper, a stopped one); a failed
test's report and the run's last lines carry its job's log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launcher.helpers import running

ROOT = Path(__file__).resolve().parent.parent

LEAKS = """
import os, signal, subprocess, sys, time

def sleeper(tag):
    return [sys.executable, "-c", "import time; time.sleep(300)", tag]

def test_leaves_a_child():
    p = subprocess.Popen(sleeper("leak-child"), start_new_session=True)
    open("child.pid", "w").write(str(p.pid))

def test_leaves_an_orphan_stopped():
    # the intermediate process exits: its child is re-parented (to pytest, the subreaper)
    code = (
        "import subprocess, sys; p = subprocess.Popen(%r, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)"
        % (sleeper("leak-orphan"),)
    )
    pid = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout)
    os.kill(pid, signal.SIGSTOP)
    open("orphan.pid", "w").write(str(pid))

def test_cleans_up():
    p = subprocess.Popen(sleeper("no-leak"))
    p.kill()
    p.wait()

def test_fails_with_a_log(tmp_path):
    (tmp_path / "job.log").write_text("first line\\nthe job's last words\\n")
    assert False, "the test's own failure"
"""


def test_a_leaked_process_fails_its_test_and_is_gone_after_it(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("CHAMELEON_TEST_SLACK", "0.25")  # half a second's grace to exit
    pytester.makepyfile(test_leaks=LEAKS)
    result = pytester.runpytest_subprocess("-p", "tests.conftest", "-p", "no:cacheprovider")
    # the two leaks pass their calls and fail at teardown; the failing test fails once
    result.assert_outcomes(passed=3, failed=1, errors=2)
    out = result.stdout.str()
    assert out.count("E           Failed: the test left things behind") == 2
    assert "leak-child" in out and "leak-orphan" in out and "no-leak" not in out
    for name in ("child.pid", "orphan.pid"):
        pid = int((pytester.path / name).read_text())
        assert not running(pid), f"{name}: {pid} still running"
    # the failed test's log, in its report and again in the run's last lines
    assert "job log of the test: " in out and "job.log (tail)" in out
    assert "\nthe job's last words\n" in out
    tail = out[out.index("job logs of the failed tests") :]
    assert "FAILED test_leaks.py::test_fails_with_a_log" in tail
    assert "\n    the job's last words\n" in tail


def test_a_run_killed_past_its_budget_writes_its_stacks_first(tmp_path):
    """tests/launcher/helpers.ask_for_stacks: what registered the stacks signal writes
    every thread's stack; a process that did not is left running (the signal's default
    action would have killed it, before the test could read anything)."""
    import subprocess
    import sys
    import time

    from tests.launcher.helpers import ask_for_stacks

    parent_code = (
        "import faulthandler, subprocess, sys, time\n"
        "from launcher.forkserver import STACKS_SIGNAL\n"
        "faulthandler.register(STACKS_SIGNAL, all_threads=True)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        # The pid is printed from inside waiting_here, so the stacks asked for once it
        # is read show that frame (printed before the call, the dump could land first).
        "def waiting_here():\n"
        "    print(child.pid, flush=True)\n"
        "    time.sleep(60)\n"
        "waiting_here()\n"
    )
    err = tmp_path / "err"
    with open(err, "w") as stderr:
        parent = subprocess.Popen(
            [sys.executable, "-c", parent_code], cwd=ROOT, stdout=subprocess.PIPE,
            stderr=stderr, text=True,
        )  # fmt: skip
    child = None
    try:
        child = int(parent.stdout.readline())
        ask_for_stacks(parent.pid, grace_s=0.5)
        deadline = time.monotonic() + 10
        while "waiting_here" not in err.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "waiting_here" in err.read_text(), err.read_text()
        assert running(parent.pid) and running(child)
    finally:
        parent.kill()
        parent.wait()
        if child is not None:
            subprocess.run(["kill", "-9", str(child)], capture_output=True)


def test_a_run_killed_past_its_budget_says_its_last_events(tmp_path):
    """tests/launcher/helpers._timeline: the events of a run cut short, one line each with
    its time since the first, in the failure's message (a CI machine's files go with it);
    a line the kill cut short is skipped, not the whole timeline."""
    from tests.launcher.helpers import _timeline

    log = tmp_path / "events.jsonl"
    lines = [
        {"t": 100.0, "event": "start"},
        {"t": 101.5, "event": "failure", "rank": 5, "exit_code": -9, "pid": 7},
        {"t": 101.75, "event": "plan_chosen", "generation": 1, "label": "4x1 stages"},
    ]
    log.write_text("".join(json.dumps(e) + "\n" for e in lines) + '{"t": 102.0, "ev')
    said = _timeline(("run", "--events", "events.jsonl", "x.py"), tmp_path)
    assert said.splitlines() == [
        "its last 3 of 3 events:",
        "    0.000 s  start ",
        "    1.500 s  failure rank=5 exit_code=-9",
        "    1.750 s  plan_chosen generation=1 label=4x1 stages",
    ]
    assert _timeline(("run", "x.py"), tmp_path) == ""


SOLO = """
import json, os, time
import pytest

def spell(name):
    began = time.time()
    peer = os.environ.get("PEER")  # (a suite beside this one: its spells' folder)
    if peer and not name.startswith("solo"):
        # an ordinary test waits until the other suite has one started too, so that the
        # two suites surely overlap
        open(os.path.join(os.environ["SPELLS"], "started-" + name), "w").close()
        for _ in range(300):
            if any(f.startswith("started-") for f in os.listdir(peer)):
                break
            time.sleep(0.1)
    time.sleep(0.6)
    with open(os.path.join(os.environ["SPELLS"], name), "w") as f:
        json.dump([began, time.time()], f)

@pytest.mark.parametrize("n", range(4))
def test_ordinary(n):
    spell(f"ordinary-{n}")

@pytest.mark.solo
@pytest.mark.parametrize("n", range(2))
def test_alone(n):
    spell(f"solo-{n}")
"""


def _a_run_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """An inner run is a run of its own, even inside an xdist worker of this one."""
    for name in (
        "CHAMELEON_TEST_LOCKS",
        "CHAMELEON_TEST_SHARED_LOCKS",
        "PYTEST_XDIST_WORKER",
        "PYTEST_XDIST_WORKER_COUNT",
    ):
        monkeypatch.delenv(name, raising=False)


def _overlap(a: list[float], b: list[float]) -> bool:
    """Whether two spells' [began, ended] spans overlap."""
    return a[0] < b[1] and b[0] < a[1]


@pytest.mark.slow  # (an inner pytest of three processes: 6 s of the fast tier)
def test_a_solo_test_runs_while_no_other_test_does(pytester, monkeypatch, tmp_path):
    """Under pytest-xdist, a test marked ``solo`` has the machine to itself: no other
    test's time overlaps its own; the ordinary ones do overlap one another."""
    import json

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("SPELLS", str(tmp_path))
    _a_run_of_its_own(monkeypatch)
    pytester.makeini("[pytest]\nmarkers =\n    solo: alone\n")
    pytester.makepyfile(test_solo=SOLO)
    result = pytester.runpytest_subprocess(
        "-p", "tests.conftest", "-p", "no:cacheprovider", "-n", "2", "--dist", "load"
    )  # fmt: skip
    result.assert_outcomes(passed=6)
    spans = {f.name: json.loads(f.read_text()) for f in tmp_path.iterdir()}
    assert len(spans) == 6

    for name, span in spans.items():
        if name.startswith("solo"):
            others = [n for n in spans if n != name and _overlap(span, spans[n])]
            assert others == [], (name, others, spans)
    ordinary = [spans[n] for n in spans if n.startswith("ordinary")]
    assert any(_overlap(a, b) for i, a in enumerate(ordinary) for b in ordinary[i + 1 :]), spans


BESIDE = """
import pytest
from test_solo import spell

@pytest.mark.parametrize("n", range(4))
def test_beside(n):
    spell(f"beside-{n}")
"""


@pytest.mark.slow  # (two inner pytests at once: 8 s)
def test_a_solo_test_overlaps_no_test_of_a_suite_sharing_its_locks(monkeypatch, tmp_path):
    """.ci/run runs the compatibility run beside the main suite, both given one lock
    folder (CHAMELEON_TEST_SHARED_LOCKS): a solo test of one overlaps no test of the
    other, and the folder stays for whoever made it."""
    import os
    import subprocess
    import sys

    shared = tmp_path / "locks"
    shared.mkdir()
    _a_run_of_its_own(monkeypatch)  # (each given the shared folder below)
    for name in ("solo", "beside"):
        (tmp_path / "spells" / name).mkdir(parents=True)
    suites = []
    # the solo file under two xdist workers, and beside it a suite of ordinary tests
    for name, workers, test_file in (
        ("solo", "2", "test_solo.py"),
        ("beside", "1", "test_beside.py"),
    ):
        folder, spells = tmp_path / name, tmp_path / "spells" / name
        folder.mkdir()
        (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    solo: alone\n")
        (folder / "test_solo.py").write_text(SOLO)
        (folder / "test_beside.py").write_text(BESIDE)
        peer = tmp_path / "spells" / ("beside" if name == "solo" else "solo")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SPELLS": str(spells), "PEER": str(peer)}
        env["CHAMELEON_TEST_SHARED_LOCKS"] = str(shared)
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest"]
        argv += ["-p", "no:cacheprovider", "-n", workers, "--dist", "load", test_file]
        suites.append(
            subprocess.Popen(
                argv,
                cwd=folder,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [suite.communicate(timeout=60)[0] for suite in suites]
    assert [suite.returncode for suite in suites] == [0, 0], outputs
    assert shared.is_dir()
    spans = {
        f"{suite.name}/{f.name}": json.loads(f.read_text())
        for suite in (tmp_path / "spells").iterdir()
        for f in suite.iterdir()
        if not f.name.startswith("started-")
    }
    assert len(spans) == 10, spans

    solos = [n for n in spans if n.startswith("solo/solo")]
    assert len(solos) == 2, spans
    for name in solos:
        others = [n for n in spans if n != name and _overlap(spans[name], spans[n])]
        assert others == [], (name, others, spans)
    # (and the two suites' ordinary tests did overlap: the lock shares the room)
    assert any(
        _overlap(spans[a], spans[b])
        for a in spans
        if a.startswith("beside/")
        for b in spans
        if b.startswith("solo/ordinary")
    ), spans
