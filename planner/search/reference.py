"""The exhaustive plan search the fast one is checked against (small clusters only).

The search space is: any multiset of pipeline lengths over at most the surviving workers,
each pipeline split with the fastest feasible partition, micro-batches allocated by
water-filling (``planner.search.template.allocate_kinds``), workers placed by matching. This
visits every point of it and times each on the full step graph; the fast search prunes
with bounds, at most two distinct lengths and a top-k, and must not do worse. Exponential
in the number of workers: meant for tests on up to a dozen or so.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.estimator.estimate import Estimate
from planner.plans.plan import Plan
from planner.search.layouts import Proposal, Search, _as_shape, describe_shape, length_multisets
from planner.search.template import allocate_kinds


def exhaustive(search: Search, current: Plan | None, survivors: Sequence[int]) -> list[Proposal]:
    """Every feasible plan of the search space above, fastest first."""
    job = search.job
    m_total = job.training.num_micro_batches
    lengths = search.usable_lengths(len(survivors))
    out: list[Proposal] = []
    for shape in length_multisets(len(survivors), lengths):
        kinds = _as_shape(shape)
        if not search.fits(kinds):
            continue
        counts = allocate_kinds(search.kinds(kinds), m_total)
        plan = search.realise(
            current=current,
            survivors=survivors,
            shape=kinds,
            counts=counts,
        )
        est: Estimate = search.estimate(plan)
        if est.feasible:
            out.append(Proposal(plan=plan, estimate=est, label=describe_shape(kinds)))
    out.sort(key=lambda p: p.estimate.step_s)
    return out
