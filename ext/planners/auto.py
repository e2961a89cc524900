"""`auto`: simulate every other planner's plan and keep the fastest (the simulator is the
objective of every searching planner)."""
from __future__ import annotations

from collections.abc import Sequence

from ..cost import CostModel
from ..errors import ConfigError
from ..plan import Plan
from ..profile import ModelProfile
from ..registry import Option, fraction, optional_flag, optional_positive_int
from ..simulate import simulate
from . import PlannerSpec, bind, registry
from . import candidates as default_candidates


def plan(profile: ModelProfile, cost: CostModel, *, candidates: tuple[str, ...] | None, tolerance: float,
         channels: int | None, overlap_forward: bool | None, confidence: float, trial_seconds: float) -> Plan:
    """The candidate plan with the smallest simulated iteration time, where a later candidate
    (the registry lists simpler planners first) replaces the best so far only when it is faster by
    more than `tolerance` of that time: the simulator charges an op's host time only as a mean
    (the cost model's `host`), and not what updates in the forward pass cost the runtime, so a
    smaller predicted gain is not worth a more complex plan.

    Args:
        profile: the model's per-layer times and tensors (ModelProfile).
        cost: the all-reduce cost model; every candidate is planned and simulated with it.
        candidates: planner names, tried in this order (None: every planner that does not itself
            choose, in registry order).
        tolerance: the fraction of the best time so far by which a later candidate must be faster
            (in [0, 1)).
        channels: the process groups the runtime has; passed to candidates that take it, and a
            candidate plan needing more is left out (None: no limit, candidates keep their defaults).
        overlap_forward: passed to the candidates; None: each candidate's plan as made, then the
            same plan with its waits deferred to the next forward (``Plan.with_deferred_waits``), which
            must also win by `tolerance`. Not the default: on the emulated cluster the deferred plans
            ran 5.8% slower than the same plans waited for at the step (median over 16 pairs) where
            the simulator predicted them about 5% faster (benchmarks/results/history/cost_model.md).
        confidence, trial_seconds: for the trials of the plans on the job
            (``gradsync.runtime.measure.trials``), not for this prediction.
    """
    best: tuple[float, Plan] | None = None
    for name in candidates or default_candidates():
        fitted = {"channels": channels} if channels is not None and registry.get(name).takes_channels else {}
        if overlap_forward is not None:
            fitted["overlap_forward"] = overlap_forward
        candidate = bind(name, **fitted)(profile, cost)
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
    return Plan(chosen.ops, options={"chosen": chosen.planner, **chosen.options})


def confidence_level(value) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0.5 <= value < 1
    return None if ok else "a number in [0.5, 1)"


def positive_seconds(value) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1e6
    return None if ok else "a number of seconds > 0"


def planner_names(value) -> str | None:
    """None for a non-empty list of planners that do not choose themselves (or None), else what
    `candidates` must be."""
    pool = default_candidates()
    if value is None or (isinstance(value, Sequence) and not isinstance(value, str) and value
                         and all(name in pool for name in value)):
        return None
    return f"null or a non-empty list of planner names (candidate planners: {', '.join(sorted(pool))})"


SPEC = PlannerSpec(
    "auto", plan, "the scheduler whose simulated iteration is fastest for this model",
    options=(Option("candidates", None, planner_names, "planner names to choose among (null: all)"),
             Option("tolerance", 0.02, fraction, "how much faster a later candidate must be predicted"),
             Option("channels", None, optional_positive_int, "process groups the runtime has"),
             Option("overlap_forward", False, optional_flag,
                    "passed to the candidates; null: each candidate both ways"),
             Option("confidence", 0.95, confidence_level,
                    "trials keep DDP's buckets unless another plan is faster at this confidence"),
             Option("trial_seconds", 60.0, positive_seconds, "the most time the trials on the job take")),
    strategy="gradsync_auto", chooses=True)
