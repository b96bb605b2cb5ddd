"""The recovery timeline, from an event log."""

from launcher.timeline import recoveries


def test_restart_recovery_is_measured_from_the_failure():
    events = [
        {"t": 100.0, "event": "start"},
        {
            "t": 105.1,
            "event": "failure",
            "rank": 2,
            "kind": "signal",
            "attempt": 0,
            "failed_at": 105.0,
            "detected_at": 105.1,
        },
        {
            "t": 105.3,
            "event": "failure",
            "rank": 0,
            "kind": "exit",
            "attempt": 0,
            "failed_at": 105.3,
            "detected_at": 105.3,
        },
        {
            "t": 105.4,
            "event": "decision",
            "attempt": 0,
            "action": "restart",
            "policy": "restart",
            "exit_code": 0,
        },
        {"t": 106.0, "event": "recovered", "attempt": 1, "policy": "restart", "resume_step": 10},
        {"t": 103.0, "event": "step", "attempt": 0, "step": 14},
        {"t": 109.0, "event": "step", "attempt": 1, "step": 10},
        {"t": 120.0, "event": "decision", "attempt": 1, "action": "finish", "exit_code": 0},
    ]
    (r,) = recoveries(events)
    assert r.rank == 2 and r.kind == "signal" and r.policy == "restart"
    assert round(r.detection_s, 3) == 0.1
    assert round(r.planning_s, 3) == 0.3
    assert round(r.recovery_s, 3) == 0.6
    assert round(r.to_first_step_s, 3) == 4.0
    assert r.steps_lost == 5 and r.outcome == "recovered"


def test_giving_up_is_a_row_too():
    events = [
        {
            "t": 1.0,
            "event": "failure",
            "rank": 0,
            "kind": "exit",
            "attempt": 0,
            "failed_at": 1.0,
            "detected_at": 1.0,
        },
        {"t": 1.1, "event": "decision", "attempt": 0, "action": "finish", "exit_code": 1},
    ]
    (r,) = recoveries(events)
    assert r.outcome == "gave up"


def test_a_straggler_and_its_recovery_are_one_row():
    from launcher.timeline import slowdowns

    rows = slowdowns(
        [
            {"t": 0.0, "event": "start"},
            {"t": 1.0, "event": "straggler", "rank": 2, "factor": 2.5, "step": 9},
            {"t": 2.0, "event": "straggler", "rank": 3, "factor": 1.8, "step": 15},
            {"t": 4.0, "event": "straggler_recovered", "rank": 2, "factor": 1.0, "step": 40,
             "worst_factor": 2.9},
        ]
    )  # fmt: skip
    assert [(r.rank, r.step, r.factor, r.back_at, r.back_step, r.worst) for r in rows] == [
        (2, 9, 2.5, 4.0, 40, 2.9),
        (3, 15, 1.8, None, None, None),
    ]
