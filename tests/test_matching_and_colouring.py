"""Weight migration: matching against brute force, balanced sources, colouring rounds."""

import itertools
import random

import pytest

from planner.job.cost import CostModel
from planner.plans.colouring import Task, colour_rounds, rounds_time_s
from planner.plans.matching import (
    LostLayers,
    assign_slots,
    choose_sources,
    every_layer_held,
    hungarian,
    missing_bytes,
)
from planner.plans.migration import fit_transfer_wait, plan_migration, ring, transfer_s
from planner.plans.plan import pipelines_plan
from tests.synthetic import uniform_job


def test_hungarian_matches_brute_force():
    rng = random.Random(0)
    for _ in range(2000):
        rows, cols = rng.randint(1, 6), 0
        cols = rng.randint(rows, 7)
        cost = [
            [rng.choice([0, 1, 2, 5, 10, rng.random()]) for _ in range(cols)] for _ in range(rows)
        ]
        got = hungarian(cost)
        assert len(set(got)) == rows
        best = min(
            sum(cost[i][p[i]] for i in range(rows))
            for p in itertools.permutations(range(cols), rows)
        )
        assert sum(cost[i][got[i]] for i in range(rows)) == pytest.approx(best)


def test_assignment_minimises_bytes_received():
    rng = random.Random(1)
    job = uniform_job(dp=2, pp=4, num_layers=12)
    costs = CostModel(job)
    for _ in range(80):
        workers = list(range(7))
        holdings = {}
        for w in rng.sample(workers, rng.randint(3, 7)):
            a = rng.randint(0, 11)
            holdings[w] = (a, rng.randint(a + 1, 12))
        lengths = rng.choice([[3], [4], [2, 2], [3, 2], [2, 2, 2]])
        new = []
        for n in lengths:
            cuts = sorted(rng.sample(range(1, 12), n - 1))
            bounds = [0, *cuts, 12]
            new.append(list(zip(bounds, bounds[1:])))
        placed = assign_slots(
            costs, holdings=holdings, old_pipelines=[], new_pipelines=new, workers=workers
        )
        flat_slots = [s for p in new for s in p]
        flat_workers = [w for p in placed for w in p]
        assert len(set(flat_workers)) == len(flat_workers) == len(flat_slots)
        got = sum(
            missing_bytes(costs, holdings.get(w), s) for w, s in zip(flat_workers, flat_slots)
        )
        best = min(
            sum(missing_bytes(costs, holdings.get(w), s) for w, s in zip(perm, flat_slots))
            for perm in itertools.permutations(workers, len(flat_slots))
        )
        assert got == best


def test_whole_surviving_pipelines_stay_where_they_are():
    job = uniform_job(dp=3, pp=2, num_layers=4)
    costs = CostModel(job)
    holdings = {0: (0, 2), 1: (2, 4), 2: (0, 2), 3: (2, 4), 4: (0, 2), 5: (2, 4)}
    placed = assign_slots(
        costs,
        holdings=holdings,
        old_pipelines=[(0, 1), (2, 3), (4, 5)],
        new_pipelines=[[(0, 2), (2, 4)], [(0, 2), (2, 4)]],
        workers=[0, 1, 2, 3, 4, 5],
    )
    assert placed == [[0, 1], [2, 3]]


def test_sources_are_balanced_and_never_slower_than_first_holder():
    # dp=4 pipelines of 4 stages re-split into 3 pipelines of 5: everyone needs layers.
    job = uniform_job(dp=4, pp=4, num_layers=20, per_node=4)
    costs = CostModel(job)
    holdings = {w: ((w % 4) * 5, (w % 4) * 5 + 5) for w in range(16) if w not in (0, 1, 2, 3)}
    targets = {w: ((i % 5) * 4, (i % 5) * 4 + 4) for i, w in enumerate(sorted(holdings)[:15])}
    balanced = choose_sources(costs, holdings=holdings, targets=targets)
    naive = choose_sources(costs, holdings=holdings, targets=targets, balanced=False)

    def busiest(transfers):
        load = {}
        for t in transfers:
            load[t.src] = load.get(t.src, 0) + t.num_bytes
        return max(load.values())

    assert sum(t.num_bytes for t in balanced) == sum(t.num_bytes for t in naive)
    assert busiest(balanced) < busiest(naive)


