"""Pure parts of plain-script supervision: reading a failed worker's last words
(launcher/rootcause.py) and judging its heartbeats (launcher/watch.py, ScriptBeats)."""

from __future__ import annotations

import json
import os

from chameleon_runtime import scriptbeat as hb
from chameleon_runtime.protocol.messages import ScriptBeat
from launcher.rootcause import from_stderr, read_error_file
from launcher.supervisor import Cause, Failure, FailureKind
from launcher.watch import ScriptBeats, Timeouts

STACK = (
    "Traceback (most recent call last):\n"
    '  File "/x/errors/__init__.py", line 367, in wrapper\n'
    "    return f(*args, **kwargs)\n"
    '  File "/job/train.py", line 41, in step\n'
    "    raise ValueError('bad')\n"
    "ValueError: bad\n"
)


def _error_file(tmp_path, message):
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": message}))
    return path


def test_the_error_file_gives_message_innermost_frame_and_time(tmp_path):
    path = _error_file(
        tmp_path,
        {"message": "ValueError: bad", "extraInfo": {"py_callstack": STACK, "timestamp": "1"}},
    )
    report = read_error_file(path)
    assert report.message == "ValueError: bad" and report.where == "/job/train.py:41 in step"
    assert report.written_at == os.stat(path).st_mtime and report.error_type == "ValueError"
    assert not report.from_a_peer


def test_a_raw_message_a_torn_file_and_no_file(tmp_path):
    assert read_error_file(_error_file(tmp_path, "CUDA error: an illegal memory access")).message
    torn = tmp_path / "torn.json"
    torn.write_text('{"message": {"mess')
    assert read_error_file(torn) is None
    assert read_error_file(tmp_path / "missing.json") is None


def test_stderr_gives_the_last_traceback_of_a_chain():
    lines = [
        "warming up",
        *STACK.splitlines(),
        "",
        "During handling of the above exception, another exception occurred:",
        "Traceback (most recent call last):",
        '  File "/job/train.py", line 50, in <module>',
        "    main()",
        "    ^^^^^^",
        "RuntimeError: step failed",
        "some library's parting warning",
    ]
    report = from_stderr(lines, any_line=True)
    assert (
        report.message == "RuntimeError: step failed"
        and report.where == "/job/train.py:50 in <module>"
    )


def test_a_traceback_torch_prefixed_with_the_rank_is_read_as_any_other():
    # Once a default process group exists, torch.distributed's excepthook prefixes every
    # line; read raw, the script's exception was not found and it was recovered in place.
    lines = [
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "/job/train.py", line 138, in main',
        '[rank0]:     raise ValueError("x")',
        "[rank0]: ValueError: a bug at step 3",
    ]
    report = from_stderr(lines, any_line=True)
    assert report.message == "ValueError: a bug at step 3"
    assert report.where == "/job/train.py:138 in main"


def test_a_signal_death_does_not_take_a_stray_line_for_its_cause():
    assert from_stderr(["loading shards 3/8"], any_line=False) is None
    assert from_stderr(["loading shards 3/8"], any_line=True).message == "loading shards 3/8"


def test_a_broken_peer_is_infrastructure_not_user_code():
    gloo = from_stderr(
        ["Traceback (most recent call last):", '  File "/t.py", line 9, in <module>',
         "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"],
        any_line=True,
    )  # fmt: skip
    assert gloo.from_a_peer
    common = dict(rank=0, node=0, kind=FailureKind.EXIT, attempt=0, failed_at=0.0, detected_at=0.0)
    assert Failure(**common, peer_error=True).cause is Cause.INFRASTRUCTURE
    assert Failure(**common).cause is Cause.USER_CODE
    again = Failure.from_json(Failure(**common, where="t.py:9", peer_error=True).to_json())
    assert again.where == "t.py:9" and again.peer_error


def _beat(beats, **kw):  # worker pid 7's record
    return ScriptBeat(pid=7, beats=beats, **kw)


def test_heartbeats_that_stop_are_a_hang_after_the_timeout():
    watch = ScriptBeats(Timeouts(heartbeat_s=3.0, startup_s=600.0))
    assert watch.judge(0, 7, _beat(5, slowest_gap_s=0.02), now=100.0) is None
    assert watch.judge(0, 7, _beat(5, slowest_gap_s=0.02), now=102.9) is None
    why, since = watch.judge(0, 7, _beat(5, slowest_gap_s=0.02), now=103.1)
    assert "no heartbeat for 3.1 s" in why and since == 100.0
    assert watch.judge(0, 7, _beat(6, slowest_gap_s=0.02), now=103.2) is None  # it moved


def test_slow_healthy_steps_sections_and_the_first_step_get_longer():
    watch = ScriptBeats(Timeouts(heartbeat_s=3.0, startup_s=600.0))
    watch.judge(0, 7, _beat(9, slowest_gap_s=2.0), now=0.0)
    assert watch.judge(0, 7, _beat(9, slowest_gap_s=2.0), now=19.0) is None  # 10x its gaps
    assert watch.judge(0, 7, _beat(9, slowest_gap_s=2.0), now=20.0) is not None
    watch.judge(1, 7, _beat(3, section="checkpoint", timeout_s=60.0), now=0.0)
    assert watch.judge(1, 7, _beat(3, section="checkpoint", timeout_s=60.0), now=59.0) is None
    assert (
        "section 'checkpoint'"
        in watch.judge(1, 7, _beat(3, section="checkpoint", timeout_s=60.0), now=60.0)[0]
    )
    watch.judge(2, 7, _beat(1), now=0.0)  # one beat: its first full step is still to come
    assert watch.judge(2, 7, _beat(1), now=599.0) is None


def test_a_script_without_beats_or_another_process_is_not_judged():
    watch = ScriptBeats(Timeouts(heartbeat_s=3.0))
    assert watch.judge(0, 7, None, now=1e6) is None
    old = ScriptBeat(pid=8, beats=5, slowest_gap_s=0.1)
    watch.judge(0, 8, old, now=0.0)
    assert watch.judge(0, 8, old, now=100.0) is not None
    assert watch.judge(0, 9, old, now=200.0) is None  # a predecessor's record: not its own


def test_heartbeat_and_section_are_no_ops_outside_chameleon(tmp_path, monkeypatch):
    monkeypatch.delenv(hb.ENV, raising=False)
    monkeypatch.setattr(hb, "_writer", None)
    monkeypatch.chdir(tmp_path)
    hb.heartbeat()
    with hb.section("checkpoint", timeout=5):
        pass
    assert list(tmp_path.iterdir()) == []


def test_heartbeats_write_a_record_the_agent_reads(tmp_path, monkeypatch):
    path = tmp_path / "heartbeat"
    monkeypatch.setenv(hb.ENV, str(path))
    monkeypatch.setattr(hb, "_writer", None)
    hb.heartbeat()
    beat = ScriptBeat.decode(path.read_bytes())
    assert beat.pid == os.getpid() and beat.beats == 1 and beat.slowest_gap_s is None
    with hb.section("eval", timeout=30):
        inside = ScriptBeat.decode(path.read_bytes())
        assert inside.section == "eval" and inside.timeout_s == 30
    after = ScriptBeat.decode(path.read_bytes())
    assert after.section is None and after.beats == 3
    assert ScriptBeat.decode(b'{"pid": 1, "bea') is None  # torn: read again later
