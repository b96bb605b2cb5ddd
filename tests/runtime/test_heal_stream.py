"""A heal's stream (chameleon_runtime.heal), end to end in one process: what one side
sends, message by message, the other side rebuilds, whatever the chunk size."""

import pytest
import torch

from chameleon_runtime.heal import join_state, receive_state, send_state, split_state


def _roundtrip(header: dict, tensors: list[torch.Tensor], chunk: int):
    posted: list[torch.Tensor] = []
    delivered: list[torch.Tensor] = []

    def send(t: torch.Tensor) -> None:
        posted.append(t.clone())

    def flush() -> None:
        delivered.extend(posted)
        posted.clear()

    send_state(send, flush, header, tensors, chunk=chunk)
    assert not posted, "a send left unflushed at the end of the stream"
    messages = iter(delivered)

    def recv(buffer: torch.Tensor) -> torch.Tensor:
        return buffer.copy_(next(messages))

    got = receive_state(recv)
    assert next(messages, None) is None
    return got


@pytest.mark.parametrize("chunk", [64, 1000, 1 << 20])
def test_tensors_large_and_small_come_back_whole(chunk):
    tensors = [
        torch.randn(1000),
        torch.arange(10),
        torch.randn(30, 5).double().t(),  # not contiguous
        torch.zeros(0),
        torch.tensor(3.5),
        torch.randint(0, 255, (77,), dtype=torch.uint8),
    ]
    header, got = _roundtrip({"a": [1, 2]}, tensors, chunk)
    assert header == {"a": [1, 2]}
    for sent, back in zip(tensors, got, strict=True):
        assert back.dtype == sent.dtype and torch.equal(back, sent)


def test_a_state_dict_keeps_its_keys_tuples_and_tensors():
    state = {"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.ones(3)}},
             "param_groups": [{"betas": (0.9, 0.99), "lr": 1e-3, "params": [0]}]}  # fmt: skip
    tensors: list[torch.Tensor] = []
    skeleton = split_state(state, tensors)
    _, got = _roundtrip({"s": skeleton}, tensors, 8)
    back = join_state(skeleton, got)
    assert list(back["state"]) == [0] and back["param_groups"][0]["betas"] == (0.9, 0.99)
    assert torch.equal(back["state"][0]["exp_avg"], torch.ones(3))


def test_a_value_that_cannot_travel_is_named():
    with pytest.raises(
        TypeError, match=r"state\['fn'\] is a builtin_function_or_method, which cannot travel"
    ):
        split_state({"fn": print}, [])