def test_each_piece_comes_from_the_least_loaded_holder_counting_its_link():
    # The rule choose_sources keeps with a heap per piece: every transfer's source is the
    # holder with the least (sent so far + this transfer over its link to dst, id),
    # largest pieces first. Checked transfer by transfer against a scan of every holder,
    # on nodes of several workers with a near link and a far one.
    from planner.job.workload import Link

    rng = random.Random(4)
    job = uniform_job(
        dp=6, pp=4, num_layers=24, per_node=4,
        intra=Link(bandwidth_bytes_per_s=1e11, latency_s=1e-6),
        inter=Link(bandwidth_bytes_per_s=1e9, latency_s=1e-5),
    )  # fmt: skip
    costs = CostModel(job)
    for _ in range(200):
        alive = rng.sample(range(24), rng.randint(6, 24))
        holdings = {w: (s := rng.randrange(24), rng.randrange(s + 1, 25)) for w in alive}
        holdings[alive[0]] = (0, 24)
        targets = {w: (s := rng.randrange(24), rng.randrange(s + 1, 25)) for w in range(24)}
        sent = dict.fromkeys(holdings, 0.0)
        out = choose_sources(costs, holdings=holdings, targets=targets)
        # (returned in the order of their destinations; chosen largest first)
        for k in sorted(range(len(out)), key=lambda k: (-out[k].num_bytes, k)):
            t = out[k]
            holders = [
                w for w, (a, b) in holdings.items() if a <= t.first_layer and t.end_layer <= b
            ]
            best = min(
                holders, key=lambda w: (sent[w] + costs.transfer_s(w, t.dst, t.num_bytes), w)
            )
            assert t.src == best
            sent[t.src] += costs.transfer_s(t.src, t.dst, t.num_bytes)


def test_layers_nobody_holds_cannot_migrate():
    job = uniform_job(dp=1, pp=2, num_layers=4)
    with pytest.raises(LostLayers, match="lost every replica"):
        choose_sources(CostModel(job), holdings={1: (2, 4)}, targets={1: (0, 4)})


def test_whether_layers_can_move_is_known_before_any_target_is_placed():
    """every_layer_held says, from the holdings alone, whether choose_sources serves a
    target covering the model: random holdings against random targets."""
    job = uniform_job(dp=2, pp=4, num_layers=8)
    costs = CostModel(job)
    rng = random.Random(4)
    outcomes = set()
    for _ in range(3000):
        holdings = {}
        for w in rng.sample(range(8), rng.randint(1, 8)):
            first = rng.randrange(8)
            holdings[w] = (first, rng.randint(first + 1, 8))
        cuts = sorted(rng.sample(range(1, 8), rng.randint(0, 4)))
        bounds = [0, *cuts, 8]
        workers = rng.sample(range(10), len(bounds) - 1)
        targets = dict(zip(workers, zip(bounds, bounds[1:], strict=False), strict=True))
        try:
            choose_sources(costs, holdings=holdings, targets=targets)
            served = True
        except LostLayers:
            served = False
        assert every_layer_held(holdings, 8) == served, (holdings, targets)
        outcomes.add(served)
    assert outcomes == {True, False}


def test_colouring_rounds_never_share_a_worker():
    rng = random.Random(2)
    for _ in range(200):
        tasks = [
            Task(tuple(rng.sample(range(10), 2)), rng.uniform(0.1, 3))
            for _ in range(rng.randint(1, 25))
        ]
        rounds = colour_rounds(tasks)
        for r in set(rounds):
            members = [w for t, x in zip(tasks, rounds) if x == r for w in t.participants]
            assert len(members) == len(set(members))
        assert rounds_time_s(tasks, rounds) <= sum(t.duration_s for t in tasks) + 1e-12


