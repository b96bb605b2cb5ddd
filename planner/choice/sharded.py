"""A sharded drop-in job to the planner (HSDP: chameleon_runtime.sharding, ``Training.
shards`` = S): the launch's ranks form replica groups of S (rank r is in group r // S and
holds shard r % S of every parameter), and a group computes only whole. A plan's workers
are whole groups, so that the runtime's groups (S consecutive members of the sorted
workers) are always the launch's.

- A failure breaks the groups that lost a member (``broken_groups``): rerouting drops
  them (planner.choice.selection.sharded_options).
- Whole groups out of the plan whose members all live (a dropped group's survivors
  with the replacements of its lost members) are taken back by ``regrow``: each member
  receives its shard (parameters and optimizer state) from the lowest live member of
  its column, the sources sending in parallel, each one transfer a round.
- A broken group is re-sharded over its survivors by ``reshard`` (the paper's dynamic
  re-parallelization, applied to sharding): each survivor takes a larger shard, the rows
  it lacks from a group-mate or from a whole peer group (planner.plans.rows), in rounds
  no member sends or receives twice in; the group then runs turns of fewer
  micro-batches (planner.plans.plan.turn_counts), its members holding more.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.choice.policy import Candidate, Policy, Transition, overflow_reason
from planner.estimator.transition import groups_s, protocol
from planner.job.cost import CostModel
from planner.plans.colouring import Task, colour_rounds
from planner.plans.matching import Transfer
from planner.plans.migration import Migration, schedule_s
from planner.plans.plan import Plan, contiguous_runs, data_parallel, turn_counts
from planner.plans.rows import LostRows, move_pairs
from planner.search.layouts import Search


def plan_groups(plan: Plan, shards: int) -> list[tuple[int, ...]]:
    """A sharded plan's replica groups: its own when one was re-sharded, else ``shards``
    consecutive workers each."""
    if plan.replica_groups:
        return [tuple(g) for g in plan.replica_groups]
    w = sorted(plan.workers)
    return [tuple(w[i : i + shards]) for i in range(0, len(w), shards)]


def groups_of(workers: Sequence[int], shards: int) -> list[tuple[int, ...]]:
    """The launch's replica groups that ``workers`` touch, each as its ranks."""
    return sorted({tuple(range(w - w % shards, w - w % shards + shards)) for w in workers})


def broken_groups(workers: Sequence[int], shards: int, failed: Sequence[int]) -> list[int]:
    """The members of every group of ``workers`` that lost one of ``failed``."""
    lost = set(failed)
    return sorted(w for g in groups_of(workers, shards) if lost & set(g) for w in g if w in workers)


def ranks_text(ranks: Sequence[int]) -> str:
    """Ranks as a list ([0, 1]), or as ranges at scale ([0-63, 128-191])."""
    if len(ranks) <= 8:
        return str(sorted(ranks))
    runs = contiguous_runs(ranks)
    return "[" + ", ".join(f"{a}-{b - 1}" if b - a > 1 else str(a) for a, b in runs) + "]"


def groups_text(groups: Sequence[Sequence[int]]) -> str:
    if sum(len(g) for g in groups) <= 8:
        return str([list(g) for g in groups])
    return ranks_text([w for g in groups for w in g])


def lost_shards_reason(workers: Sequence[int], shards: int, failed: Sequence[int]) -> str | None:
    """Why nothing in place can go on when every holder of some shard was lost (a
    checkpoint is the only copy left), else None."""
    lost = set(failed)
    gone = [i for i in range(shards) if not any(w % shards == i for w in workers if w not in lost)]
    if not gone:
        return None
    return (
        f"shard(s) {gone} of the model have no live copy (every worker holding them was "
        "lost): only a checkpoint has them"
    )


def turns_reason(num_micro_batches: int, sizes: Sequence[int]) -> str:
    """Why a step is no whole turns of groups of ``sizes`` (runs of one size counted)."""
    runs: list[list[int]] = []
    for k in sizes:
        if runs and runs[-1][0] == k:
            runs[-1][1] += 1
        else:
            runs.append([k, 1])
    text = ", ".join(f"{k}" if n == 1 else f"{k} x {n}" for k, n in runs)
    return (
        f"the {num_micro_batches} micro-batches of a step are no whole turns of replica "
        f"groups of [{text}] members (each runs one a turn, every group one turn at least)"
    )


def lost_rows_reason(current: Plan, shards: int, failed: Sequence[int]) -> str | None:
    """``lost_shards_reason`` for any plan: with a re-sharded group, by the rows each
    live member holds (planner.plans.rows)."""
    if not current.replica_groups:
        return lost_shards_reason(current.workers, shards, failed)
    lost = set(failed)
    old = plan_groups(current, shards)
    try:
        move_pairs(old, [g for g in (tuple(w for w in g if w not in lost) for g in old) if g])
    except LostRows:
        return (
            "rows of the model have no live copy (every worker holding them was lost): only a "
            "checkpoint has them"
        )
    return None


def uneven_reason(workers: int, num_micro_batches: int, shards: int) -> str | None:
    if workers == 0:
        return "no whole replica group is left"
    if num_micro_batches % shards:
        return (
            f"the {num_micro_batches} micro-batches of a step are not whole turns of the "
            f"{shards} members of a replica group"
        )
    return None


