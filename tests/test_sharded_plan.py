"""The planner's choice for a sharded drop-in job (HSDP: planner.choice.selection.
sharded_options): a replica group computes only whole."""

from __future__ import annotations

import itertools
import random

from chameleon_runtime.protocol.wire import JobDescription
from planner.choice.policy import Policy
from planner.choice.selection import decide
from planner.choice.sharded import broken_groups, groups_of
from planner.job.costtable import LayerCost
from planner.plans.plan import data_parallel, turn_counts


def job(workers: int, shards: int, micro_batches: int):
    description = JobDescription(
        model="DataParallel",
        layers=[
            LayerCost(
                name="model",
                num_params=10_000,
                forward_s=0.01,
                backward_s=0.02,
                optimizer_s=0.0,
                activation_bytes=0,
                stash_bytes=0,
            )  # fmt: skip
        ],
        global_batch_size=2 * micro_batches,
        micro_batch_size=2,
        param_bytes=4,
        grad_bytes=4,
        optimizer_bytes=8,
        dp=workers,
        pp=1,
        memory_limit_bytes=1 << 30,
        link_bandwidth_bytes_per_s=1e9,
        link_latency_s=1e-4,
        checkpoint_interval_steps=1,
        shards=shards,
    )
    return description.to_job(
        num_nodes=1, workers_per_node=workers, mtbf_s=3600, step_s=0.1, restart_s=10
    )


def candidates(
    workers: int, shards: int, micro_batches: int, failed: list[int], *, held=None, idle=()
):
    plan = data_parallel(list(range(workers)) if held is None else held, micro_batches)
    decision = decide(job(workers, shards, micro_batches), plan, failed, idle=list(idle))
    return {c.policy: c for c in decision.candidates}


def test_broken_groups_are_whole():
    assert broken_groups([0, 1, 2, 3, 4, 5], 2, [3]) == [2, 3]
    assert broken_groups([2, 3, 6, 7], 2, [7, 2]) == [2, 3, 6, 7]
    assert broken_groups([0, 1, 2, 3], 1, [1]) == [1]
    assert groups_of([5, 0, 1], 2) == [(0, 1), (4, 5)]


def test_a_lost_member_drops_its_whole_group():
    c = candidates(4, 2, 8, [1])
    reroute = c[Policy.REROUTE]
    assert reroute.feasible
    assert reroute.plan.workers == (2, 3)
    assert reroute.label == "drop 1 replica group(s) of [0, 1]"
    assert reroute.plan.load() == {2: 4, 3: 4}  # the whole step, on the group left
    # nothing to take back; re-sharded instead: rank 0 alone holds the whole model, the
    # rows of rank 1's shard from rank 3 (its column), and runs turns of one
    reshard = c[Policy.REPARALLELIZE]
    assert reshard.feasible, reshard.reason
    assert reshard.label == "re-shard replica group(s) [[0]] over their survivors"
    assert reshard.plan.replica_groups == ((0,), (2, 3))
    assert reshard.plan.load() == {0: 2, 2: 3, 3: 3}  # 2 turns of 1 and 3 of 2: 8
    assert [(t.src, t.dst) for t in reshard.migration.transfers] == [(3, 0)]
    assert reshard.migration.reshard_from == ((0, 1), (2, 3))
    # its state doubled (16 bytes a parameter, 10,000 parameters: 80 kB a shard)
    assert reshard.estimate.memory_bytes[0] - reshard.estimate.memory_bytes[2] == 80_000


def test_a_re_shard_over_more_survivors_takes_rows_from_mates_and_the_column():
    # 3 groups of 3, rank 1 lost: ranks 0 and 2 cut the rows in halves; what each
    # lacks was rank 1's (the middle third), from the same shard of a whole group, one
    # group per receiver (rank 4 of the first, rank 7 of the second), in one round
    c = candidates(9, 3, 12, [1])
    reshard = c[Policy.REPARALLELIZE]
    assert reshard.plan.replica_groups == ((0, 2), (3, 4, 5), (6, 7, 8))
    pairs = {(t.src, t.dst) for t in reshard.migration.transfers}
    assert pairs == {(4, 0), (7, 2)}
    assert reshard.migration.rounds == (0, 0)
    # a member sends or receives once a round
    by_round: dict[int, list] = {}
    for t, r in zip(reshard.migration.transfers, reshard.migration.rounds, strict=True):
        by_round.setdefault(r, []).extend([t.src, t.dst])
    assert all(len(v) == len(set(v)) for v in by_round.values())


def test_two_broken_groups_are_re_sharded_from_each_other():
    # ranks 0 and 3 lost: no group is whole, nothing to drop to; each survivor takes the
    # whole model, the half it lacks from the other
    c = candidates(4, 2, 8, [0, 3])
    assert not c[Policy.REROUTE].feasible
    reshard = c[Policy.REPARALLELIZE]
    assert reshard.feasible, reshard.reason
    assert {(t.src, t.dst) for t in reshard.migration.transfers} == {(1, 2), (2, 1)}


