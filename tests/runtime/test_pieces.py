"""The runtime's parts without worker processes: data indexing, layer state round trips,
checkpoints, the step ledger, the pace of steps, and the all-or-none agreement."""

import json
import time

import pytest
import torch
from torch import nn

from chameleon_runtime import checkpoint
from chameleon_runtime.data import Batches
from chameleon_runtime.pace import Pace
from chameleon_runtime.shard import Shard
from chameleon_runtime.step import Ledger, ProtocolError
from planner.plans.plan import pipelines_plan
from planner.plans.program import worker_program


def factory(i: int) -> nn.Module:
    return nn.Linear(4, 4)


def adam(params):
    return torch.optim.Adam(params, lr=0.1)


def test_micro_batches_cover_the_global_batch_by_sample_index():
    data = [(torch.tensor([i]), torch.tensor([i])) for i in range(10)]
    b = Batches(data, global_batch_size=4, micro_batch_size=2)
    assert b.num_micro_batches == 2
    assert b.indices(0, 1) == [2, 3]
    assert b.indices(2, 1) == [0, 1]  # wraps around the dataset
    assert b.inputs(1, 0).tolist() == [[4], [5]]


def test_layers_are_built_identically_wherever_they_are_built():
    a, b = Shard(factory, adam, seed=3), Shard(factory, adam, seed=3)
    a.ensure(0, 2)
    b.ensure(1, 3)
    assert torch.equal(a.layers[1].weight, b.layers[1].weight)
    assert not torch.equal(a.layers[0].weight, a.layers[1].weight)


def test_layer_state_round_trips_through_header_and_tensors():
    src = Shard(factory, adam, seed=0)
    src.ensure(0, 1)
    src.layers[0](torch.randn(2, 4)).sum().backward()
    src.step()
    header, tensors = src.export_layer(0)
    json.dumps(header)  # travels through the store as JSON
    received = [t.clone() for t in tensors]
    dst = Shard(factory, adam, seed=99)
    dst.import_layer(header, received)
    assert torch.equal(dst.layers[0].weight, src.layers[0].weight)
    a, b = src.optimizer_state(0), dst.optimizer_state(0)
    assert torch.equal(a[0]["exp_avg"], b[0]["exp_avg"]) and torch.equal(a[0]["step"], b[0]["step"])
    shapes = [t.shape for t in Shard.empty_tensors(header)]
    assert shapes == [t.shape for t in tensors]


