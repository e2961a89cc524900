"""`auto`: simulate every other planner's plan and keep the fastest (DESIGN.md: the simulator is
the objective of every searching planner)."""
from __future__ import annotations

from ..cost import CostModel
from ..errors import unknown_name
from ..plan import Plan
from ..profile import ModelProfile
from ..simulate import simulate
from .options import reject_unknown


def plan(profile: ModelProfile, cost: CostModel, candidates: tuple[str, ...] | None = None, **options) -> Plan:
    """The candidate plan with the smallest simulated iteration time; ties go to the earlier name."""
    from . import get, names

    reject_unknown("auto", options)
    pool = [name for name in names() if name != "auto"]
    for name in candidates or ():
        if name not in pool:
            raise unknown_name("auto candidate", name, pool)
    best: tuple[float, Plan] | None = None
    for name in candidates or pool:
        candidate = get(name)(profile, cost)
        time = simulate(candidate, profile, cost).iteration_time
        if best is None or time < best[0]:
            best = (time, candidate)
    chosen = best[1]
    return Plan(chosen.ops, "auto", {"chosen": chosen.planner, **chosen.options})
