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
