"""The leader's decision, as a pure function."""

from launcher.supervisor import Action, Failure, FailureKind, RoundView, decide, root_cause


def failure(rank, t, kind=FailureKind.EXIT, code=1, node=0):
    return Failure(
        rank=rank, node=node, kind=kind, attempt=0, failed_at=t, detected_at=t + 0.1, exit_code=code
    )


def view(**kw):
    base = dict(attempt=0, restarts_used=0, max_restarts=3, min_nodes=1, max_nodes=1, nodes=1)
    base.update(kw)
    return RoundView(**base)


def test_running_job_continues():
    assert decide(view()).action is Action.CONTINUE


def test_all_done_finishes_with_zero():
    d = decide(view(nodes=2, max_nodes=2, min_nodes=2, nodes_done=2))
    assert (d.action, d.exit_code) == (Action.FINISH, 0)


def test_failure_restarts_while_restarts_remain():
    d = decide(view(failures=(failure(1, 10.0),)))
    assert d.action is Action.RESTART and d.counts_as_restart
    assert "rank 1 exited with code 1" in d.reason and "restart 1 of 3" in d.reason


def test_a_spent_restart_budget_exits_93_do_not_requeue():
    d = decide(view(restarts_used=3, failures=(failure(2, 11.0, code=9), failure(1, 10.0, code=7))))
    assert (d.action, d.exit_code) == (Action.FINISH, 93)
    assert "rank 1 exited with code 7" in d.reason and "no restarts left" in d.reason


def test_with_no_restart_budget_the_root_cause_code_is_the_job_s():
    d = decide(view(max_restarts=0, failures=(failure(2, 11.0, code=9), failure(1, 10.0, code=7))))
    assert (d.action, d.exit_code) == (Action.FINISH, 7)


def test_the_same_failure_three_attempts_in_a_row_gives_up_before_the_budget():
    def bug(message="ValueError: a bug", where="train.py:12"):
        f = failure(1, 10.0)
        return Failure(**{**f.__dict__, "message": message, "where": where})

    same = bug().signature
    assert same is not None
    d = decide(
        view(max_restarts=9, restarts_used=2, earlier_causes=(same, same), failures=(bug(),))
    )
    assert (d.action, d.exit_code) == (Action.FINISH, 93)
    assert "the same failure ended the last 3 attempts" in d.reason
    # another failure in between, another message, or a kill: not a loop
    device = Failure(**{**bug().__dict__, "where": None, "message": "CUDA error: ECC"})
    assert device.signature is None  # a device's error: the next allocation may not have it
    for earlier, now in [
        ((same, None), bug()),
        ((same, same), bug("ValueError: another")),
        ((None, None), failure(1, 10.0, kind=FailureKind.SIGNAL, code=-9)),
        ((None, None), device),
    ]:
        d = decide(view(max_restarts=9, restarts_used=2, earlier_causes=earlier, failures=(now,)))
        assert d.action is Action.RESTART


def test_a_worker_s_own_75_or_93_is_not_passed_on_as_the_launcher_s():
    for code in (75, 93):
        assert decide(view(max_restarts=0, failures=(failure(0, 1.0, code=code),))).exit_code == 1


def test_signals_map_to_128_plus_signal():
    killed = failure(0, 1.0, kind=FailureKind.SIGNAL, code=-9)
    assert decide(view(max_restarts=0, failures=(killed,))).exit_code == 137


def test_lost_node_shrinks_within_min_max():
    lost = failure(2, 5.0, kind=FailureKind.NODE_LOST, code=None, node=1)
    d = decide(view(nodes=2, min_nodes=1, max_nodes=2, nodes_lost=1, failures=(lost,)))
    assert d.action is Action.RESTART and d.next_nodes == 1 and "shrink" in d.reason
    fixed = decide(view(nodes=2, min_nodes=2, max_nodes=2, nodes_lost=1, failures=(lost,)))
    assert fixed.action is Action.FINISH and fixed.exit_code == 3


def test_waiting_nodes_grow_the_job_without_counting_a_restart():
    d = decide(view(nodes=1, min_nodes=1, max_nodes=2, nodes_waiting=1))
    assert d.action is Action.RESTART and not d.counts_as_restart and d.next_nodes == 2


def test_stop_signal_wins():
    assert decide(view(stop_signal=2, failures=(failure(0, 1.0),))).exit_code == 130


def test_root_cause_is_the_earliest():
    early, late = failure(3, 1.0), failure(0, 2.0)
    assert root_cause([late, early]) is early
    assert early.cause.value == "user code"


def test_a_preempted_job_leaves_75_however_its_save_ends():
    saving = view(preempted="SIGUSR1")
    assert decide(saving).action is Action.CONTINUE  # the workers are saving
    done = decide(view(preempted="SIGUSR1", nodes_done=1))
    assert (done.action, done.exit_code) == (Action.FINISH, 75)
    assert done.reason == "preempted (SIGUSR1): the workers stopped"
    late = decide(view(preempted="SIGUSR1", preempt_overdue=True))
    assert late.exit_code == 75 and "end of the grace period" in late.reason
    # A kill during the save, after a kill whose in-place recovery it cut short: no
    # restart (the job is leaving), and the reason does not claim the earliest failure
    # happened while saving (it may predate the notice).
    kill = FailureKind.SIGNAL
    both = (failure(1, 10.0, kind=kill, code=-9), failure(0, 10.3, kind=kill, code=-9))
    cut = decide(view(preempted="SIGUSR1", failures=both, restarts_used=0))
    assert (cut.action, cut.exit_code) == (Action.FINISH, 75)
    assert cut.reason == (
        "preempted (SIGUSR1): the save did not finish on every node; "
        "the first failure: rank 1 was killed by signal 9"
    )
