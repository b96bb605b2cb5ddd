"""A collective's end as torch versions report it (chameleon_runtime.comm)."""

from chameleon_runtime.comm import Collective, _failed


class _Work:
    def __init__(self, exception):
        self._exception = exception

    def is_completed(self) -> bool:
        return True

    def exception(self):  # what torch 2.11 does for a failed work: never called now
        raise TypeError("Unregistered type : std::__exception_ptr::exception_ptr")

    def wait(self) -> bool:
        if self._exception is not None:
            raise self._exception
        return True


def test_a_failed_collective_is_failed_without_asking_its_exception():
    assert not _failed(_Work(None))
    assert _failed(_Work(RuntimeError("Connection closed by peer")))


def test_a_group_with_a_failed_collective_is_not_settled():
    assert Collective(0, (0, 1), None, [_Work(None)]).settled
    assert not Collective(0, (0, 1), None, [_Work(None), _Work(RuntimeError("gone"))]).settled


def test_at_exit_only_a_live_generations_blocked_transfer_is_reported():
    # A drain of an abandoned generation (two peers each sending to the other when the
    # step was aborted) ends only with the process: expected, not reported; a transfer of
    # a live generation still blocked is (a peer stopped answering). The README demo once
    # ended a good run with "rank 3 ends with blocked waits: ['release of gen 0: ...']".
    import threading
    import time

    from chameleon_runtime.comm import _Helper, settle

    hold = threading.Event()
    drain, live = _Helper("drain"), _Helper("live")

    def draining() -> None:
        drain.releasing = True
        hold.wait()

    drain.submit(draining, "release of gen 0: 52907 with 7")
    live.submit(hold.wait, "allreduce with 3")
    time.sleep(0.05)
    started = time.monotonic()
    try:
        assert settle(timeout_s=0.5, release_s=0.1) == ["allreduce with 3"]
        assert time.monotonic() - started < 1.0  # one deadline, not one per helper
    finally:
        hold.set()
        drain.stop()
        live.stop()
