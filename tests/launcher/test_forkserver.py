"""The warm fork server (launcher/forkserver.py) as the launcher drives it: real forks of
a real server with torch imported, real pipes, real signals."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from launcher.forkserver import PRELOAD, eligible
from launcher.preload import modules_for
from launcher.warm import ForkServer
from tests.launcher.helpers import running

# real processes, seconds each: the full suite (CI) runs them, the fast tier does not
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("forkserver") / "server.log"
    # Without PYTHONUNBUFFERED, as most jobs run: C's stdio then buffers what it writes
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    fs = ForkServer(dict(env, OMP_NUM_THREADS="1"), log)
    assert fs.wait_ready(120), log.read_text() if log.exists() else "no log"
    yield fs
    fs.close()


def _spawn(server, tmp_path, source: str, *args: str, env: dict | None = None):
    script = tmp_path / "child.py"
    script.write_text(source)
    spawned = server.spawn(
        [sys.executable, "-u", str(script), *args], {**os.environ, **(env or {})}, str(tmp_path)
    )
    assert spawned is not None
    proc, out_fd, err_fd = spawned
    return proc, os.fdopen(out_fd, "rb"), os.fdopen(err_fd, "rb")


@pytest.mark.timeout(60)  # 2 s measured
def test_a_child_runs_the_script_with_its_argv_env_and_folder(server, tmp_path):
    proc, out, err = _spawn(
        server,
        tmp_path,
        "import os, sys, torch\n"
        "print(sys.argv[1:], os.environ['WHO'], os.getcwd(), __name__, sys.path[0],\n"
        "      torch.get_num_threads(), 'launcher' in sys.modules, os.getsid(0) == os.getpid())\n"
        "sys.exit(7)\n",
        "a",
        "b",
        env={"WHO": "rank-3", "OMP_NUM_THREADS": "1"},
    )
    assert proc.wait(timeout=30) == 7
    line = out.read().decode().strip()
    # its own session (the launcher signals the session), our modules not in its way
    assert line == f"['a', 'b'] rank-3 {tmp_path} __main__ {tmp_path} 1 False True"


@pytest.mark.timeout(60)  # 1 s measured
def test_an_exception_prints_its_traceback_and_exits_1(server, tmp_path):
    proc, out, err = _spawn(server, tmp_path, "def f():\n    raise KeyError('x')\nf()\n")
    assert proc.wait(timeout=30) == 1
    text = err.read().decode()
    assert "Traceback" in text and "KeyError: 'x'" in text and 'child.py", line 2, in f' in text
    # the script's frames only, as `python child.py` prints them: none of the server's
    frames = [line for line in text.splitlines() if line.lstrip().startswith("File ")]
    assert len(frames) == 2 and all("child.py" in f for f in frames), text


EXIT_AS_PYTHON = """\
import atexit, ctypes, sys, threading, time
log = open("left-open.txt", "w")  # never closed: Python's teardown would flush it
log.write("written, never flushed")
binary = open("left-open.bin", "wb")
binary.write(b"bytes")
def late():
    time.sleep(0.3)
    with open("thread.txt", "w") as f:
        f.write("the thread ended before the exit")
