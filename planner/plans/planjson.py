"""A plan's JSON form: in a profile's cost table (the layout its steps ran) and, inside
a plan message, on the wire (chameleon_runtime.protocol.wire). Converted once at the
edge: everything inside the planner works on ``planner.plans.plan``'s frozen dataclasses."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from planner.plans.plan import Plan, Route, Stage


class _Json(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StageWire(_Json):
    worker: int
    first_layer: int
    end_layer: int


class RouteWire(_Json):
    home: int
    hops: list[int]
    micro_batches: list[int]


class PlanWire(_Json):
    num_layers: int
    num_micro_batches: int
    stages: list[StageWire]
    routes: list[RouteWire]
    pipelines: list[list[int]]
    replica_groups: list[list[int]] = []

    @classmethod
    def of(cls, plan: Plan) -> PlanWire:
        return cls(
            num_layers=plan.num_layers,
            num_micro_batches=plan.num_micro_batches,
            stages=[
                StageWire(worker=s.worker, first_layer=s.first_layer, end_layer=s.end_layer)
                for s in plan.stages
            ],
            routes=[
                RouteWire(home=r.home, hops=list(r.hops), micro_batches=list(r.micro_batches))
                for r in plan.routes
            ],
            pipelines=[list(p) for p in plan.pipelines],
            replica_groups=[list(g) for g in plan.replica_groups],
        )

    def to_plan(self) -> Plan:
        return Plan(
            num_layers=self.num_layers,
            num_micro_batches=self.num_micro_batches,
            stages=tuple(Stage(s.worker, s.first_layer, s.end_layer) for s in self.stages),
            routes=tuple(Route(r.home, tuple(r.hops), tuple(r.micro_batches)) for r in self.routes),
            pipelines=tuple(tuple(p) for p in self.pipelines),
            replica_groups=tuple(tuple(g) for g in self.replica_groups),
        )