def regrow(search: Search, current: Plan, alive: Sequence[int]) -> Candidate:
    """Take back every group out of ``current`` whose members are all in ``alive``, and
    grow every re-sharded group whose missing members are back (replacements) to whole:
    each member that holds nothing healed shard by shard from its column, the members
    of a grown group re-sharded to the whole group's rows (module doc)."""
    job = search.job
    shards = job.training.shards
    held = set(current.workers)
    live = set(alive)
    old = plan_groups(current, shards)
    launch = groups_of(list(live), shards)
    back = [g for g in launch if set(g) <= live and not set(g) & held]
    grown = {
        g: next(h for h in old if set(h) < set(g))
        for g in launch
        if set(g) <= live and any(set(h) < set(g) for h in old)
    }
    if not back and not grown:
        return Candidate(Policy.REPARALLELIZE, reason="no whole replica group to take back")
    groups = sorted([*(h for h in old if h not in grown.values()), *grown, *back])
    workers = [w for g in groups for w in g]
    m = job.training.num_micro_batches
    sizes = [len(g) for g in groups]
    reason = uneven_reason(len(workers), m, shards)
    if reason is None and turn_counts(m, sizes) is None:
        reason = turns_reason(m, sizes)
    if reason is not None:
        return Candidate(Policy.REPARALLELIZE, reason=reason)
    params = int(job.model.total("num_params", 0, current.num_layers))
    state = job.training.moved_bytes_per_param * params
    # (a shard's rows are where its index says only in a whole group)
    whole = {w for g in old if len(g) == shards for w in g}
    transfers: list[Transfer] = []
    for w in sorted(set(workers) - held):
        src = min((h for h in whole if h % shards == w % shards), default=None)
        if src is None:
            return Candidate(Policy.REPARALLELIZE, reason="no whole replica group to heal from")
        transfers.append(Transfer(src, w, 0, current.num_layers, state // shards))
    if grown:  # the grown groups' holders cut their rows as a whole group does
        for src, dst, share in move_pairs(old, groups):
            transfers.append(Transfer(src, dst, 0, current.num_layers, int(share * state)))
    plan = data_parallel(workers, m, shards, current.num_layers, sizes)
    said = [f"take back replica group(s) {groups_text(back)}"] if back else []
    if grown:
        said.append(f"grow re-sharded group(s) {groups_text(list(grown.values()))} whole")
    label = ", ".join(said) + ", healed shard by shard"
    sources = {t.src for t in transfers}
    return moved_candidate(
        search, current, plan, transfers, tuple(old) if grown else (),
        survivors=workers, members=sources, label=label,
    )  # fmt: skip


def reshard(search: Search, current: Plan, failed: Sequence[int]) -> Candidate:
    """Re-shard every group that lost a member over its survivors (module doc)."""
    job = search.job
    shards, m = job.training.shards, job.training.num_micro_batches
    lost = set(failed)
    old = plan_groups(current, shards)
    new = [g for g in (tuple(w for w in g if w not in lost) for g in old) if g]
    changed = [g for g in new if g not in old]
    if not changed:
        return Candidate(Policy.REPARALLELIZE, reason="no replica group lost a member")
    reason = lost_rows_reason(current, shards, failed)
    if reason is not None:
        return Candidate(Policy.REPARALLELIZE, reason=reason)
    pairs = move_pairs(old, new)
    sizes = [len(g) for g in new]
    if turn_counts(m, sizes) is None:
        return Candidate(Policy.REPARALLELIZE, reason=turns_reason(m, sizes))
    layers = current.num_layers
    plan = data_parallel([w for g in new for w in g], m, shards, layers, sizes)
    state = job.training.moved_bytes_per_param * job.model.total("num_params", 0, layers)
    transfers = [Transfer(s, d, 0, layers, int(share * state)) for s, d, share in pairs]
    members = {w for g in new for w in g}
    label = f"re-shard replica group(s) {groups_text(changed)} over their survivors"
    return moved_candidate(
        search, current, plan, transfers, tuple(old),
        survivors=sorted(members), members=members, label=label,
    )  # fmt: skip


def moved_candidate(
    search: Search,
    current: Plan,
    plan: Plan,
    transfers: list[Transfer],
    reshard_from: tuple[tuple[int, ...], ...],
    *,
    survivors: Sequence[int],
    members: set[int],
    label: str,
) -> Candidate:
    """A re-parallelization to ``plan`` by ``transfers`` (heals, or a re-shard's row
    moves from ``reshard_from``'s groups), in rounds coloured so that no member sends or
    receives twice in one, priced: the plan's step and memory, the migration, the new
    groups and the protocol among ``members``."""
    job = search.job
    estimate = search.estimate(plan)
    if not estimate.feasible:
        return Candidate(
            Policy.REPARALLELIZE,
            reason=overflow_reason(estimate, job),
            plan=plan,
            estimate=estimate,
        )
    costs = CostModel(job)
    rounds = colour_rounds([Task((t.src, t.dst), float(t.num_bytes)) for t in transfers])
    migration = Migration(
        transfers=tuple(transfers),
        rounds=tuple(rounds),
        est_time_s=schedule_s(costs, transfers, rounds),
        naive_est_time_s=schedule_s(costs, transfers, list(range(len(transfers)))),
        naive_transfers=tuple(transfers),
        reshard_from=reshard_from,
    )
    f = job.cluster.transition_factor
    transition = Transition(
        migration_s=f * migration.est_time_s,
        groups_s=f * groups_s(job, current, plan, (), members=members),
        protocol_s=f
        * protocol(
            job, plan, survivors=survivors, members=members, current=current, moved=True
        ).total_s,
    )
    return Candidate(
        Policy.REPARALLELIZE,
        plan=plan,
        estimate=estimate,
        transition=transition,
        migration=migration,
        label=label,
    )
