"""The run summary as a user reads it (plain mode), from a recorded event log."""

import io

from chameleon_cli.output import Mode, Output
from chameleon_cli.run_view import outcome_blocks
from launcher.supervisor import Failure, FailureKind

CANDIDATES = {
    "reroute": {"feasible": True, "score": 400.0, "step_s": 0.09},
    "reparallelize": {"feasible": True, "score": 530.0, "step_s": 0.06},
    "restart": {"feasible": False, "score": None, "step_s": None},
}
EVENTS = [
    {"event": "start", "t": 100.0},
    {"event": "failure", "t": 107.9, "rank": 5, "failed_at": 107.8, "detected_at": 107.9,
     "kind": "signal", "attempt": 0, "exit_code": -9},
    {"event": "abort", "t": 107.9, "attempt": 0, "generation": 0, "ranks": [5], "last_step": 15},
    {"event": "decision", "t": 107.95, "attempt": 0, "generation": 1, "action": "recover",
     "policy": "reparallelize", "exit_code": 0},
    {"event": "plan_chosen", "t": 108.0, "generation": 1, "policy": "reparallelize",
     "label": "1x2 + 4x1 stages", "failed": [5], "estimated_step_s": 0.06,
     "failure_free_step_s": 0.0612, "transition_s": 0.33, "search_ms": 4.8,
     "candidates": CANDIDATES},
    {"event": "recovered", "t": 108.1, "generation": 1, "policy": "reparallelize",
     "resume_step": 16, "steps_lost": 0},
    {"event": "step", "t": 108.5, "step": 16, "generation": 1},
    {"event": "layout_hint", "t": 101.0, "launched_step_s": 0.1386, "best_step_s": 0.1024,
     "label": "8x1 stages", "pipelines": [[i] for i in range(8)]},
]  # fmt: skip


def test_the_summary_names_the_failure_the_plan_and_a_faster_layout():
    failure = Failure(
        rank=5, node=0, kind=FailureKind.SIGNAL, attempt=0, failed_at=107.8,
        detected_at=107.9, exit_code=-9,
    )  # fmt: skip
    out = io.StringIO()
    blocks = outcome_blocks(
        exit_code=0, reason="all workers finished", failures=[failure], events=EVENTS,
        run_dir="/tmp/run", events_path="/tmp/run/events.jsonl",
    )  # fmt: skip
    Output(Mode.PLAIN, stream=out).show(blocks)
    text = out.getvalue()
    assert "was killed by signal 9" in text and "+7.80 s" in text
    assert "reparallelize  1x2 + 4x1 stages" in text
    assert "102% of failure-free" in text  # 61.2 ms / 60 ms
    assert "400.0 / 530.0 / infeasible" in text
    assert "steps lost" in text and "recovered" in text
    assert "8x1 stages at 102.4 ms a step, 1.35x the launched layout (138.6 ms)" in text
