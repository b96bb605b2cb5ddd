"""How a planner decision looks: blocks for the output layer, from a DecisionReport."""

from __future__ import annotations

from pydantic import BaseModel

from chameleon_cli.output import Block, Fields, Table
from chameleon_cli.units import fmt_bytes, fmt_ranges, fmt_s
from planner.choice.report import DecisionReport, LayoutOut
from planner.choice.stragglers import SlowChoice


def decision_blocks(r: DecisionReport, *, cluster: str, model: str) -> list[Block]:
    blocks: list[Block] = [
        Fields(
            "Failure",
            [
                ("cluster / model", f"{cluster} / {model}"),
                ("failed ranks", fmt_ranges(r.failed) or "none"),
                ("failed workers", fmt_ranges(r.failed_workers) or "none"),
                ("failure-free step", fmt_s(r.failure_free_step_time_s)),
                ("time to next failure (D)", f"{fmt_s(r.mtbf_s)} ({r.mtbf_source})"),
                (
                    "search",
                    f"{r.search_ms:.1f} ms (+{r.templates_ms:.1f} ms of templates at job start)",
                ),
            ],
        )
    ]
    rows = []
    chosen_row = set()
    for i, c in enumerate(r.candidates):
        if r.chosen is not None and c.policy == r.chosen.policy:
            chosen_row.add(i)
        memory = (
            f"{fmt_bytes(c.peak_memory_bytes)} / {fmt_bytes(c.memory_limit_bytes)}"
            if c.peak_memory_bytes is not None
            else "-"
        )
        rows.append(
            [
                c.policy,
                "yes" if c.feasible else f"no: {c.reason}",
                c.label or "-",
                fmt_s(c.step_time_s),
                f"{c.throughput_vs_failure_free:.1%}" if c.throughput_vs_failure_free else "-",
                memory,
                fmt_s(c.transition_s),
                _risk(c.risk_s, c.restart_share),
                f"{c.score:.2f}" if c.score is not None else "-",
            ]
        )
    blocks.append(
        Table(
            "Candidates (score = samples/s expected until the next failure, "
            "less the risk its layout takes at the one after)",
            [
                "policy",
                "feasible",
                "plan",
                "step",
                "vs failure-free",
                "peak memory / limit",
                "transition",
                "next-failure risk",
                "score",
            ],
            rows,
            highlight=frozenset(chosen_row),
        )
    )
    if r.chosen is None:
        return blocks
    blocks.append(
        Fields(
            f"Chosen: {r.chosen.policy}",
            [
                ("plan", r.chosen.label),
                ("step time", fmt_s(r.chosen.step_time_s)),
                ("transition", fmt_s(r.chosen.transition_s)),
                ("workers", str(r.chosen.layout.num_workers)),
            ],
        )
    )
    blocks.append(layout_table(r.chosen.layout))
    m = r.migration
    if m.transfers:
        speedup = m.naive_est_time_s / m.est_time_s if m.est_time_s else float("inf")
        blocks.append(
            Fields(
                "Migration schedule",
                [
                    ("moved", f"{fmt_bytes(m.bytes)} in {m.transfers} transfers"),
                    ("rounds (colouring)", str(m.rounds)),
                    ("estimated time", fmt_s(m.est_time_s)),
                    (
                        "naive (first holder, one at a time)",
                        f"{fmt_s(m.naive_est_time_s)} ({speedup:.1f}x slower)",
                    ),
                ],
            )
        )
    return blocks


def _risk(risk_s: float | None, share: float | None) -> str:
    """The risk term, with the share of next failures that would force a restart."""
    if risk_s is None or share is None:
        return "-"
    if share == 0.0:
        return "0 (every layer has a spare holder)"
    if share < 0.005:
        return f"{fmt_s(risk_s)} (<1% of failures restart)"
    return f"{fmt_s(risk_s)} ({share:.0%} of failures restart)"


def layout_table(layout: LayoutOut, *, max_rows: int = 24) -> Table:
    rows = []
    for j, p in enumerate(layout.pipelines[:max_rows]):
        workers = (
            fmt_ranges([s.worker for s in p.stages])
            if len(p.stages) > 8
            else ",".join(str(s.worker) for s in p.stages)
        )
        splits = " | ".join(f"{s.first_layer}-{s.end_layer - 1}" for s in p.stages[:8])
        if len(p.stages) > 8:
            splits += f" | ... ({len(p.stages)} stages)"
        rows.append([str(j), workers, splits, str(p.micro_batches)])
    if len(layout.pipelines) > max_rows:
        rows.append(["...", f"{len(layout.pipelines) - max_rows} more pipelines", "", ""])
    for route in layout.rerouted[:max_rows]:
        rows.append(
            [
                f"from {route.home}",
                ",".join(map(str, route.hops)),
                "rerouted",
                str(route.micro_batches),
            ]
        )
    if len(layout.rerouted) > max_rows:
        rows.append(["...", f"{len(layout.rerouted) - max_rows} more rerouted shares", "", ""])
    return Table(
        "Layout (workers, layers per stage, micro-batches per step)",
        ["pipeline", "workers", "layers", "micro-batches"],
        rows,
    )


class SlowOptionOut(BaseModel):
    option: str
    feasible: bool
    reason: str | None
    plan: str
    step_time_s: float | None
    throughput_vs_even: float | None  # the even plan's step (no slowdown) over this one's
    transition_s: float
    samples: float


class SlowChoiceOut(BaseModel):
    slow: dict[int, float]  # worker -> factor
    horizon_s: float
    even_step_time_s: float
    options: list[SlowOptionOut]
    chosen: str


def slow_choice_out(choice: SlowChoice) -> SlowChoiceOut:
    options = [
        SlowOptionOut(
            option=o.name,
            feasible=o.feasible,
            reason=o.reason,
            plan=o.label,
            step_time_s=o.estimate.step_s if o.estimate else None,
            throughput_vs_even=choice.even_step_s / o.estimate.step_s if o.estimate else None,
            transition_s=o.transition_s,
            samples=o.samples,
        )
        for o in choice.options
    ]
    return SlowChoiceOut(
        slow=dict(choice.slow),
        horizon_s=choice.horizon_s,
        even_step_time_s=choice.even_step_s,
        options=options,
        chosen=choice.chosen.name,
    )


def slow_choice_blocks(out: SlowChoiceOut, *, cluster: str, model: str) -> list[Block]:
    slow = ", ".join(f"worker {w} at 1/{f:g} speed" for w, f in sorted(out.slow.items()))
    head = Fields(
        "Slowdown",
        [
            ("cluster / model", f"{cluster} / {model}"),
            ("slow", slow),
            ("expected to last", fmt_s(out.horizon_s)),
            ("step without it", fmt_s(out.even_step_time_s)),
            ("chosen", out.chosen),
        ],
    )
    rows = [
        [
            o.option,
            "yes" if o.feasible else f"no: {o.reason}",
            o.plan or "-",
            fmt_s(o.step_time_s),
            f"{o.throughput_vs_even:.1%}" if o.throughput_vs_even else "-",
            fmt_s(o.transition_s),
            f"{o.samples:,.0f}" if o.feasible else "-",
        ]
        for o in out.options
    ]
    chosen = frozenset(i for i, o in enumerate(out.options) if o.option == out.chosen)
    table = Table(
        "Options (samples: trained over the time the slowdown lasts, less the moves there "
        "and back; a move must beat staying by 5%)",
        ["option", "feasible", "plan", "step", "vs no slowdown", "transition", "samples"],
        rows,
        highlight=chosen,
    )
    return [head, table]