threading.Thread(target=late).start()  # not a daemon: joined before the exit
atexit.register(lambda: print("atexit ran", flush=True))
ctypes.CDLL(None).printf(b"from C, no newline")  # into a pipe: fully buffered
sys.exit(sys.argv[1] if not sys.argv[1].isdigit() else int(sys.argv[1]))
"""


@pytest.mark.parametrize(("argument", "code"), [("0", 0), ("3", 3), ("a message", 1)])
@pytest.mark.timeout(60)  # 1 s measured
def test_a_child_ends_as_python_ends(server, tmp_path, argument, code):
    # Without the interpreter's teardown (launcher/forkserver.py: _end), but with all
    # that comes before it: threads joined, atexit, every buffer written.
    proc, out, err = _spawn(server, tmp_path, EXIT_AS_PYTHON, argument)
    assert proc.wait(timeout=30) == code
    assert (tmp_path / "left-open.txt").read_text() == "written, never flushed"
    assert (tmp_path / "left-open.bin").read_bytes() == b"bytes"
    assert (tmp_path / "thread.txt").read_text() == "the thread ended before the exit"
    stdout = out.read().decode()
    assert "atexit ran" in stdout and "from C, no newline" in stdout
    assert err.read().decode().strip() == ("a message" if code == 1 else "")


@pytest.mark.timeout(60)  # 1 s measured
def test_a_child_interrupted_ends_by_the_signal(server, tmp_path):
    source = "import atexit\natexit.register(print, 'atexit ran')\nraise KeyboardInterrupt\n"
    proc, out, err = _spawn(server, tmp_path, source)
    assert proc.wait(timeout=30) == -signal.SIGINT
    assert out.read().decode().strip() == "atexit ran"
    assert "KeyboardInterrupt" in err.read().decode()


@pytest.mark.timeout(60)  # 3 s measured
def test_the_server_imports_what_the_script_imports(tmp_path):
    script = tmp_path / "train.py"
    (tmp_path / "mine.py").write_text("import sys\nsys.exit('a local module is never preloaded')\n")
    script.write_text(
        "import os, json\nimport rich.console\nimport mine\nfrom pydantic import BaseModel\n"
        "try:\n    import no_such_package_here\nexcept ImportError:\n    pass\n"
        "def f():\n    import networkx\n"
    )
    wanted = modules_for(str(script), "auto", module_mode=False)
    # not stdlib, local, missing, or lazy; a name imported from a module is loaded too
    assert wanted == [*PRELOAD, "rich.console", "pydantic", "pydantic:BaseModel"]
    assert modules_for(str(script), "none", module_mode=False) == list(PRELOAD)
    # a local module may import torch: torch is preloaded for it
    local = tmp_path / "local.py"
    local.write_text("import os\nimport mine\n")
    assert modules_for(str(local), "auto", module_mode=False) == list(PRELOAD)
    assert modules_for(str(script), "auto,psutil", module_mode=False)[len(PRELOAD)] == "psutil"
    fs = ForkServer(dict(os.environ), tmp_path / "server.log", wanted)
    assert fs.wait_ready(120)
    proc, out, _err = _spawn(
        fs,
        tmp_path,
        "import sys\nprint('rich.console' in sys.modules, 'networkx' in sys.modules)\n",
    )
    assert proc.wait(timeout=30) == 0
    assert out.read().decode().strip() == "True False"
    fs.close()


@pytest.mark.timeout(60)  # 0 s measured
def test_a_script_of_the_standard_library_alone_gets_a_server_that_imports_nothing(tmp_path):
    # its workers start at once instead of after torch's import (seconds); one that
    # imports torch only inside a function imports it itself, as a fresh interpreter does
    script = tmp_path / "plain.py"
    script.write_text("import os, sys, time\ndef f():\n    import torch\n")
    assert modules_for(str(script), "auto", module_mode=False) == []
    assert modules_for(str(script), "auto,rich", module_mode=False) == [*PRELOAD, "rich"]
    assert modules_for(str(script), "auto", module_mode=True) == list(PRELOAD)
    assert modules_for(str(tmp_path / "missing.py"), "auto", module_mode=False) == list(PRELOAD)


@pytest.mark.timeout(60)  # 0 s measured
def test_a_signal_is_reported_as_popen_does(server, tmp_path):
    proc, out, err = _spawn(
        server, tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(60)\n"
    )
    assert out.readline() == b"up\n"
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


@pytest.mark.timeout(60)  # 0 s measured
def test_only_plain_python_commands_are_forked():
    assert eligible([sys.executable, "-u", "train.py", "--lr", "1"])
    assert eligible([sys.executable, "-u", "-m", "pkg.train"])
    assert not eligible(["/usr/bin/env", "python", "train.py"])  # --no-python
    assert not eligible([sys.executable, "-X", "dev", "train.py"])  # a flag it cannot honour
    assert not eligible([])


@pytest.mark.timeout(60)  # 2 s measured
def test_children_die_with_the_server(tmp_path):
    fs = ForkServer(dict(os.environ), tmp_path / "server.log")
    assert fs.wait_ready(120)
    proc, out, _err = _spawn(fs, tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    assert out.readline() == b"up\n"
    os.kill(fs.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        # (an orphan's zombie is pytest's to reap: tests/conftest.py is its subreaper)
        if not running(proc.pid):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the child outlived its server")
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert fs.spawn([sys.executable, "-u", "x.py"], {}, None) is None  # gone: start fresh
    fs.close()


@pytest.mark.timeout(60)  # 3 s measured
def test_a_child_forked_after_its_spawn_gave_up_is_killed(server, tmp_path):
    # A server too slow to answer (stopped here; a loaded host in life): the launcher
    # starts that worker fresh instead, so the server's late child must not run beside it.
    ran = tmp_path / "ran"
    script = tmp_path / "late.py"
    script.write_text(f"import time\ntime.sleep(1)\nopen({str(ran)!r}, 'w').close()\n")
    exits = dict(server._exits)
    os.kill(server.pid, signal.SIGSTOP)
    try:
        late = server.spawn([sys.executable, "-u", str(script)], dict(os.environ), None, 0.3)
        assert late is None
    finally:
        os.kill(server.pid, signal.SIGCONT)
    # answered after the late one (the server takes requests in order): it was forked
    proc, out, _err = _spawn(server, tmp_path, "print('next')\n")
    assert proc.wait(timeout=30) == 0 and out.read() == b"next\n"
    time.sleep(2)  # past the second the late child would take to write
    assert not ran.exists()
    # and nothing of it kept: no exit code, no pid, no request
    assert (server._exits, server._abandoned, server._killed) == (exits, set(), set())


@pytest.mark.timeout(60)  # 1 s measured
def test_a_command_without_u_buffers_its_stdout_as_python_does(server, tmp_path):
    # A worker's command has -u; `python -m chameleon_cli` forked by the suite
    # (tests/prefork.py) has not, and a fresh interpreter's stdout to a pipe is buffered.
    import select

    script = tmp_path / "buffered.py"
    script.write_text(
        "import sys, time\nprint('out')\nprint('err', file=sys.stderr)\ntime.sleep(30)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc, out_fd, err_fd = server.spawn([sys.executable, str(script)], env, str(tmp_path))
    with os.fdopen(out_fd, "rb") as out, os.fdopen(err_fd, "rb") as err:
        assert select.select([err], [], [], 20)[0]  # stderr: by the line
        assert err.readline() == b"err\n"
        assert not select.select([out], [], [], 0.5)[0]  # stdout: held while it runs
        proc.send_signal(signal.SIGINT)  # ends as Python ends on one, its buffers written
        assert proc.wait(timeout=30) == -signal.SIGINT
        assert out.read() == b"out\n"
