"""How long the planner takes to decide after one failure, at 32, 1,024 and 16,384 devices.

    python benchmarks/planner_latency.py [--repeat 5]

For each shipped config, the minimum over --repeat runs of: the plan search (the
reparallelize search a failure waits for), the whole decision (every policy evaluated and
one chosen), both with the job-start preparation done first (templates and shape ranking,
as `chameleon run` does), and the cold decision that prepares nothing in advance. Targets (issue 2): 32 devices under 10 ms, 1,024 under 100 ms, 16,384 under 1 s.
Where the exhaustive reference can run (the 32-device config), the chosen reparallelize
plan is compared with the best exhaustive plan.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from planner.choice.selection import decide
from planner.config import load_job
from planner.plans.layout import initial_plan
from planner.search.layouts import Search
from planner.search.reference import exhaustive

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
CASES = [
    ("ascend910b_32_gpt13b", 0.010, True),
    ("h100_1024_llama70b", 0.100, False),
    ("h100_16384_llama405b", 1.000, False),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(
        f"{'config':24} {'devices':>7} {'workers':>7} {'search ms':>9} {'decide ms':>9} {'cold ms':>8} {'target ms':>9} {'search/target':>13}"
    )
    for name, target_s, run_reference in CASES:
        job = load_job(CONFIGS / f"{name}.toml")
        current = initial_plan(job)
        failed = [current.workers[1]]
        warm, search, cold = [], [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            decide(job, current, failed)
            cold.append(time.perf_counter() - t0)
            prepared = Search(job).warm_up()
            t0 = time.perf_counter()
            decision = decide(job, current, failed, search=prepared)
            warm.append(time.perf_counter() - t0)
            search.append(decision.candidates[1].transition.search_s)
        print(
            f"{name:24} {job.cluster.num_devices:7d} {job.num_workers:7d} {min(search) * 1e3:9.1f} "
            f"{min(warm) * 1e3:9.1f} {min(cold) * 1e3:8.1f} {target_s * 1e3:9.0f} {min(search) / target_s:13.2f}"
        )
        if run_reference:
            survivors = [w for w in current.workers if w not in failed]
            t0 = time.perf_counter()
            reference = exhaustive(Search(job), current, survivors)
            ref_s = time.perf_counter() - t0
            fast = Search(job).propose(current, survivors)
            print(
                f"  exhaustive reference: {len(reference)} plans in {ref_s:.2f} s; best {reference[0].estimate.step_s:.4f} s "
                f"({reference[0].label}); fast search best {fast[0].estimate.step_s:.4f} s ({fast[0].label}); "
                f"fast/reference = {fast[0].estimate.step_s / reference[0].estimate.step_s:.4f}"
            )


if __name__ == "__main__":
    main()