def test_checkpoints_are_complete_or_absent(tmp_path):
    shard = Shard(factory, adam, seed=0)
    shard.ensure(0, 2)
    checkpoint.save_layers(tmp_path, 5, shard, [0, 1])
    assert checkpoint.latest(tmp_path) is None  # files written, step not published yet
    checkpoint.publish(tmp_path, 5, 2)
    assert checkpoint.latest(tmp_path) == 5
    other = Shard(factory, adam, seed=1)
    other.ensure(0, 2)
    checkpoint.load_layers(tmp_path, 5, other, [0, 1])
    assert torch.equal(other.layers[1].bias, shard.layers[1].bias)
    for step in (8, 11):
        checkpoint.save_layers(tmp_path, step, shard, [0, 1])
        checkpoint.publish(tmp_path, step, 2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000008", "step_000011"]
    assert not list(tmp_path.glob("**/*.tmp*"))
    # a late publish of an older step (a fenced node's, after a heal) moves nothing back
    checkpoint.publish(tmp_path, 8, 2)
    assert checkpoint.latest(tmp_path) == 11


def _plan():
    return pipelines_plan(
        num_layers=4,
        num_micro_batches=4,
        pipelines=[[0, 1], [2, 3]],
        boundaries=[[0, 2, 4]] * 2,
        micro_batch_counts=[2, 2],
    )


def test_the_ledger_lists_every_message_of_a_step_both_ways_in_program_order():
    plan = _plan()
    shard = Shard(factory, adam, seed=0)
    shard.ensure(2, 4)
    part = worker_program(plan, 1, [20, 20, 20, 20], allreduce="exchange")
    shapes = [(torch.Size([2, 4]), torch.float32)] * 4
    ledger = Ledger(part, shapes, shard)
    # Worker 1 (stage 1 of pipeline 0, micro-batches 0 and 1) receives 2 activations from
    # worker 0, sends it 2 gradients, and swaps its bucket's sums with worker 3 (the
    # other holder of layers 2-3).
    bucket = part.buckets[0].index
    listed = {p: [(m.kind, m.index, shape) for m, shape in q] for p, q in ledger.owed.items()}
    n = sum(p.numel() for p in shard.params(2, 4))
    assert listed == {
        0: [("F", 0, shapes[1]), ("F", 1, shapes[1])],
        3: [("X", bucket, (torch.Size([n]), torch.float64))],
    }
    listed = {p: [(m.kind, m.index) for m, _ in q] for p, q in ledger.owes.items()}
    assert listed == {0: [("B", 0), ("B", 1)], 3: [("X", bucket)]}
    # A ring program sums the bucket with a collective of its own group, no message; its
    # commit goes through the tree 0 -> (1, 2), 1 -> 3: 1 hears 3's vote, sends its own
    # to 0 and hears the decision back.
    ring = Ledger(worker_program(plan, 1, [20, 20, 20, 20]), shapes, shard)
    assert {p: [(m.kind, m.index) for m, _ in q] for p, q in ring.owed.items()} == {
        0: [("F", 0), ("F", 1), ("D", 0)],
        3: [("U", 0)],
    }
    assert {p: [(m.kind, m.index) for m, _ in q] for p, q in ring.owes.items()} == {
        0: [("B", 0), ("B", 1), ("U", 0)],
        3: [("D", 0)],
    }


class _Recorder:
    """Stands in for a Generation's transfers: records what is posted, in order."""

    def __init__(self):
        self.posted = []

    def send(self, tensor, peer, **_kwargs):
        self.posted.append(("send", peer))

    def drain(self, sends, recvs):
        self.posted.append(("drain", [p for p, *_ in sends], [p for p, *_ in recvs]))


def test_a_message_out_of_program_order_is_refused_and_the_drain_keeps_the_order():
    plan = _plan()
    shard = Shard(factory, adam, seed=0)
    shard.ensure(0, 2)
    # exact: sends F0, F1 to 1; receives B0, B1; swaps its bucket's sums with 2
    part = worker_program(plan, 0, [20, 20, 20, 20], allreduce="exchange")
    ledger = Ledger(part, [(torch.Size([2, 4]), torch.float32)] * 4, shard)
    gen = _Recorder()
    with pytest.raises(ProtocolError, match="F1"):
        ledger.send(gen, torch.zeros(2, 4), 1, "F", 1)  # F0 comes first
    ledger.send(gen, torch.zeros(2, 4), 1, "F", 0)
    assert [(m.kind, m.index) for m, _ in ledger.owes[1]] == [("F", 1)]
    ledger.drain(gen)
    # What is left, each way: F1 to worker 1; B0, B1 from it; the bucket's swap with 2.
    assert gen.posted == [("send", 1), ("drain", [1, 2], [1, 1, 2])]
    assert not ledger.owes and not ledger.owed


def test_pace_leaves_out_warm_up_and_starts_again_with_each_generation():
    pace = Pace()
    for s in (1.0, 1.0, 0.1, 0.3):  # the first two are warm-up
        pace.add(0, s, 2 * s, s / 2)
    assert pace.means() == pytest.approx(
        {
            "mean_step_s": 0.2, "mean_cpu_s": 0.4, "mean_compute_cpu_s": 0.1,
            "mean_pass_cpu_s": 0.0, "pace_steps": 2,
        }
    )  # fmt: skip
    pace.add(1, 5.0, 5.0, 1.0)
    assert pace.means() == {"pace_steps": 0}  # (a new generation: not warm yet)


def test_an_agreement_holds_for_all_or_for_none_and_an_abort_ends_the_wait():
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from chameleon_runtime.control import Control
    from chameleon_runtime.protocol.messages import Abort
    from tests.launcher.helpers import free_port

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    control = Control("127.0.0.1", port, 0)
    keys = control.keys

    def abort(generation):
        master.queue_push(keys.mailbox(0), Abort(generation=generation).model_dump_json())

    def in_background(generation, name):
        outcome = []
        thread = threading.Thread(
            target=lambda: outcome.append(control.agree(generation, name, 2).held)
        )
        thread.start()
        deadline = time.monotonic() + 10
        while master.add(keys.agreement(generation, name), 0) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        return thread, outcome

    try:
        # An abort while waiting for the other member: the wait ends at once, not held...
        thread, outcome = in_background(0, "commit/7")
        abort(0)
        thread.join(timeout=5)
        assert outcome == [False]
        # ...and the other member, arriving now, completes the count but its "yes" is
        # not the write: it reads "no" too (chameleon_runtime.control.poison).
        assert master.add(keys.agreement(0, "commit/7"), 1) == 2
        assert master.compare_set(keys.agreement_done(0, "commit/7"), "", "yes") == b"no"
        # The other member arrives last, and an abort comes before it writes the result:
        # the poison's "no" is the write, so the step is dropped there as it is here.
        thread, outcome = in_background(1, "commit/8")
        assert master.add(keys.agreement(1, "commit/8"), 1) == 2
        abort(1)
        thread.join(timeout=5)
        assert outcome == [False]
        assert master.compare_set(keys.agreement_done(1, "commit/8"), "", "yes") == b"no"
        # The other member's "yes" comes first: held, for both.
        thread, outcome = in_background(2, "commit/9")
        assert master.add(keys.agreement(2, "commit/9"), 1) == 2
        assert master.compare_set(keys.agreement_done(2, "commit/9"), "", "yes") == b"yes"
        thread.join(timeout=5)
        assert outcome == [True]
        abort(2)  # (a late abort changes nothing)
        # A member arriving after the abort is already known: not held, no waiting.
        assert control.interrupts.aborted(1)
        assert not control.agree(1, "commit/10", 2).held
    finally:
        control.close()


def test_a_settled_generation_wakes_only_a_spares_wait():
    # chameleon_runtime.liveness.Interrupts: ``Settled`` (a plan every member applied) wakes
    # the wait of a spare keeping a reserve, and no other: a step's wait woken by it would
    # read as an abort of a generation that is running.
    import threading

    from chameleon_runtime.liveness import Interrupts

    interrupts = Interrupts()
    spare, step = threading.Event(), threading.Event()
    with interrupts.watch(3, spare, settled=True), interrupts.watch(3, step):
        interrupts._settle(3)
        assert spare.is_set() and not step.is_set()
        assert interrupts.settled_upto == 3 and not interrupts.aborted(3)
        interrupts._abort(3)
        assert step.is_set()
    late = threading.Event()
    with interrupts.watch(4, late, settled=True):
        interrupts._settle(2)  # (an older one, late: it lowers nothing)
        assert interrupts.settled_upto == 3 and late.is_set()
