"""`auto`: simulate every other planner's plan and keep the fastest (DESIGN.md: the simulator is
the objective of every searching planner)."""
from __future__ import annotations

import math
from collections.abc import Sequence

from ..cost import CostModel
from ..errors import ConfigError, unknown_name
from ..plan import Plan
from ..profile import ModelProfile
from ..simulate import simulate
from .options import positive_int, reject_unknown

DEFAULT_TOLERANCE = 0.02


def plan(profile: ModelProfile, cost: CostModel, candidates: tuple[str, ...] | None = None,
         tolerance: float = DEFAULT_TOLERANCE, channels: int | None = None, overlap_forward: bool | None = False,
         **options) -> Plan:
    """The candidate plan with the smallest simulated iteration time, where a later candidate
    (the registry lists simpler planners first) replaces the best so far only when it is faster by
    more than `tolerance` of that time: the simulator charges an op's host time only as a mean
    (the cost model's `host`), and not what updates in the forward pass cost the runtime, so a
    smaller predicted gain is not worth a more complex plan.
    `channels`: the process groups the runtime has; passed to candidates that take it, and a
    candidate plan needing more is left out.
    `overlap_forward`: passed to the candidates; None: each candidate's plan as made, then the
    same plan with its waits deferred to the next forward (``Plan.with_deferred_waits``), which must
    also win by `tolerance`. Not the default: on the emulated cluster the deferred plans ran 5.8%
    slower than the same plans waited for at the step (median over 16 pairs) where the simulator
    predicted them about 5% faster (benchmarks/REPRODUCTION.md)."""
    from . import get, names, option_names

    reject_unknown("auto", options, tuple(option_names("auto")))
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not math.isfinite(tolerance) \
            or not 0 <= tolerance < 1:
        raise ConfigError(f"auto: 'tolerance' must be a number in [0, 1), got {tolerance!r}")
    pool = [name for name in names() if name != "auto"]
    if candidates is not None:
        if isinstance(candidates, str) or not isinstance(candidates, Sequence) or not candidates:
            raise ConfigError(f"auto: 'candidates' must be a non-empty list of planner names, got {candidates!r}")
        for name in candidates:
            if name not in pool:
                raise unknown_name("auto candidate", name, pool)
    if channels is not None:
        positive_int("auto", "channels", channels)
    if overlap_forward is not None and not isinstance(overlap_forward, bool):
        raise ConfigError(f"auto: 'overlap_forward' must be true, false or null, got {overlap_forward!r}")
    best: tuple[float, Plan] | None = None
    for name in pool if candidates is None else candidates:
        fitted = {"channels": channels} if channels is not None and "channels" in option_names(name) else {}
        if overlap_forward is not None:
            fitted["overlap_forward"] = overlap_forward
        candidate = get(name)(profile, cost, **fitted)
        if channels is not None and candidate.channels > channels:
            continue
        variants = (candidate,) if overlap_forward is not None else (candidate, candidate.with_deferred_waits())
        for variant in variants:
            time = simulate(variant, profile, cost).iteration_time
            if best is None or time < best[0] * (1 - tolerance):
                best = (time, variant)
    if best is None:
        raise ConfigError(f"auto: every candidate plan needs more than {channels} channel(s) (raise 'channels')")
    chosen = best[1]
    return Plan(chosen.ops, "auto", {"chosen": chosen.planner, **chosen.options})
