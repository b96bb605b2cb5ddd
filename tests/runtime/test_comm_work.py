"""A collective's end as torch versions report it (chameleon_runtime.comm)."""

from chameleon_runtime.comm import Collective, _failed


class _Work:
    def __init__(self, exception):
        self._exception = exception

    def is_completed(self) -> bool:
        return True

    def exception(self):
        if self._exception is TypeError:
            # torch 2.11: a failed work's C++ exception cannot be handed to Python
            raise TypeError("Unregistered type : std::__exception_ptr::exception_ptr")
        return self._exception


def test_a_failed_collective_is_failed_whatever_torch_can_say_of_it():
    assert not _failed(_Work(None))
    assert _failed(_Work(RuntimeError("Connection closed by peer")))
    assert _failed(_Work(TypeError))


def test_a_group_with_a_failed_collective_is_not_settled():
    assert Collective(0, (0, 1), None, [_Work(None)]).settled
    assert not Collective(0, (0, 1), None, [_Work(None), _Work(TypeError)]).settled
