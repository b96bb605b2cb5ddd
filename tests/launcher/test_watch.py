"""Liveness apart from progress (launcher/watch.py), on statuses and a fake clock."""

from chameleon_runtime.protocol.messages import WaitingOn, WorkerStatus
from launcher.watch import Liveness, Progress, Timeouts, blame

T = Timeouts(heartbeat_s=3.0, step_s=None, startup_s=20.0)


def status(*, pid=100, beat=1, phase="train", step=5, progress=5, gen=0, waiting=None, slowest=0.5):
    return WorkerStatus(
        pid=pid, beat=beat, phase=phase, generation=gen, step=step, progress=progress,
        waiting_on=waiting, slowest_step_s=slowest,
    )  # fmt: skip


def test_a_slow_healthy_step_is_alive_while_its_heartbeat_moves():
    live = Liveness(T)
    for t in range(0, 40, 1):  # a 40 s step: the heartbeat thread beats every second
        assert live.judge(0, 100, 0.0, status(beat=t), float(t)) is None


def test_a_frozen_heartbeat_is_hung_after_the_heartbeat_timeout():
    live = Liveness(T)
    assert live.judge(0, 100, 0.0, status(beat=7), 10.0) is None
    assert live.judge(0, 100, 0.0, status(beat=7), 12.9) is None
    assert "no heartbeat for 3.0 s" in live.judge(0, 100, 0.0, status(beat=7), 13.0)


def test_a_replacement_is_judged_by_its_own_heartbeats_only():
    live = Liveness(T)
    old = status(pid=100, beat=50)  # the dead predecessor's last status stays in the store
    assert live.judge(3, 100, 0.0, old, 1.0) is None
    # The replacement (pid 200) imports torch for 15 s: its predecessor's frozen beat
    # must not count against it; only the startup timeout does.
    for t in (5.0, 10.0, 19.9):
        assert live.judge(3, 200, 4.0, old, t + 4.0) is None
    assert "startup timeout" in live.judge(3, 200, 4.0, old, 24.0)
    assert live.judge(3, 200, 4.0, status(pid=200, beat=1), 24.0) is None


def test_silence_this_agent_could_not_see_counts_from_when_it_sees_again():
    # The worker store moved at 13.0 (its leader's node cut off at 10.0): the beats the
    # agent could not read meanwhile are not the workers' silence.
    live = Liveness(T)
    assert live.judge(0, 100, 0.0, status(beat=7), 10.0) is None
    # The worker's own connection to the old store fails at its deadline (a heartbeat
    # timeout), up to one later than the agent moved: its silence counts from then.
    live.forgive(13.5)
    assert live.judge(0, 100, 0.0, None, 19.4) is None  # (not moved to the new store yet)
    assert "no heartbeat for 3.0 s" in live.judge(0, 100, 0.0, None, 19.5)
    live.forgive(20.0)
    assert live.judge(0, 100, 0.0, status(beat=7), 25.9) is None
    assert live.judge(0, 100, 0.0, status(beat=8), 26.0) is None  # it moved and beats
    assert "no heartbeat" in live.judge(0, 100, 0.0, status(beat=8), 29.0)


def test_the_step_timeout_is_ten_slowest_steps_and_never_under_a_minute():
    assert T.step_timeout(0.5) == 60.0
    assert T.step_timeout(35.0) == 350.0
    assert Timeouts(step_s=5.0).step_timeout(35.0) == 5.0


def test_progress_before_the_first_step_has_the_startup_timeout():
    p = Progress(T)
    first = {0: status(progress=0, step=0, phase="startup")}
    p.observe(first, 0.0)
    assert p.stalled(first, 19.0) == {}
    (stall,) = p.stalled(first, 20.0).values()
    assert stall.timeout_s == 20.0 and "startup" in stall.why


def test_a_stalled_rank_is_blamed_and_the_peers_waiting_on_it_are_not():
    p = Progress(T)
    statuses = {
        0: status(waiting=WaitingOn(what="recv", peers=[1])),  # pipeline peer of 1
        1: status(waiting=WaitingOn(what="compute")),  # stuck in its own layers
        2: status(waiting=WaitingOn(what="agree", name="commit/5")),  # at the commit
        3: status(waiting=WaitingOn(what="recv", peers=[2])),
    }
    p.observe(statuses, 0.0)
    assert p.stalled(statuses, 59.0) == {}
    stalls = p.stalled(statuses, 61.0)
    assert sorted(stalls) == [0, 1, 2, 3]
    verdict = blame(statuses, stalls)
    assert list(verdict) == [1]
    assert "in compute at step 5" in verdict[1] and "[0, 2, 3] wait on it" in verdict[1]


def test_peers_that_began_the_step_later_are_named_as_waiting_on_the_stalled_rank():
    # On a loaded host the peers reached the all-reduce after the stalled rank stopped:
    # past its timeout, not yet past theirs. They wait on it all the same (seen in CI:
    # "no progress for 12.3 s ... at step 0", with no peer named).
    p = Progress(T)
    stuck = {1: status(step=0, progress=0, waiting=WaitingOn(what="compute"))}
    p.observe(stuck, 0.0)
    peers = {r: status(step=0, progress=0, waiting=WaitingOn(what="allreduce", peers=[0, 1, 2, 3]))
             for r in (0, 2, 3)}  # fmt: skip
    p.observe(peers, 1.0)
    statuses = {**stuck, **peers}
    stalls = p.stalled(statuses, 20.5)
    assert sorted(stalls) == [1]
    verdict = blame(statuses, stalls)
    assert list(verdict) == [1] and "ranks [0, 2, 3] wait on it" in verdict[1]


def test_a_root_that_still_gets_somewhere_is_not_blamed():
    p = Progress(T)
    statuses = {
        0: status(waiting=WaitingOn(what="recv", peers=[1])),
        1: status(waiting=WaitingOn(what="compute")),
    }
    p.observe(statuses, 0.0)
    p.observe({1: status(progress=6, step=6, waiting=WaitingOn(what="compute"))}, 30.0)
    assert blame(statuses, p.stalled(statuses, 61.0)) == {}


def test_a_cycle_of_waits_blames_everyone_in_it():
    statuses = {
        0: status(waiting=WaitingOn(what="recv", peers=[1])),
        1: status(waiting=WaitingOn(what="recv", peers=[0])),
    }
    p = Progress(T)
    p.observe(statuses, 0.0)
    assert sorted(blame(statuses, p.stalled(statuses, 61.0))) == [0, 1]


def test_spares_recovering_and_finished_workers_are_not_judged_for_progress():
    p = Progress(T)
    statuses = {0: status(phase="spare"), 1: status(phase="ready"), 2: status(phase="done")}
    p.observe(statuses, 0.0)
    assert p.stalled(statuses, 1e6) == {}


def test_a_checkpoint_gets_the_startup_timeout():
    p = Progress(T)
    statuses = {0: status(phase="checkpoint", waiting=WaitingOn(what="checkpoint"))}
    p.observe(statuses, 0.0)
    assert p.stalled(statuses, 19.0) == {}
    assert p.stalled(statuses, 20.0)[0].timeout_s == 20.0