def test_colouring_is_networkx_greedy_colouring_in_duration_order():
    import networkx as nx

    rng = random.Random(3)
    for _ in range(200):
        tasks = [
            Task(tuple(rng.sample(range(12), rng.randint(1, 5))), rng.choice([0.5, 1.0, 2.0]))
            for _ in range(rng.randint(1, 30))
        ]
        graph = nx.Graph()
        graph.add_nodes_from(range(len(tasks)))
        graph.add_edges_from(
            (a, b)
            for a in range(len(tasks))
            for b in range(a + 1, len(tasks))
            if set(tasks[a].participants) & set(tasks[b].participants)
        )
        order = sorted(range(len(tasks)), key=lambda i: (-tasks[i].duration_s, i))
        colours = nx.coloring.greedy_color(graph, strategy=lambda _g, _c, o=order: iter(o))
        assert colour_rounds(tasks) == [colours[i] for i in range(len(tasks))]


def test_migration_schedule_beats_naive_on_a_reshaped_plan():
    job = uniform_job(
        dp=4,
        pp=4,
        num_layers=20,
        per_node=4,
        inter=__import__("planner.job.workload", fromlist=["Link"]).Link(1e9, 1e-4),
        intra=__import__("planner.job.workload", fromlist=["Link"]).Link(1e10, 1e-5),
    )
    costs = CostModel(job)
    holdings = {w: ((w % 4) * 5, (w % 4) * 5 + 5) for w in range(4, 16)}
    target = pipelines_plan(
        num_layers=20,
        num_micro_batches=12,
        pipelines=[[4, 5, 6], [8, 9, 10], [12, 13, 14], [7, 11, 15]],
        boundaries=[[0, 7, 14, 20]] * 4,
        micro_batch_counts=[3, 3, 3, 3],
    )
    migration = plan_migration(costs, holdings=holdings, target=target)
    assert migration.num_bytes > 0
    assert migration.est_time_s < migration.naive_est_time_s
    assert len(set(migration.rounds)) < len(migration.transfers)  # side by side


def test_on_shared_cores_a_migration_goes_one_transfer_at_a_time_when_that_is_faster():
    from dataclasses import replace

    from planner.job.workload import Link
    from planner.plans.load import waiting

    job = uniform_job(dp=4, pp=4, num_layers=20, per_node=16, intra=Link(1e10, 1e-5))
    holdings = {w: ((w % 4) * 5, (w % 4) * 5 + 5) for w in range(4, 16)}
    target = pipelines_plan(
        num_layers=20, num_micro_batches=12,
        pipelines=[[4, 5, 6], [8, 9, 10], [12, 13, 14], [7, 11, 15]],
        boundaries=[[0, 7, 14, 20]] * 4, micro_batch_counts=[3, 3, 3, 3],
    )  # fmt: skip
    # Packing costs CPU that the transfers of a round share 2 cores for, and a woken
    # receiver waits longer the more processes run (planner.plans.load): rounds lose.
    shared = replace(
        job,
        cluster=replace(
            job.cluster, host_cores=2.0, nodes_per_host=1, pack_cpu_s_per_param=1e-6,
            fitted_workers=16, message_wait_s=0.005,
        ),
    )  # fmt: skip
    shared = waiting(shared, 0.005)  # the fitted wait rides on the links' latency
    migration = plan_migration(CostModel(shared), holdings=holdings, target=target)
    assert migration.rounds == tuple(range(len(migration.transfers)))
    parallel = plan_migration(CostModel(job), holdings=holdings, target=target)
    assert len(set(parallel.rounds)) < len(parallel.transfers)


def test_the_hand_off_per_transfer_is_fitted_to_the_profiled_chain():
    from dataclasses import replace

    job = uniform_job(dp=2, pp=2)
    chain = ring(job, 4, 1)
    assert [(t.src, t.dst) for t in chain] == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert all(t.num_bytes == CostModel(job).moved_bytes(1, 2) for t in chain)
    modelled = sum(transfer_s(CostModel(job), t) for t in chain)
    wait = fit_transfer_wait(job, chain, modelled + 0.004)
    assert wait == pytest.approx(0.001)  # 4 ms more over 4 transfers
    fitted = replace(job, cluster=replace(job.cluster, transfer_wait_s=wait))
    assert sum(transfer_s(CostModel(fitted), t) for t in chain) == pytest.approx(modelled + 0.004)
    assert fit_transfer_wait(job, chain, modelled / 2) == 0.0  # faster than modelled: none