def test_groups_left_take_the_step_in_turns():
    # 6 workers in 3 groups of 2, 6 micro-batches (3 turns of 2): rank 5 lost, the two
    # groups left take 2 turns and 1, every member of a group as many
    reroute = candidates(6, 2, 6, [5])[Policy.REROUTE]
    assert reroute.feasible
    assert reroute.plan.load() == {0: 2, 1: 2, 2: 1, 3: 1}
    # 7 micro-batches are not whole turns: a member would run one more than its mate
    reroute = candidates(6, 2, 7, [5])[Policy.REROUTE]
    assert not reroute.feasible
    assert "are not whole turns of the 2 members" in reroute.reason


def test_every_group_hit_leaves_nothing_to_reroute():
    reroute = candidates(4, 2, 8, [0, 3])[Policy.REROUTE]
    assert not reroute.feasible
    assert reroute.reason == "no whole replica group is left"


def test_an_unsharded_job_loses_only_the_failed_worker():
    reroute = candidates(4, 1, 8, [1])[Policy.REROUTE]
    assert reroute.plan.workers == (0, 2, 3)


def test_a_dropped_group_comes_back_healed_from_its_columns():
    # group (0, 1) was dropped; rank 0 waited idle, rank 1's replacement joined
    c = candidates(4, 2, 8, [], held=[2, 3], idle=[0, 1])
    back = c[Policy.REPARALLELIZE]
    assert back.feasible, back.reason
    assert back.plan.workers == (0, 1, 2, 3)
    # each member from its column's live holder, both in the first round
    assert [(t.src, t.dst) for t in back.migration.transfers] == [(2, 0), (3, 1)]
    assert back.migration.rounds == (0, 0)
    assert back.label == "take back replica group(s) [[0, 1]], healed shard by shard"


def test_a_group_with_a_member_missing_is_not_taken_back():
    back = candidates(4, 2, 8, [], held=[2, 3], idle=[0])[Policy.REPARALLELIZE]
    assert not back.feasible


def test_a_failure_can_swap_in_a_whole_idle_group():
    # (0, 1) idle and whole; rank 3 fails: (2, 3) is dropped, (0, 1) taken back from
    # (4, 5)'s columns
    c = candidates(6, 2, 12, [3], held=[2, 3, 4, 5], idle=[0, 1])
    assert c[Policy.REROUTE].plan.workers == (4, 5)
    swap = c[Policy.REPARALLELIZE]
    assert swap.plan.workers == (0, 1, 4, 5)
    assert [(t.src, t.dst) for t in swap.migration.transfers] == [(4, 0), (5, 1)]


def test_a_shard_with_no_live_copy_says_only_a_checkpoint_has_it():
    # ranks 1 and 3 hold shard 1 in both groups
    c = candidates(4, 2, 8, [1, 3])
    for policy in (Policy.REROUTE, Policy.REPARALLELIZE):
        assert not c[policy].feasible
        assert c[policy].reason.startswith("shard(s) [1] of the model have no live copy")
    assert c[Policy.RESTART].feasible


def _fewest_turns(m: int, sizes: list[int]) -> int | None:
    """By enumeration: the fewest turns of the busiest group over every deal of turns (one
    at least each) that covers ``m`` micro-batches exactly."""
    best = None
    for counts in itertools.product(range(1, m + 1), repeat=len(sizes)):
        if sum(c * s for c, s in zip(counts, sizes, strict=True)) == m:
            best = max(counts) if best is None else min(best, max(counts))
    return best


def test_turn_counts_are_the_fewest_that_cover_the_step_exactly():
    rng = random.Random(0)
    for _ in range(300):
        sizes = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
        m = rng.randint(1, 14)
        counts = turn_counts(m, sizes)
        fewest = _fewest_turns(m, sizes)
        if fewest is None:
            assert counts is None, (m, sizes)
            continue
        assert counts is not None, (m, sizes)
        assert sum(c * s for c, s in zip(counts, sizes, strict=True)) == m
        assert min(counts) >= 1 and max(counts) == fewest, (m, sizes, counts)


def test_turn_counts_for_a_thousand_workers():
    # 16 groups of 64 with one member short: no deal covers 1,024 micro-batches (a scan
    # over every turn count took 4.6 s for this one and made a 1,024-GPU decision take 5)
    assert turn_counts(1024, [64] * 15 + [63]) is None
    assert turn_counts(1024, [8] * 127 + [7]) is None
    counts = turn_counts(4096, [64] * 63 + [32])
    assert counts is not None and sum(c * s for c, s in zip(counts, [64] * 63 + [32])) == 4096
