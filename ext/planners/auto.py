"""`auto`: simulate every other planner's plan and keep the fastest (DESIGN.md: the simulator is
the objective of every searching planner)."""
from __future__ import annotations

import math

from ..cost import CostModel
from ..errors import ConfigError, unknown_name
from ..plan import Plan
from ..profile import ModelProfile
from ..simulate import simulate
from .options import reject_unknown

DEFAULT_TOLERANCE = 0.02


def plan(profile: ModelProfile, cost: CostModel, candidates: tuple[str, ...] | None = None,
         tolerance: float = DEFAULT_TOLERANCE, **options) -> Plan:
    """The candidate plan with the smallest simulated iteration time, where a later candidate
    (the registry lists simpler planners first) replaces the best so far only when it is faster by
    more than `tolerance` of that time: the simulator does not charge what extra ops and updates in
    the forward pass cost the runtime, so a smaller predicted gain is not worth a more complex plan."""
    from . import get, names

    reject_unknown("auto", options)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not math.isfinite(tolerance) \
            or not 0 <= tolerance < 1:
        raise ConfigError(f"auto: 'tolerance' must be a number in [0, 1), got {tolerance!r}")
    pool = [name for name in names() if name != "auto"]
    for name in candidates or ():
        if name not in pool:
            raise unknown_name("auto candidate", name, pool)
    best: tuple[float, Plan] | None = None
    for name in candidates or pool:
        candidate = get(name)(profile, cost)
        time = simulate(candidate, profile, cost).iteration_time
        if best is None or time < best[0] * (1 - tolerance):
            best = (time, candidate)
    chosen = best[1]
    return Plan(chosen.ops, "auto", {"chosen": chosen.planner, **chosen.options})
